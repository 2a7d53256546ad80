"""The trainer engine's sharded mode (``trainer_ranks=N``, network path): a thin adapter
over ``NetWeightSyncScheme``'s sharded trainer ends. Every rank sends its own shards of
each version through a ``WeightSender`` over the scheme's rank writer, never gathered:
rank 0's ``NetRankZeroWriter`` meets the other ranks (``net_rank_writer``) and, within
each round, has every server's host fetch the version from all of them and load it (its
members are the servers: ``ServerMembers``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.integrations.vllm.server_members import ServerMembers
from weightsync.integrations.vllm.trainer_config import ShardedConfig
from weightsync.integrations.vllm.trainer_servers import Servers
from weightsync.schemes.sender import WeightSender
from weightsync.transports.net.sharded import host_token
from weightsync.transports.net.sharded_writer import (
    NetMemberPlane,
    NetRankZeroWriter,
    net_rank_writer,
)
from weightsync.transports.ranks.member import MemberWriter


def shard_source(source: Any) -> Mapping[str, Any] | torch.nn.Module:
    """A sharded rank's weights as the sender reads them (``name -> DTensor | LocalShard |
    tensor``), never gathered: vLLM's ``ModuleSource`` iterates ``full_tensor()`` (a
    collective), so its module's parameters are read instead; a mapping or a module is
    taken as is."""
    module = getattr(source, "_module", None)  # vLLM's ModuleSource keeps its module there
    if isinstance(module, torch.nn.Module):
        return dict(module.named_parameters())
    if isinstance(source, (Mapping, torch.nn.Module)):
        return source
    return dict(iter(source))  # a WeightSource of (name, tensor) pairs


class ShardedMode:
    """One rank of a sharded trainer engine: rank 0 (it drives the servers) or another."""

    def __init__(self, config: ShardedConfig, servers: Servers, source: Any) -> None:
        self.config = config
        self.servers = servers
        self.source = source
        self.timeout = config.send.timeout  # the lifecycle's deadline of each round
        #: what the servers' hosts prove to every rank (each rank derives it from the key)
        self.token = host_token(config.rank_key)
        self.writer: NetRankZeroWriter | MemberWriter | None = None
        self.sender: WeightSender | None = None

    @classmethod
    def start(cls, config: ShardedConfig, servers: Servers, source: Any) -> ShardedMode:
        """Join the other ranks and send the first version (0), on every rank."""
        mode = cls(config, servers, source)
        send = config.send
        options: dict[str, Any] = {"dtype": send.dtype, "timeout": send.timeout,
                                   "delta": config.delta, "board": config.ranks_address}
        if config.rank == 0:
            members = ServerMembers(servers, mode.token, delta=config.delta,
                                    timeout=send.timeout, sharded=True)
            mode.writer = NetRankZeroWriter(config.address, mode.token, config.rank_key,
                                            len(servers.clients), config.ranks,
                                            members=members, **options)
        else:
            mode.writer = net_rank_writer(config.address, mode.token, config.rank_key,
                                          config.rank, **options)
        sender = mode.sender = WeightSender(mode, mode.writer, len(servers.clients))
        try:
            sender.register_model(shard_source(source))
            mode._round("init", sender.connect)
        except BaseException:
            mode.close()
            raise
        return mode

    def send(self) -> None:
        """Send this round's version: this rank's shards (rank 0: and have every server
        fetch the version from every rank and load it)."""
        sender = self.sender
        assert sender is not None
        weights = shard_source(self.source)
        self._round("update", lambda: sender.send(weights))

    def _round(self, what: str, send: Callable[[], object]) -> None:
        """One version through the lifecycle; on ranks other than 0, the figures of this
        rank's own link join the engine's (rank 0's are recorded as its servers load it)."""
        started = time.perf_counter()
        send()
        if isinstance(self.writer, MemberWriter):
            assert self.sender is not None and isinstance(self.writer.plane, NetMemberPlane)
            version = self.sender.version
            own = self.writer.plane.member.own.publisher
            self.servers.record(version, what, time.perf_counter() - started,
                                own.figures(version, settle=5.0), {})

    @property
    def version(self) -> int:
        """The newest version the ranks committed (-1: none)."""
        return -1 if self.sender is None else self.sender.version

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
