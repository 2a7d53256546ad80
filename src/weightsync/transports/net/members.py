"""Who is connected to a network trainer: each worker's control connection, on the same
listener as the versions (one port), authenticated and sealed like every stream.

A worker joins with ``{"join": index}``; the trainer answers with its session, then sends
a notice per version (the first carries the layout the worker checks against its model).
The worker tells what its host staged (``staged``), what it applied (``ack``), a version
its host could not stage (``failed``), a layout it refuses (``mismatch``) and its goodbye
(``bye``). A connection that ends without a goodbye is a lost worker, named with why.
A sharded trainer's notices carry more (every rank's address, the delivery's ``round``:
a failed round's number is delivered again, and only what was staged for this round counts).
Each worker also says where its relay listens and which host it is on (``relay``, ``host``):
with several hosts, each notice says whom that worker's host fetches from (:mod:`.relay`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.versions import NO_VERSION
from weightsync.transports.net.packed import chunk_count
from weightsync.transports.net.relay import UPSTREAM, routes
from weightsync.transports.net.seal import Seal
from weightsync.transports.net.wire import ProtocolError, recv_frame, send_frame, split_address

if TYPE_CHECKING:
    from weightsync.transports.net.publisher import JoinHandler, VersionPublisher

logger = logging.getLogger(__name__)

#: the longest one wait of the lifecycle sleeps between two looks
_TICK = 0.2
#: TCP keepalive on control connections: a host that vanishes (power, partition) is lost
#: within about this many seconds even when no version is being sent
_KEEPALIVE_S = 10


@dataclass
class _Connection:
    """One worker's control connection; ``send_lock`` orders the frames sent on it."""

    sock: socket.socket
    seal: Seal
    host: str
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    layout_sent: bool = False

    def send(self, message: dict[str, Any]) -> None:
        with self.send_lock:
            send_frame(self.sock, message, self.seal)


