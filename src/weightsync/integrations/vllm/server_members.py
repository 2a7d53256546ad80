"""The vLLM servers as the members a network writer serves (``NetWriter(members=...)``):
where a scheme's worker hears of a version on its control connection, a server is told
over vLLM's own API (init, start, update, finish), and its host fetches the version from
the trainer's listener, or from the hosts of the servers before it (relays). A version
is delivered once every server serves it, labelled; those that do not are named."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import WeightSyncError
from weightsync.integrations.vllm.trainer_servers import ServerRound, Servers
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import chunk_count
from weightsync.transports.net.publisher import JoinHandler, VersionPublisher
from weightsync.transports.net.relay import routes


def server_init_info(address: str, token: str, index: int, timeout: float) -> dict[str, Any]:
    """What server ``index``'s init on the network path carries: where the trainer listens,
    the credential its host proves there, and a ticket naming this init."""
    # each server's host gets a credential of its own: one server cannot pose as the
    # trainer to another (handshake.host_credential)
    return {"address": address, "token": host_credential(token, f"server{index}"),
            "ticket": secrets.token_hex(8), "timeout": timeout}


def pool_key(token: str) -> str:
    """The servers' key among themselves (an HMAC of the session's token): each proves its
    own credential of it to another's relay; it cannot pose as the trainer with it."""
    return hmac.new(token.encode(), b"weightsync-net pool", hashlib.sha256).hexdigest()


