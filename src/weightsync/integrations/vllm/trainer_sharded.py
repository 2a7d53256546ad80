"""The trainer engine's sharded mode (``trainer_ranks=N``, network path): every rank serves
its own shards of each version from its own listener, never gathered; rank 0
(``NetRankLead``) meets the other ranks (``NetRankMember``) and has every server's host
fetch the version from all of them and load it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.shards import sharded_flat
from weightsync.integrations.vllm.trainer_config import ShardedConfig
from weightsync.integrations.vllm.trainer_network import server_init_info
from weightsync.integrations.vllm.trainer_servers import Servers
from weightsync.transports.net.sharded import NetRankLead, NetRankMember, host_token


def shard_flat(source: Any) -> dict[str, Any]:
    """A sharded rank's weights as ``name -> DTensor | LocalShard | tensor``, never
    gathered: vLLM's ``ModuleSource`` iterates ``full_tensor()`` (a collective), so its
    module's parameters are read instead; a mapping or a module is taken as is."""
    module = getattr(source, "_module", None)  # vLLM's ModuleSource keeps its module there
    if isinstance(module, torch.nn.Module):
        return sharded_flat(dict(module.named_parameters()))
    if isinstance(source, (Mapping, torch.nn.Module)):
        return sharded_flat(source)
    return sharded_flat(dict(iter(source)))  # a WeightSource of (name, tensor) pairs


class ShardedMode:
    """One rank of a sharded trainer engine: rank 0's lead (it drives the servers) or
    another rank's membership."""

    def __init__(self, config: ShardedConfig, servers: Servers, source: Any) -> None:
        self.config = config
        self.servers = servers
        self.source = source
        self.lead: NetRankLead | None = None  # rank 0
        self.member: NetRankMember | None = None  # rank 1..N-1
        self.token = ""  # what the servers' hosts prove to every rank (rank 0 hands it out)
        self.version = -1
        self.addresses: list[str] = []  # every rank's, as the servers were last told
        self._next = 0  # the number of the next version

    @classmethod
    def start(cls, config: ShardedConfig, servers: Servers, source: Any) -> ShardedMode:
        """Join the other ranks and send the first version (0), on every rank."""
        mode = cls(config, servers, source)
        send = config.send
        options: dict[str, Any] = {"dtype": send.dtype, "timeout": send.timeout,
                                   "delta": config.delta, "board": config.ranks_address}
        try:
            if config.rank == 0:
                mode.token = host_token(config.rank_key)
                mode.lead = NetRankLead(config.address, config.rank_key, config.ranks, **options)
            else:
                mode.member = NetRankMember(config.address, config.rank_key, config.rank,
                                            **options)
                mode.member.open(Deadline(send.timeout))
            mode._send_version("init")
        except BaseException:
            mode.close()
            raise
        return mode

    def send(self) -> None:
        """Send this round's version: this rank's shards (rank 0: and have every server
        fetch the version from every rank and load it)."""
        self._send_version("update")

    def _send_version(self, what: str) -> None:
        flat = shard_flat(self.source)
        deadline = Deadline(self.config.send.timeout)
        version = self._next
        servers = self.servers
        if self.member is not None:
            own, started = self.member.own.publisher, time.perf_counter()
            self.version = self.member.send(flat, version, deadline)
            self._next = self.version + 1
            servers.record(self.version, what, time.perf_counter() - started,
                           own.figures(self.version, settle=5.0), {})
            return
        lead = self.lead
        assert lead is not None
        publisher = lead.own.publisher
        asked: list[bool] = []
        held = self.version

        def deliver(version: int, addresses: list[str]) -> None:
            asked.append(True)  # from here on, a server may hold this version
            self.version = version
            if addresses != self.addresses:  # a rank (re)started elsewhere: servers start over
                servers.needs_init = set(range(len(servers.clients)))
                self.addresses = addresses
            if what == "init":
                servers.needs_init = set(range(len(servers.clients)))  # (failures: again)

            def update(index: int, client: Any) -> None:
                if servers.in_flight(client):  # rank 0's verdict means the host staged it
                    servers.bring_in_flight(index, client, version, publisher, self._init_info)
                elif what == "init":
                    servers.needs_init.discard(index)
                    self._init_server(index, client)
                else:
                    servers.update_server(index, client, version, init=self._init_server)

            servers.each_server(what, version, update, lambda: None, publisher)

        try:
            lead.send(flat, version, deadline, deliver)
        finally:
            if lead.committed == version:  # committed, even if a server did not take it
                self._next = version + 1
            elif asked:  # the round failed while the hosts fetched: its number is taken
                # again by the next attempt, so every server starts over from that one
                self.version = held
                servers.needs_init = set(range(len(servers.clients)))

    def _init_info(self, index: int) -> dict[str, Any]:
        assert self.lead is not None
        info = server_init_info(self.lead.own.publisher.address, self.token, index,
                                self.config.send.timeout)
        info["addresses"] = list(self.addresses)
        return info

    def _init_server(self, index: int, client: Any) -> None:
        """Have a server's host fetch the current version from every rank and each of its
        ranks load it."""
        self.servers.init_server(index, client, self._init_info(index), self.version)
        self.servers.label_server(client, self.version)

    def close(self) -> None:
        for ranks in (self.lead, self.member):
            if ranks is not None:
                ranks.close()
        self.lead = self.member = None