def keep_alive(sock: socket.socket) -> None:
    """Probe an idle connection, so that a vanished peer is noticed without traffic."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_S // 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_S // 2)


class NetMembers:
    """The workers of one network sender: joins, notices, and the waits of the lifecycle."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        #: the trainer's session (the publisher's), told to each worker as it joins
        self.session = ""
        self.cond = threading.Condition()
        #: held while a worker joins and while a version is published: a joining worker is
        #: either among the targets or is told of the version as it joins
        self.joining = threading.RLock()
        self._connections: dict[int, _Connection] = {}
        self._staged: dict[int, int] = {}
        self._staged_round: dict[int, str] = {}  # the round of the version staged last
        self._applied: dict[int, int] = {}
        self._failed: dict[int, tuple[int, str, str]] = {}  # worker -> (version, why, round)
        self._mismatch: dict[int, dict[str, str]] = {}
        self._why: dict[int, str] = {}
        self._goodbyes: set[int] = set()
        self._relay: dict[int, str] = {}  # worker -> where its relay listens
        self._host: dict[int, str] = {}  # worker -> the id of its host (its staging's)
        self._host_order: list[str] = []  # hosts by the first arrival of one of their workers
        self._came: dict[int, dict[str, str]] = {}  # version -> host -> where it fetched it
        #: (version, layout, what else its notice carries)
        self._current: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self._current_nbytes = 0  # the current version's bytes on the wire
        self._closed = False

    # ------------------------------------------------------------------ the listener's side
    @property
    def join_handler(self) -> JoinHandler:
        """The listener hands each worker's control connection to :meth:`serve`."""
        return self.serve

    def started(self, publisher: VersionPublisher) -> None:
        """The listener is up: its session is what each joining worker is told."""
        self.session = publisher.session

    def serve(self, sock: socket.socket, seal: Seal, host: str, request: dict[str, Any]) -> None:
        """A worker's control connection (the publisher's join handler): runs on the
        connection's thread until the worker leaves or is lost."""
        idx = request.get("join")
        if type(idx) is not int or not 0 <= idx < self.num_workers:
            send_frame(sock, {"error": f"worker_idx {idx!r} is out of range: this scheme has "
                                       f"num_workers={self.num_workers}"}, seal)
            return
        keep_alive(sock)
        connection = _Connection(sock, seal, host)
        if not self._join(idx, connection, request):
            return
        why = "connection closed; did the process die?"
        try:
            while True:
                message = recv_frame(sock, seal=seal, what=f"a message of worker {idx}")
                if not self._record(idx, message):
                    why = "closed its receiver"
                    break
        except (ProtocolError, IntegrityError, OSError) as exc:
            if not isinstance(exc, ProtocolError) or "closed" not in str(exc):
                why = f"connection broke ({type(exc).__name__}: {exc}); did the host go away?"
        finally:
            self._lost(idx, connection, why)

    def _join(self, idx: int, connection: _Connection, request: dict[str, Any]) -> bool:
        with self.joining:
            with self.cond:
                if self._closed:
                    return False
                old = self._connections.pop(idx, None)
                self._connections[idx] = connection
                self._staged[idx] = self._applied[idx] = NO_VERSION
                for table in (self._failed, self._mismatch, self._why, self._staged_round,
                              self._relay, self._host):
                    table.pop(idx, None)
                self._goodbyes.discard(idx)
                self._record_relay(idx, request)
                current = self._current
                route = self._join_route(idx) if current is not None else {}
                self.cond.notify_all()
            if old is not None:
                logger.warning("worker %d joined again from %s; dropping its older "
                               "connection from %s", idx, connection.host, old.host)
                with contextlib.suppress(OSError):
                    old.sock.shutdown(socket.SHUT_RDWR)
            try:
                connection.send({"welcome": idx, "session": self.session})
                if current is not None:
                    self._notify(connection, *current, route)
            except OSError as exc:
                self._lost(idx, connection, f"failed while joining: {exc}")
                return False
        logger.info("worker %d joined from %s", idx, connection.host)
        return True

    def _record(self, idx: int, message: dict[str, Any]) -> bool:
        """Take a worker's message; False once it said goodbye."""
        with self.cond:
            staged = message.get("staged")
            if type(staged) is int and staged >= self._staged.get(idx, NO_VERSION):
                self._staged_round[idx] = str(message.get("round", ""))[:64]
            for name, table in (("staged", self._staged), ("ack", self._applied)):
                version = message.get(name)
                if type(version) is int:
                    table[idx] = max(table.get(idx, NO_VERSION), version)
            self._record_source(idx, message)
            if type(message.get("failed")) is int:
                self._failed[idx] = (message["failed"], str(message.get("error"))[:2000],
                                     str(message.get("round", ""))[:64])
            if isinstance(message.get("mismatch"), str):
                self._mismatch[idx] = {name: str(message.get(name))[:500]
                                       for name in ("mismatch", "key", "expected", "got")}
            self.cond.notify_all()
            if message.get("bye"):
                self._goodbyes.add(idx)
                return False
        return True

    def _record_relay(self, idx: int, join: dict[str, Any]) -> None:
        """Where a joining worker's relay listens, and its host (its join says both)."""
        relay, host = join.get("relay"), join.get("host")
        if isinstance(relay, str) and isinstance(host, str) and 0 < len(host) <= 64:
            try:
                split_address(relay)
            except ValueError:
                return
            self._relay[idx], self._host[idx] = relay, host
            if host not in self._host_order:
                self._host_order.append(host)

    def _record_source(self, idx: int, message: dict[str, Any]) -> None:
        """Where a worker's host fetched the version it says it staged (``from``)."""
        came, staged = message.get("from"), message.get("staged")
        if not isinstance(came, str) or type(staged) is not int or idx not in self._host:
            return
        if came != "trainer":  # a relay's address: named by its host
            came = next((self._host[w] for w, a in self._relay.items() if a == came), came[:100])
        self._came.setdefault(staged, {})[self._host[idx]] = came
        for old in [v for v in self._came if v < staged - 8]:
            del self._came[old]

    def _leads(self, workers: list[int]) -> dict[str, int]:
        """Per host, the first of ``workers`` on it that has a relay: the one that fetches
        for its host and serves the hosts after it."""
        leads: dict[str, int] = {}
        for w in sorted(workers):
            if w in self._host and w in self._relay:
                leads.setdefault(self._host[w], w)
        return leads

    def came_from(self, version: int) -> dict[str, dict[str, Any]]:
        """Per host (its id) that fetched ``version``: its connected ``workers`` and
        whom it fetched from (``from``: ``"trainer"`` or another host's id)."""
        with self.cond:
            return {host: {"workers": sorted(w for w in self._connections
                                             if self._host.get(w) == host), "from": source}
                    for host, source in self._came.get(version, {}).items()}

    def routes(self, targets: list[int]) -> dict[int, dict[str, Any]]:
        """What each target's notice adds when its host is one of several: whom its host
        fetches from (the hosts above it, nearest first: :func:`~.relay.routes`), whether
        it is the worker that fetches for its host, and whether hosts fetch from it."""
        with self.cond:
            if self._current is None or "ranks" in self._current[2]:
                return {}  # a sharded trainer's: each host fetches every rank's part
            live = [w for w in sorted(targets) if w in self._connections and w in self._host]
            leads = self._leads(live)
            hosts = [h for h in self._host_order if h in leads]
            if len(hosts) < 2:
                return {}
            planned = routes(hosts, {h: self._relay[w] for h, w in leads.items()},
                             chunk_count(self._current_nbytes))
            return {w: {"sources": planned[self._host[w]].sources,
                        "lead": leads[self._host[w]] == w,
                        "feeds": planned[self._host[w]].feeds} for w in live}

    def _join_route(self, idx: int) -> dict[str, Any]:
        """A joining worker's route to the current version: the hosts that hold it,
        nearest before its own first (a restarted host takes it mostly from its peers)."""
        host = self._host.get(idx)
        if host is None or self._current is None or "ranks" in self._current[2]:
            return {}
        version = self._current[0]
        holding = [w for w in self._connections if self._host.get(w) not in (None, host) and max(
            self._staged.get(w, NO_VERSION), self._applied.get(w, NO_VERSION)) >= version]
        leads = self._leads(holding)
        order = self._host_order
        mine = order.index(host)
        nearest = sorted(leads, key=lambda h: (order.index(h) > mine,
                                               abs(order.index(h) - mine)))
        return {"sources": [self._relay[leads[h]] for h in nearest[:UPSTREAM]],
                "lead": False, "feeds": False}

    def _lost(self, idx: int, connection: _Connection, why: str) -> None:
        with self.cond:
            if self._connections.get(idx) is not connection:
                return
            del self._connections[idx]
            goodbye = idx in self._goodbyes
            self._why[idx] = "closed its receiver" if goodbye else why
            self.cond.notify_all()
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_RDWR)
        (logger.debug if goodbye or self._closed else logger.warning)(
            "worker %d (%s) %s: %s", idx, connection.host, "left" if goodbye else "lost",
            self._why[idx])

    # ------------------------------------------------------------------ the sender's side
    def published(self, version: int, layout: dict[str, Any],
                  extra: dict[str, Any] | None = None, nbytes: int = 0) -> None:
        """``version`` (of ``layout``, as the workers receive it; ``nbytes`` on the wire,
        which the relays' topology depends on) is the current one; ``extra``: what else its
        notice tells (a sharded trainer's ranks and round)."""
        with self.cond:
            self._current = (version, layout, dict(extra or {}))
            self._current_nbytes = nbytes

    def reachable(self, targets: list[int]) -> tuple[list[int], Losses]:
        with self.cond:
            found = [w for w in targets if w in self._connections]
            gone = {w: self._why.get(w, "not connected") for w in targets
                    if w not in self._connections}
        return found, gone

    def notify(self, targets: list[int], version: int) -> Losses:
        """Tell ``targets`` of ``version``; returns those whose connection failed."""
        assert self._current is not None and self._current[0] == version
        lost: Losses = {}
        routes = self.routes(targets)
        for w in targets:
            with self.cond:
                connection = self._connections.get(w)
            if connection is None:
                lost[w] = self._why.get(w, "not connected")
                continue
            try:
                self._notify(connection, *self._current, routes.get(w, {}))
            except OSError as exc:
                lost[w] = f"its connection failed ({exc})"
                self._lost(w, connection, lost[w])
        return lost

    @staticmethod
    def _notify(connection: _Connection, version: int, layout: dict[str, Any],
                extra: dict[str, Any], route: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"notice": version, **extra, **(route or {})}
        if not connection.layout_sent:
            message["layout"] = layout
        connection.send(message)
        connection.layout_sent = True

    def wait_staged(self, targets: list[int], version: int, deadline: Deadline,
                    lost: Losses, round_: str = "") -> None:
        """Until every target not in ``lost`` staged ``version`` (or newer) on its host;
        those lost, or whose host could not stage it, are added to ``lost``. ``round_``:
        a sharded delivery's, which a host staging that version must have staged."""
        with self.cond:
            while True:
                slow = []
                for w in targets:
                    if w in lost or self._has(w, version, round_):
                        continue
                    failed = self._failed.get(w)
                    if failed is not None and (failed[0] > version or (
                            failed[0] == version and failed[2] == round_)):
                        lost[w] = f"its host could not stage version {failed[0]}: {failed[1]}"
                    elif w not in self._connections:
                        lost[w] = self._why.get(w, "connection lost")
                    else:
                        slow.append(w)
                if not slow:
                    return
                if deadline.expired():
                    hosts = {w: self._connections[w].host for w in slow}
                    raise WeightSyncTimeoutError(
                        f"worker(s) {slow} (on {hosts}) did not stage version {version} within "
                        f"{deadline} (they are connected but their hosts have not got it)",
                        worker_ids=slow)
                self.cond.wait(deadline.slice(_TICK))

    def _has(self, w: int, version: int, round_: str) -> bool:
        """Worker ``w`` applied ``version`` or newer, or its host staged it (in ``round_``)."""
        staged = self._staged.get(w, NO_VERSION)
        return self._applied.get(w, NO_VERSION) >= version or staged > version or (
            staged == version and self._staged_round.get(w, "") == round_)

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Until every worker applied ``version`` or newer."""
        with self.cond:
            while True:
                if self._mismatch:
                    idx, said = next(iter(self._mismatch.items()))
                    raise SchemaMismatchError(
                        f"worker {idx} refused the weights: {said['mismatch']}",
                        key=said["key"], expected=said["expected"], got=said["got"])
                waiting = [w for w in range(self.num_workers)
                           if self._applied.get(w, NO_VERSION) < version]
                if not waiting:
                    return
                if deadline.expired():
                    gone = {w: self._why[w] for w in waiting
                            if w in self._why and w not in self._connections}
                    if gone:
                        raise WorkerLostError.naming(gone, version)
                    raise WeightSyncTimeoutError(
                        f"connect: worker(s) {waiting} did not connect and take version "
                        f"{version} within {deadline} (connected: {sorted(self._connections)})",
                        worker_ids=waiting)
                self.cond.wait(deadline.slice(_TICK))

    def held_versions(self) -> dict[int, int]:
        with self.cond:
            return {w: self._applied.get(w, NO_VERSION) for w in self._connections}

    def hosts(self) -> dict[int, str]:
        with self.cond:
            return {w: c.host for w, c in self._connections.items()}

    def close(self) -> None:
        """Tell every worker that the sender left, and end their connections."""
        with self.cond:
            self._closed = True
            connections = list(self._connections.values())
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.send({"close": True})
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)
