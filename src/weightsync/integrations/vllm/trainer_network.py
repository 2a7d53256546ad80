"""The trainer engine's network mode (``address=``, one trainer): each round's version is
published on the trainer's own authenticated listener (``VersionPublisher``), and every
server's host fetches it (whole, or as deltas against the version it holds) while it is
packed; ``send_weights`` returns once every server serves it, or raises naming those that
do not."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

import torch

from weightsync.integrations.vllm.trainer_adapter import ServedAdapter, round_weights
from weightsync.integrations.vllm.trainer_config import NetworkConfig
from weightsync.integrations.vllm.trainer_servers import Servers
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import PackedVersion, chunk_count, plan
from weightsync.transports.net.publisher import VersionPublisher
from weightsync.transports.net.relay import routes


def server_init_info(address: str, token: str, index: int, timeout: float) -> dict[str, Any]:
    """What server ``index``'s init on the network path carries: where the trainer listens,
    the credential its host proves there, and a ticket naming this init."""
    # each server's host gets a credential of its own: one server cannot pose as the
    # trainer to another (handshake.host_credential)
    return {"address": address, "token": host_credential(token, f"server{index}"),
            "ticket": secrets.token_hex(8), "timeout": timeout}


class NetworkMode:
    """One trainer engine on the network path: its listener (rank 0) and its servers."""

    def __init__(self, config: NetworkConfig, servers: Servers, source: Any,
                 adapter: ServedAdapter | None, is_sender: bool) -> None:
        self.config = config
        self.servers = servers
        self.source = source
        self.adapter = adapter
        self.is_sender = is_sender
        self.publisher: VersionPublisher | None = None
        self.token = ""  # the session's secret: it never leaves the trainer
        #: the servers' key among themselves (HMAC of the token): each proves its own
        #: credential of it to another's relay; it cannot pose as the trainer with it
        self.pool = ""
        self.version = -1

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
        mode.pool = hmac.new(mode.token.encode(), b"weightsync-net pool",
                             hashlib.sha256).hexdigest()
        publisher = mode.publisher = VersionPublisher(
            config.address, mode.token, timeout=config.send.timeout, delta=config.delta)
        mode.version = 0

        def init(index: int, client: Any) -> None:
            if servers.in_flight(client):
                servers.bring_in_flight(index, client, 0, publisher, mode._init_info)
                return
            servers.needs_init.discard(index)
            mode._init_server(index, client)
            servers.point_adapter(index, client, 0)

        servers.needs_init = set(range(len(servers.clients)))  # each server's init (failed: again)
        try:
            packed = mode._publish(weights)
            servers.each_server("init", 0, init, lambda: mode._fill(packed, weights), publisher)
        except BaseException:
            mode.close()
            raise
        return mode

    def send(self) -> None:
        """Publish this round's version and have every server load it."""
        weights = round_weights(self.source, self.adapter)
        if not self.is_sender:
            return
        assert self.publisher is not None
        self.version += 1
        version, packed = self.version, self._publish(weights)

        def update(index: int, client: Any) -> None:
            servers = self.servers
            relays = self._relays(index, packed.nbytes)
            if servers.in_flight(client):
                assert self.publisher is not None
                servers.bring_in_flight(index, client, version, self.publisher, self._init_info,
                                        relays)
                return
            servers.update_server(index, client, version, init=self._init_server, relays=relays)

        self.servers.each_server("update", version, update, lambda: self._fill(packed, weights),
                                 self.publisher)

    def _init_info(self, index: int) -> dict[str, Any]:
        assert self.publisher is not None
        # one server relays to none: its host keeps no relay (nor its versions for one)
        relaying = len(self.servers.clients) > 1 and self.adapter is None
        return {**server_init_info(self.publisher.address, self.token, index,
                                   self.config.send.timeout),
                "pool": self.pool if relaying else "", "delta": self.config.delta}

    def _relays(self, index: int, nbytes: int) -> list[str]:
        """Whom server ``index``'s host fetches a version from before the trainer: the
        relays of the servers above it for a version of ``nbytes`` bytes, nearest first
        (:func:`~weightsync.transports.net.relay.routes`; a server's relay is known once it
        fetched once). None in adapter mode
        (an adapter is small: each server's host fetches it from the trainer)."""
        assert self.publisher is not None
        if self.adapter is not None:
            return []
        names = [f"server{i}" for i in range(len(self.servers.clients))]
        known = {name: self.publisher.relay_of(name) for name in names}
        return routes(names, {n: a for n, a in known.items() if a is not None},
                      chunk_count(nbytes))[names[index]].sources

    def _init_server(self, index: int, client: Any) -> None:
        """Have a server's host fetch the current version and every rank load it (a new or
        restarted server gets it whole), then label it."""
        self.servers.init_server(index, client, self._init_info(index), self.version)
        if self.adapter is None:
            self.servers.label_server(client, self.version)

    def _publish(self, weights: dict[str, torch.Tensor]) -> PackedVersion:
        """Lay out this round's version and publish it before it is packed: hosts stream
        each chunk as soon as ``_fill`` has packed it."""
        assert self.publisher is not None
        dtype = self.config.send.dtype
        nbytes = plan(weights, self.version, dtype).nbytes  # layout only (no copy)
        metadata = {} if self.adapter is None else self.adapter.metadata()
        packed = plan(weights, self.version, dtype, self.publisher.spare_buffer(nbytes), metadata)
        self.publisher.publish(packed)
        return packed

    def _fill(self, packed: PackedVersion, weights: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        packed.fill(weights)
        self.servers.pack_seconds = time.perf_counter() - started

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
