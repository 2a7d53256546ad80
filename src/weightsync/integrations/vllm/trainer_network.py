"""The trainer engine's network mode (``address=``, one trainer): a thin adapter over the
network transport's send lifecycle. Each round's weights go through a ``WeightSender``
over a ``NetWriter`` (the same as ``NetWeightSyncScheme``'s trainer end) whose members are
the vLLM servers (``ServerMembers``): versions, deadlines and figures are the lifecycle's;
every server's host fetches each version (whole, or as deltas against the version it
holds; from the trainer or from the servers' hosts before it) and every server loads it;
``send_weights`` returns once every server serves it, or raises naming those that do
not."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from weightsync.integrations.vllm.server_members import ServerMembers
from weightsync.integrations.vllm.trainer_adapter import ServedAdapter, round_weights
from weightsync.integrations.vllm.trainer_config import NetworkConfig
from weightsync.integrations.vllm.trainer_servers import Servers
from weightsync.schemes.sender import WeightSender
from weightsync.transports.net.writer import NetWriter


class NetworkMode:
    """One trainer engine on the network path: its sender (rank 0) and its servers."""

    def __init__(self, config: NetworkConfig, servers: Servers, source: Any,
                 adapter: ServedAdapter | None, is_sender: bool) -> None:
        self.config = config
        self.servers = servers
        self.source = source
        self.adapter = adapter
        self.timeout = config.send.timeout  # the lifecycle's deadline of each round
        self.token = ""  # the session's secret: it never leaves the trainer
        self.writer: NetWriter | None = None
        self.sender: WeightSender | None = None

    @classmethod
    def start(cls, config: NetworkConfig, servers: Servers, source: Any,
              adapter: ServedAdapter | None, is_sender: bool) -> NetworkMode:
        """Open the listener, publish version 0 and have every server fetch and load it
        (in adapter mode: stage it and point the adapter's name at it)."""
        mode = cls(config, servers, source, adapter, is_sender)
        weights = round_weights(source, adapter)
        if not is_sender:
            return mode
        mode.token = secrets.token_hex(32)
        members = ServerMembers(servers, mode.token, delta=config.delta,
                                timeout=config.send.timeout)
        mode.writer = NetWriter(
            config.address, mode.token, len(servers.clients), timeout=config.send.timeout,
            dtype=config.send.dtype, delta=config.delta, members=members,
            metadata=None if adapter is None else adapter.metadata())
        mode.sender = WeightSender(mode, mode.writer, len(servers.clients))
        try:
            mode.sender.register_model(weights)
            mode._round(mode.sender.connect)
        except BaseException:
            mode.close()
            raise
        return mode

    def send(self) -> None:
        """Send this round's version and have every server load it."""
        weights = round_weights(self.source, self.adapter)
        if self.sender is not None:
            sender = self.sender
            self._round(lambda: sender.send(weights))

    def _round(self, send: Callable[[], object]) -> None:
        """One version through the lifecycle; its pack time joins the servers' figures."""
        try:
            send()
        finally:
            assert self.sender is not None and self.writer is not None
            self.servers.amend(self.sender.version, pack_seconds=self.writer.pack_seconds)

    @property
    def version(self) -> int:
        """The version sent last (-1: none, or a rank that sends nothing)."""
        return -1 if self.sender is None else self.sender.version

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
