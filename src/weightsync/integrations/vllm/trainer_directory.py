"""The trainer engine's directory mode (``directory=``, one host): rank 0 commits each
round's weights as a version of the directory both sides see (``VLLMDoubleBufferSyncScheme``),
then has the server load exactly that version; the other ranks only iterate the source
(its collectives)."""

from __future__ import annotations

from typing import Any

from weightsync.integrations.vllm.trainer_adapter import ServedAdapter, round_weights
from weightsync.integrations.vllm.trainer_config import DirectoryConfig
from weightsync.integrations.vllm.trainer_servers import Servers
from weightsync.schemes.double_buffer import VLLMDoubleBufferSyncScheme, VLLMDoubleBufferWeightSender


class DirectoryMode:
    """One trainer engine on the directory path: its sender (rank 0) and its server."""

    def __init__(self, config: DirectoryConfig, servers: Servers, source: Any,
                 adapter: ServedAdapter | None, is_sender: bool) -> None:
        self.config = config
        self.servers = servers
        self.source = source
        self.adapter = adapter
        self.is_sender = is_sender
        self.sender: VLLMDoubleBufferWeightSender | None = None
        self.version = -1

    @classmethod
    def start(cls, config: DirectoryConfig, servers: Servers, source: Any,
              adapter: ServedAdapter | None, is_sender: bool) -> DirectoryMode:
        """Commit the first version and have the server attach to the directory and load
        it (in adapter mode: stage it and point the adapter's name at it)."""
        mode = cls(config, servers, source, adapter, is_sender)
        weights = round_weights(source, adapter)
        if not is_sender:
            return mode
        send = config.send
        scheme = VLLMDoubleBufferSyncScheme(
            config.directory, num_workers=1 if adapter is not None else config.num_workers,
            timeout=send.timeout, dtype=send.dtype,
            adapter=None if config.adapter is None else config.adapter.name)
        sender = mode.sender = scheme.create_sender()
        if adapter is not None:
            sender.register_model(adapter.model)
            mode.version = sender.update_weights()
        else:
            sender.register_model(weights)
            mode.version = sender.update_weights(weights)
        info = {"directory": config.directory, "timeout": send.timeout,
                "num_workers": config.num_workers}
        servers.init_server(0, servers.client, info, mode.version)
        if adapter is None:
            servers.label_server(servers.client, mode.version)
        servers.point_adapter(0, servers.client, mode.version)
        return mode

    def send(self) -> None:
        """Commit this round's weights, then have the server load that version."""
        weights = round_weights(self.source, self.adapter)
        if not self.is_sender:
            return
        assert self.sender is not None
        self.version = self.sender.update_weights(None if self.adapter is not None else weights)
        self.servers.update_sole_server(self.version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
