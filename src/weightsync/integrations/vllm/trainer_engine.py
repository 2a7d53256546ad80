"""The trainer side of the ``weightsync`` vLLM weight-transfer backend: the one engine class
vLLM's ``WeightTransferTrainerFactory`` knows for the name. It validates the init info once
(``trainer_config``) and hands each call to the object of that config's mode, one per
module: ``trainer_directory`` (one host), ``trainer_network`` (one trainer on the network
path), ``trainer_sharded`` (a sharded trainer's rank); LoRA adapters: ``trainer_adapter``.
The servers' calls are ``trainer_servers``'s, shared by all."""

from __future__ import annotations

import secrets
from typing import Any, Protocol

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from weightsync.integrations.vllm.trainer_adapter import ServedAdapter
from weightsync.integrations.vllm.trainer_config import (
    NetworkConfig,
    ShardedConfig,
    TrainerConfig,
    WeightSyncTrainerInitInfo,
    trainer_config,
)
from weightsync.integrations.vllm.trainer_directory import DirectoryMode
from weightsync.integrations.vllm.trainer_network import NetworkMode
from weightsync.integrations.vllm.trainer_servers import Servers, as_clients
from weightsync.integrations.vllm.trainer_sharded import ShardedMode
from weightsync.schemes.double_buffer import VLLMDoubleBufferWeightSender


class TrainerMode(Protocol):
    """What the engine asks of its mode: send a round's version, then close."""

    @property
    def version(self) -> int:
        """The version sent last (-1: none)."""

    def send(self) -> None: ...

    def close(self) -> None: ...


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """The trainer side. With ``directory``: commits each round's weights to the directory
    (rank 0 writes; the other ranks only iterate the source for its collectives), then tells
    vLLM which version to load. With ``address``: publishes each round's version on its own
    authenticated listener and has every server (``client``: one, or a list of them) fetch
    and load it; ``send_weights`` returns once every server serves it, or raises naming the
    servers that do not."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        #: this engine's session id, in every init and update it sends: a server serves one
        #: trainer session at a time (another's init ends this one: TrainerSessionEndedError)
        self.session = secrets.token_hex(8)
        self.servers: Servers | None = None
        self.mode: TrainerMode | None = None

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightSyncTrainerEngine:
        """Validate ``init_info`` into its mode's config, then start that mode: every rank
        calls it; version 0 is sent, and every server loads it, before this returns."""
        if source is None:
            raise ValueError("the weightsync trainer engine needs a WeightSource (e.g. ModuleSource)")
        config = trainer_config(init_info)
        rank0 = config.rank == 0 if isinstance(config, ShardedConfig) else init_info.is_sender
        engine = cls(client=client, source=source, is_sender=rank0)
        engine.mode = engine._start(config, source)
        return engine

    def _start(self, config: TrainerConfig, source: WeightSource) -> TrainerMode:
        clients = as_clients(self.client)
        adapter = None
        if not isinstance(config, ShardedConfig) and config.adapter is not None:
            adapter = ServedAdapter(config.adapter, source, clients)
        servers = self.servers = Servers(
            self.client, clients, session=self.session, timeout=config.send.timeout,
            reset_prefix_cache=config.send.reset_prefix_cache, adapter=adapter,
            pause=config.send.pause)
        if self.is_sender:
            servers.learn_labels()
        if isinstance(config, ShardedConfig):
            return ShardedMode.start(config, servers, source)
        if isinstance(config, NetworkConfig):
            return NetworkMode.start(config, servers, source, adapter, self.is_sender)
        return DirectoryMode.start(config, servers, source, adapter, self.is_sender)

    def send_weights(self) -> str:  # type: ignore[override]  # vLLM says None: ours returns the label
        """Send this round's weights, then have every vLLM worker load that version (a
        sharded trainer: every rank calls it; each sends only its own shards; in adapter
        mode: have every server answer the adapter's name with it). Returns the label the
        servers' ``weight_versions`` spans carry for it (above every label they served
        before this session; on ranks that drive no server, the version's own number)."""
        if self.mode is None:
            raise RuntimeError("the weightsync trainer engine is made by trainer_init "
                               "(WeightTransferTrainerFactory.trainer_init(init_info, ...))")
        self.mode.send()
        assert self.servers is not None
        return self.servers.label(self.mode.version)

    def shutdown(self) -> None:
        """Close this rank's listener or sender (the servers keep what they loaded)."""
        if self.mode is not None:
            self.mode.close()

    def stats(self) -> dict[str, Any]:
        """Per version sent on the network path: wire bytes, chunks and chunks sent as
        deltas (all hosts together, and per host), the hosts that got it whole and why,
        seconds; ``"last"`` is the newest; ``"whole_streams"`` counts, over the session,
        the streams that went whole with delta on (a host's first version included)."""
        if self.servers is None:
            return {"last": None, "versions": [], "whole_streams": 0}
        return self.servers.stats()

    @property
    def version(self) -> int:
        """The version sent last (-1 before ``trainer_init``; on ranks other than 0 of an
        unsharded trainer, which send nothing)."""
        return -1 if self.mode is None else self.mode.version

    @property
    def sender(self) -> VLLMDoubleBufferWeightSender | None:
        """The directory path's sender (rank 0), else None."""
        return self.mode.sender if isinstance(self.mode, DirectoryMode) else None

    @property
    def _token(self) -> str:
        """The network path's session secret (never sent to a server), else ""."""
        return self.mode.token if isinstance(self.mode, (NetworkMode, ShardedMode)) else ""

    @property
    def _adapter_dirs(self) -> dict[int, str]:
        """Adapter mode: per server, the directory its host keeps the versions in."""
        adapter = None if self.servers is None else self.servers.adapter
        return {} if adapter is None else adapter.dirs
