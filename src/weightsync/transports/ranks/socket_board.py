"""The rank protocol's board as socket messages (:mod:`weightsync.transports.ranks`): rank
0's rank hub and each other rank's link to it, on a Unix socket of their own next to the
workers' address, or over TCP (:mod:`weightsync.transports.net.board`).

A rank proves the scheme's *rank key* (never the workers' token, which workers hold) both
ways without sending it, as a process of the scheme's user. One live connection per rank
index: a second live claimant is refused, saying so; a rank whose process died may connect
again (a restart). Records travel as ``rank.hello``/``rank.done`` (rank -> rank 0) and
``rank.plan``/``rank.outcome`` (rank 0 -> every rank). A medium's data plane may add
messages of its own on the same connections, handed to the ``heard`` callbacks of
:class:`RankHub` and :class:`RankLink` (SharedMem's slots: :mod:`weightsync.transports.shm.ranks`). Used
by SharedMem's and the network transport's sharded ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    TrainerRankLostError,
    WeightSyncError,
)
from weightsync.core.liveness import process_dying
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.accept import AcceptLoop, Admission
from weightsync.transports.local.address import ChannelListener, connect_channel
from weightsync.transports.local.auth import (
    HandshakeError,
    new_nonce,
    peer_credentials,
    proofs_match,
    rank_hub_proof,
    rank_proof,
    read_frame,
)
from weightsync.transports.local.channel import Channel, ChannelClosed, ChannelTimeout, Message
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan

logger = logging.getLogger(__name__)

#: how long a connecting rank gets for its hello
HANDSHAKE_TIMEOUT = 5.0
#: attempts whose records rank 0 and a rank keep (older ones are stale by then)
KEPT_ATTEMPTS = 8


def rank_address(address: str) -> str:
    """Where rank 0 listens for the other ranks: the workers' address plus a suffix."""
    return address + ".ranks"


@dataclass
class RankConnection:
    """One rank process's authenticated connection to rank 0."""

    rank: int
    channel: Channel
    pid: int
    serial: int
    hello: Hello | None = None
    gone: str = ""  # why it can no longer answer ('' while it may)
    who: str = ""  # how messages name its process
    heard_at: float = field(default_factory=time.monotonic)  # when it last sent anything

    def alive(self) -> bool:
        """Its connection is open and (judged where the pid is known) its process lives."""
        if not self.gone and self.pid > 0 and process_dying(self.pid):
            self.gone = f"died (pid {self.pid})"
        return not self.gone


def _peer_name(channel: Channel) -> str:
    try:
        name = channel.socket.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "a local socket"