class ServerMembers:
    """The servers of one trainer engine on the network path, as a network writer's
    members: the first version delivered initialises every server (its host fetches it
    whole and every rank loads it), each later one updates them (in flight on an HTTP
    server: staged while it generates, then taken inside vLLM's pause). With ``sharded``,
    the members of a sharded trainer's rank 0 (``NetRankZeroWriter``): each host fetches
    every rank's part (the addresses each round's notice carries), within the round."""

    #: servers take no control connection: the listener refuses a worker that tries to join
    join_handler: JoinHandler | None = None

    def __init__(self, servers: Servers, token: str, *, delta: bool, timeout: float,
                 sharded: bool = False) -> None:
        self.servers = servers
        self._token = token  # the session's secret: only credentials of it leave the trainer
        self.pool = pool_key(token)
        self.delta = delta
        self.timeout = timeout
        self.sharded = sharded
        self.joining = threading.RLock()
        self.publisher: VersionPublisher | None = None
        self.version = -1  # the version being delivered, or delivered last
        self.addresses: list[str] = []  # a sharded trainer's: every rank's, as last told
        self._nbytes = 0  # its bytes on the wire (the relays' topology depends on them)
        self._committed_notice = False  # a sharded trainer's notice that a round committed
        self._initialised = False  # the first version initialises every server
        self._round: ServerRound | None = None
        self._held: dict[int, int] = {}

    def started(self, publisher: VersionPublisher) -> None:
        self.publisher = publisher

    def published(self, version: int, layout: dict[str, Any],
                  extra: dict[str, Any] | None = None, nbytes: int = 0) -> None:
        """The version the servers are told of next; a sharded trainer's notice carries
        every rank's address (a rank that (re)started elsewhere: every server starts over),
        and, once the ranks committed the round, says so."""
        extra = extra or {}
        self._committed_notice = self.sharded and extra.get("committed") == version
        if self._committed_notice:
            return
        addresses = list(extra.get("ranks", []))
        if addresses != self.addresses:
            self.servers.needs_init = set(range(len(self.servers.clients)))
            self.addresses = addresses
        if version <= self.version:  # a round failed after the servers were called: its
            # number is taken again, and a server may hold the failed attempt: start over
            self.servers.needs_init = set(range(len(self.servers.clients)))
        self.version, self._nbytes = version, nbytes

    def reachable(self, targets: list[int]) -> tuple[list[int], Losses]:
        return targets, {}  # a server is reached by calling it: one that fails is named

    def notify(self, targets: list[int], version: int) -> Losses:
        """Start the version's calls on every server (they run while this returns); the
        first version initialises every server. Nothing once a sharded round committed:
        its servers took the version within the round."""
        if self._committed_notice:
            return {}
        servers = self.servers
        if not self._initialised:
            self._initialised = True
            servers.needs_init = set(range(len(servers.clients)))  # (failed: again)
            self._round = servers.start_round("init", version, self._init)
        else:
            self._round = servers.start_round("update", version, self._update)
        return {}

    def wait_staged(self, targets: list[int], version: int, deadline: Deadline,
                    lost: Losses, round_: str = "") -> None:
        """Until every server serves ``version`` (within the engine's timeout), or raise one
        error naming each server that does not (they keep serving the version they held)."""
        calls, self._round = self._round, None
        if calls is None or calls.version != version:
            raise WeightSyncError(f"version {version} was not delivered to the servers")
        assert self.publisher is not None
        try:
            self.servers.finish_round(calls, self.publisher)
        finally:  # those that failed keep what they held
            self._held.update(dict.fromkeys(calls.served, version))

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Nothing to wait for: a server is initialised within the round that reaches it."""

    def held_versions(self) -> dict[int, int]:
        return dict(self._held)

    def came_from(self, version: int) -> dict[str, dict[str, Any]]:
        """Per server: ``from``, ``"trainer"`` or the server whose host relayed it."""
        for record in reversed(self.servers.stats()["versions"]):
            if record["version"] == version:
                return {name: {"from": source} for name, source in record["fetched_from"].items()}
        return {}

    def close(self) -> None:
        """The servers keep what they loaded."""

    # ------------------------------------------------------------------ the calls
    def _init(self, index: int, client: Any) -> None:
        """Server ``index``'s call of the first version: initialise it (in adapter mode,
        then point the adapter's name at it)."""
        servers = self.servers
        if servers.in_flight(client):
            assert self.publisher is not None
            servers.bring_in_flight(index, client, self.version, self.publisher,
                                    self.init_info)
            return
        servers.needs_init.discard(index)
        self._init_server(index, client)
        servers.point_adapter(index, client, self.version)

    def _update(self, index: int, client: Any) -> None:
        """Server ``index``'s call of a later version (initialised again first if it
        failed before), from the relays of the servers before it when there are any."""
        servers, version = self.servers, self.version
        relays = self._relays(index)
        if servers.in_flight(client):
            assert self.publisher is not None
            servers.bring_in_flight(index, client, version, self.publisher, self.init_info,
                                    relays)
            return
        servers.update_server(index, client, version, init=self._init_server, relays=relays)

    def init_info(self, index: int) -> dict[str, Any]:
        """What server ``index``'s init carries on this listener."""
        assert self.publisher is not None
        info = server_init_info(self.publisher.address, self._token, index, self.timeout)
        if self.sharded:  # each host fetches every rank's part, from the ranks
            return {**info, "addresses": list(self.addresses)}
        # one server relays to none: its host keeps no relay (nor its versions for one)
        relaying = len(self.servers.clients) > 1 and self.servers.adapter is None
        return {**info, "pool": self.pool if relaying else "", "delta": self.delta}

    def _relays(self, index: int) -> list[str]:
        """Whom server ``index``'s host fetches the version from before the trainer: the
        relays of the servers above it (:func:`~weightsync.transports.net.relay.routes`;
        a server's relay is known once it fetched once), nearest first. None in adapter
        mode (an adapter is small: each server's host fetches it from the trainer) nor for
        a sharded trainer (each host fetches from every rank)."""
        assert self.publisher is not None
        if self.servers.adapter is not None or self.sharded:
            return []
        names = [f"server{i}" for i in range(len(self.servers.clients))]
        known = {name: self.publisher.relay_of(name) for name in names}
        return routes(names, {n: a for n, a in known.items() if a is not None},
                      chunk_count(self._nbytes))[names[index]].sources

    def _init_server(self, index: int, client: Any) -> None:
        """Have a server's host fetch the current version and every rank load it (a new or
        restarted server gets it whole), then label it."""
        self.servers.init_server(index, client, self.init_info(index), self.version)
        if self.servers.adapter is None:
            self.servers.label_server(client, self.version)