class RankHub:
    """Rank 0's end (a :class:`~weightsync.transports.ranks.board.LeadBoard`): admits ranks
    ``1..world-1``, reads each one's records on a thread of its own, and sends rank 0's.

    By default it listens on a Unix socket beside the workers' address and admits only
    processes of ``uid``; ``listener`` (anything with ``accept(timeout) -> Channel | None``
    and ``close()``, e.g. a TCP one) with ``uid=None`` admits ranks on other hosts, by the
    rank key's proof alone (a lost rank is then told by its connection, not its pid)."""

    def __init__(self, address: str, rank_key: str, uid: int | None, world: int, *,
                 listener: Any = None,
                 heard: Callable[[RankConnection, Any, dict[str, Any]], None] | None = None
                 ) -> None:
        """``heard(connection, kind, header)``: a message of the medium's own (under
        :attr:`cond`); a KeyError, TypeError or ValueError drops the rank as one that broke
        the protocol."""
        self.world = world
        self._heard = heard
        self._key, self._uid = rank_key, uid
        self._listener = listener if listener is not None \
            else ChannelListener(rank_address(address))
        self.cond = threading.Condition()
        self.connections: dict[int, RankConnection] = {}
        self._dones: dict[str, dict[int, Done]] = {}
        self._serials = itertools.count(1)
        #: the newest version committed, told to a rank that joins
        self.committed = NO_VERSION
        self._stop = False
        # accept errors (EMFILE, ...) are retried, pending handshakes capped, each with
        # one deadline: a flood of connections cannot kill the board
        self._acceptor: AcceptLoop[Channel] = AcceptLoop(
            self._listener.accept, self._admit, socket_of=lambda channel: channel.socket,
            what="trainer rank 0's rank board", handshake_timeout=HANDSHAKE_TIMEOUT,
            name="weightsync-ranks", connection_name="weightsync-rank-handshake")

    def start(self) -> None:
        self._acceptor.start()

    # ------------------------------------------------------------------ admitting ranks
    def _admit(self, channel: Channel, admission: Admission) -> None:
        deadline = admission.deadline
        try:
            pid, who = 0, "a process at " + _peer_name(channel)
            if self._uid is not None:
                peer = peer_credentials(channel.socket)
                if peer.uid != self._uid:
                    raise HandshakeError(f"pid {peer.pid} runs as uid {peer.uid}, not {self._uid}")
                pid, who = peer.pid, f"pid {peer.pid}"
            nonce = new_nonce()
            channel.send({"t": "rank.challenge", "nonce": nonce}, timeout=deadline.remaining())
            hello = read_frame(channel.socket, deadline.remaining)
            rank, theirs = hello.get("rank"), hello.get("nonce")
            if (hello.get("t") != "rank.hello" or not isinstance(rank, int)
                    or isinstance(rank, bool) or not isinstance(theirs, str) or len(theirs) > 64
                    or not proofs_match(rank_proof(self._key, nonce, theirs, rank),
                                        hello.get("proof"))):
                raise HandshakeError("not a trainer rank of this scheme (no rank key)")
            if not 1 <= rank < self.world:
                raise HandshakeError(f"rank {rank} is out of range (trainer_ranks={self.world})")
            proof = rank_hub_proof(self._key, nonce, theirs, rank)
            with self.cond:
                old = self.connections.get(rank)
                if old is not None and old.alive() and not old.channel.peer_closed():
                    channel.send({"t": "rank.refused", "proof": proof, "error": (
                        f"trainer rank {rank} is already held by a live process "
                        f"({old.who}); a rank index is claimed by one process at a time")},
                        timeout=deadline.remaining())
                    raise HandshakeError(f"rank {rank} is already held by {old.who}; "
                                         f"refused {who}")
                channel.send({"t": "rank.welcome", "joined_at": self.committed, "proof": proof},
                             timeout=deadline.remaining())
                connection = RankConnection(rank, channel, pid, next(self._serials), who=who)
                if old is not None:
                    old.gone = old.gone or f"restarted ({who} took its place)"
                    old.channel.close()
                self.connections[rank] = connection
                self.cond.notify_all()
            logger.info("trainer rank %d joined (%s)", rank, who)
        except (HandshakeError, ChannelClosed, ChannelTimeout, TimeoutError, OSError) as exc:
            admission.refused("refused a trainer-rank connection: %s", exc)
            channel.close()
            return
        admission.done()  # admitted: its read loop is no handshake
        threading.Thread(target=self._read_loop, args=(connection,), daemon=True,
                         name=f"weightsync-rank-{rank}").start()

    def _read_loop(self, connection: RankConnection) -> None:
        """Take in one rank's records until its connection ends."""
        channel, where = connection.channel, f"trainer rank {connection.rank}"
        while not self._stop and not connection.gone:
            try:
                if not channel.readable(0.2):
                    continue
                message = channel.recv(timeout=5.0, max_payload=0)
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                with self.cond:
                    connection.gone = connection.gone or f"hung up ({exc})"
                    self.cond.notify_all()
                return
            header, kind = message.header, message.header.get("t")
            try:
                with self.cond:
                    connection.heard_at = time.monotonic()
                    if kind == "rank.hello":
                        hello = Hello.from_json(header.get("hello"), where)
                        if hello.rank != connection.rank:
                            raise IntegrityError(f"{where} said hello as rank {hello.rank}")
                        connection.hello = hello
                    elif kind == "rank.done":
                        done = Done.from_json(header.get("done"), where)
                        if done.rank == connection.rank and done.attempt in self._dones:
                            self._dones[done.attempt][done.rank] = done
                    elif self._heard is not None:
                        self._heard(connection, kind, header)
                    self.cond.notify_all()
            except (IntegrityError, KeyError, TypeError, ValueError) as exc:
                logger.warning("%s broke the protocol (%s): dropped", where, exc)
                with self.cond:
                    connection.gone = f"broke the protocol ({exc})"
                    self.cond.notify_all()
                channel.close()
                return

    # ------------------------------------------------------------------ the board
    def hellos(self) -> dict[int, Hello]:
        with self.cond:
            return {r: c.hello for r, c in self.connections.items()
                    if c.hello is not None and c.alive()}

    def lost(self, rank: int, incarnation: str) -> str:
        with self.cond:
            connection = self.connections.get(rank)
            if connection is None:
                return "is not connected"
            if connection.hello is not None and connection.hello.incarnation != incarnation:
                return "restarted or registered another model"
            if connection.hello is None:
                return "restarted (a new process connected)"
            return "" if connection.alive() else connection.gone

    def ping(self) -> None:
        """Ask every rank for a word (a rank inside its send answers at once): the answers
        keep :meth:`silent_for` low for ranks that still run."""
        self.tell({"t": "rank.ping"})

    def silent_for(self, rank: int) -> float:
        """Seconds since rank ``rank`` last sent anything (0 if it is not connected)."""
        with self.cond:
            connection = self.connections.get(rank)
            return 0.0 if connection is None else time.monotonic() - connection.heard_at

    def post_plan(self, plan: Plan) -> None:
        with self.cond:
            self._dones[plan.attempt] = {}
            for old in list(self._dones)[:-KEPT_ATTEMPTS]:
                del self._dones[old]
        self.tell({"t": "rank.plan", "plan": plan.to_json()})

    def dones(self, attempt: str) -> dict[int, Done]:
        with self.cond:
            return dict(self._dones.get(attempt, {}))

    def post_outcome(self, outcome: Outcome) -> None:
        if outcome.committed:
            self.committed = outcome.version
        self.tell({"t": "rank.outcome", "outcome": outcome.to_json()})

    def wait(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait(seconds)

    def tell(self, header: dict[str, Any], fds: list[int] | None = None) -> None:
        """Send ``header`` to every rank connected now; one that cannot take it is gone."""
        with self.cond:
            targets = [c for c in self.connections.values() if not c.gone]
        for connection in targets:
            try:
                connection.channel.send(header, fds=fds or [], timeout=5.0)
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                with self.cond:
                    connection.gone = connection.gone or f"hung up ({exc})"

    def close(self) -> None:
        self._stop = True
        self._acceptor.stop(1.0)
        self._listener.close()
        with self.cond:
            for connection in self.connections.values():
                connection.gone = connection.gone or "closed"
                connection.channel.close()
            self.connections.clear()


class RankLink:
    """Rank ``rank``'s connection to rank 0 (a
    :class:`~weightsync.transports.ranks.board.MemberBoard`): read only within its own
    calls."""

    def __init__(self, address: str, rank_key: str, uid: int | None, rank: int, *,
                 connect: Callable[[float | None], Channel] | None = None,
                 heard: Callable[[Message], None] | None = None) -> None:
        """``connect(timeout)``: how to reach rank 0's listener other than its Unix socket
        (e.g. over TCP; with ``uid=None``: no peer credentials, the rank key's proof alone).
        ``heard(message)``: a message of the medium's own from rank 0."""
        self._heard = heard
        self.address = rank_address(address) if connect is None else address
        self.key, self.uid, self.rank = rank_key, uid, rank
        self._connect = connect
        self.channel: Channel | None = None
        self.joined_at = NO_VERSION
        self._plans: list[Plan] = []
        self._outcomes: dict[str, Outcome] = {}
        self._gone = ""

    def open(self, deadline: Deadline) -> None:
        try:
            channel = connect_channel(self.address, deadline.remaining()) \
                if self._connect is None else self._connect(deadline.remaining())
        except ChannelTimeout as exc:
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: trainer rank 0 is not listening after {deadline} "
                "(has rank 0 created its sender and called connect()?)", rank=0) from exc
        try:
            if self.uid is not None:
                peer = peer_credentials(channel.socket)
                if peer.uid != self.uid:
                    raise HandshakeError(f"rank 0's address is held by uid {peer.uid}")
            challenge = read_frame(channel.socket, deadline.remaining)
            nonce, hub_nonce = new_nonce(), str(challenge.get("nonce"))
            channel.send({"t": "rank.hello", "rank": self.rank, "nonce": nonce,
                          "proof": rank_proof(self.key, hub_nonce, nonce, self.rank)},
                         timeout=deadline.remaining())
            welcome = channel.recv(timeout=deadline.remaining(), max_payload=0)
            if not proofs_match(rank_hub_proof(self.key, hub_nonce, nonce, self.rank),
                                welcome.header.get("proof")):
                raise HandshakeError("the process at rank 0's address does not hold the "
                                     "scheme's rank key")
        except (HandshakeError, ChannelClosed, ChannelTimeout, TimeoutError) as exc:
            channel.close()
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: could not join rank 0: {exc}", rank=0) from exc
        if welcome.header.get("t") == "rank.refused":
            channel.close()
            raise WeightSyncError(f"trainer rank {self.rank} was refused by rank 0: "
                                  f"{welcome.header.get('error')}")
        self.joined_at = int(welcome.header.get("joined_at", NO_VERSION))
        self.channel = channel

    # ------------------------------------------------------------------ the board
    def post_hello(self, hello: Hello) -> None:
        self.send({"t": "rank.hello", "hello": hello.to_json()})

    def post_done(self, done: Done) -> None:
        self.send({"t": "rank.done", "done": done.to_json()})

    def plans(self) -> list[Plan]:
        return list(self._plans)

    def outcome(self, attempt: str) -> Outcome | None:
        return self._outcomes.get(attempt)

    def lead_lost(self) -> str:
        return self._gone

    def wait(self, seconds: float) -> None:
        """Take in rank 0's messages: the first within ``seconds``, then all waiting."""
        timeout = seconds
        while self.channel is not None and not self._gone:
            try:
                if not self.channel.readable(timeout):
                    return
                message = self.channel.recv(timeout=5.0, max_payload=0)
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                self._gone = f"hung up ({exc})"
                return
            self._take(message)
            timeout = 0.0

    def _take(self, message: Message) -> None:
        header, kind, where = message.header, message.header.get("t"), "trainer rank 0"
        if kind == "rank.plan":
            self._plans = [*self._plans, Plan.from_json(header.get("plan"), where)][-KEPT_ATTEMPTS:]
        elif kind == "rank.outcome":
            outcome = Outcome.from_json(header.get("outcome"), where)
            self._outcomes[outcome.attempt] = outcome
            for old in list(self._outcomes)[:-KEPT_ATTEMPTS]:
                del self._outcomes[old]
        elif kind == "rank.ping":
            self.send({"t": "rank.pong"})
        elif self._heard is not None:
            self._heard(message)

    def send(self, header: dict[str, Any]) -> None:
        assert self.channel is not None
        try:
            self.channel.send(header, timeout=5.0)
        except (ChannelClosed, ChannelTimeout, OSError) as exc:
            self._gone = f"hung up ({exc})"
            raise TrainerRankLostError(f"trainer rank {self.rank}: trainer rank 0 hung up: "
                                       f"{exc}", rank=0) from exc

    def close(self) -> None:
        if self.channel is not None:
            with contextlib.suppress(OSError):
                self.channel.close()
            self.channel = None
