"""How the ranks of a sharded trainer meet on one host: rank 0's rank hub and each other
rank's link to it, authenticated like workers (the scheme's user, the scheme's token,
proven both ways without sending it), on an address of their own next to the workers'.

The conversation is rank 0's: it hands every new slot to the ranks before sealing it
(``rank.slot``, answered ``rank.mapped``), asks for each version (``rank.write``, answered
``rank.done``) and then says ``rank.commit`` or ``rank.failed``. A rank says only its
layout (``rank.layout``, once per connection) and its answers. Nothing here runs on, or
waits for, the trainer's own process group.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import TrainerRankLostError, WeightSyncTimeoutError
from weightsync.core.versions import NO_VERSION
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

logger = logging.getLogger(__name__)

#: how long a connecting rank gets for its hello
HANDSHAKE_TIMEOUT = 5.0


def rank_address(address: str) -> str:
    """Where rank 0 listens for the other ranks: the workers' address plus a suffix."""
    return address + ".ranks"


class RankHub:
    """Rank 0's end: admits ranks ``1..world-1`` and talks to them, one call at a time
    (the sender's); a thread only accepts and authenticates connections."""

    def __init__(self, address: str, token: str, uid: int, world: int) -> None:
        self.world = world
        self._token, self._uid = token, uid
        self._listener = ChannelListener(rank_address(address))
        self.cond = threading.Condition()
        self.channels: dict[int, Channel] = {}
        #: bumped at each (re)join of a rank: a slot mapped by an older connection of a
        #: rank is not writable by the new one (slots are sealed once handed out)
        self.generation: dict[int, int] = {}
        self.checked: set[int] = set()  # ranks whose layout this connection was checked
        #: the newest version committed, told to a rank that joins
        self.committed = NO_VERSION
        self._stop = False
        self._thread = threading.Thread(target=self._accept_loop, name="weightsync-ranks",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                channel = self._listener.accept(timeout=0.2)
            except OSError:
                return
            if channel is not None:
                threading.Thread(target=self._admit, args=(channel,), daemon=True,
                                 name="weightsync-rank-handshake").start()

    def _admit(self, channel: Channel) -> None:
        deadline = Deadline(HANDSHAKE_TIMEOUT)
        try:
            peer = peer_credentials(channel.socket)
            if peer.uid != self._uid:
                raise HandshakeError(f"pid {peer.pid} runs as uid {peer.uid}, not {self._uid}")
            nonce = new_nonce()
            channel.send({"t": "rank.challenge", "nonce": nonce}, timeout=deadline.remaining())
            hello = read_frame(channel.socket, deadline.remaining)
            rank, theirs = hello.get("rank"), hello.get("nonce")
            if (hello.get("t") != "rank.hello" or not isinstance(rank, int)
                    or isinstance(rank, bool) or not isinstance(theirs, str) or len(theirs) > 64
                    or not proofs_match(rank_proof(self._token, nonce, theirs, rank),
                                        hello.get("proof"))):
                raise HandshakeError("not a rank of this scheme")
            if not 1 <= rank < self.world:
                raise HandshakeError(f"rank {rank} is out of range (trainer_ranks={self.world})")
            with self.cond:
                channel.send({"t": "rank.welcome", "joined_at": self.committed,
                              "proof": rank_hub_proof(self._token, nonce, theirs, rank)},
                             timeout=deadline.remaining())
                old = self.channels.pop(rank, None)
                if old is not None:
                    old.close()
                self.channels[rank] = channel
                self.generation[rank] = self.generation.get(rank, 0) + 1
                self.checked.discard(rank)
                self.cond.notify_all()
            logger.info("trainer rank %d joined (pid %d)", rank, peer.pid)
        except (HandshakeError, ChannelClosed, ChannelTimeout, TimeoutError, OSError) as exc:
            logger.warning("refused a trainer-rank connection: %s", exc)
            channel.close()

    def wait_all(self, deadline: Deadline) -> dict[int, Channel]:
        """Every other rank's channel, once all are connected."""
        with self.cond:
            while len(self.channels) < self.world - 1:
                missing = sorted(set(range(1, self.world)) - set(self.channels))
                if deadline.expired():
                    raise TrainerRankLostError(
                        f"trainer rank(s) {missing} did not connect within {deadline} "
                        f"(trainer_ranks={self.world}: every rank calls "
                        "scheme.create_sender(rank=r) and connect())", rank=missing[0])
                self.cond.wait(deadline.slice(0.1))
            return dict(self.channels)

    def drop(self, rank: int) -> None:
        """Forget a rank that hung up (it may join again)."""
        with self.cond:
            channel = self.channels.pop(rank, None)
            self.checked.discard(rank)
        if channel is not None:
            channel.close()

    def tell(self, header: dict[str, Any], fds: list[int] | None = None,
             ranks: list[int] | None = None) -> dict[int, str]:
        """Send ``header`` to each rank (all by default); returns those that hung up."""
        lost: dict[int, str] = {}
        with self.cond:
            targets = {r: c for r, c in self.channels.items() if ranks is None or r in ranks}
        for rank, channel in targets.items():
            try:
                channel.send(header, fds=fds or [], timeout=5.0)
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                lost[rank] = f"hung up ({exc})"
        return lost

    def collect(self, kind: str, seq: int, ranks: list[int], deadline: Deadline,
                what: str) -> dict[int, Message]:
        """Each rank's answer ``kind`` carrying ``seq``; an answer to an older request is
        skipped. Raises :class:`TrainerRankLostError` naming the first rank that hung up,
        or did not answer by ``deadline``."""
        with self.cond:
            channels = {r: self.channels[r] for r in ranks if r in self.channels}
        missing = sorted(set(ranks) - set(channels))
        if missing:
            raise TrainerRankLostError(f"trainer rank {missing[0]} is not connected ({what})",
                                       rank=missing[0])
        answers: dict[int, Message] = {}
        while len(answers) < len(channels):
            waiting = {c.fileno(): r for r, c in channels.items() if r not in answers}
            poller = select.poll()
            for fd in waiting:
                poller.register(fd, select.POLLIN)
            ready = poller.poll(max(1, int(deadline.slice(0.2) * 1000)))
            for fd, _event in ready:
                rank = waiting[fd]
                try:
                    message = channels[rank].recv(timeout=deadline.slice(5.0), max_payload=0)
                except (ChannelClosed, ChannelTimeout) as exc:
                    self.drop(rank)
                    raise TrainerRankLostError(
                        f"trainer rank {rank} hung up ({what}): {exc}", rank=rank) from exc
                if message.header.get("t") == kind and message.header.get("seq") == seq:
                    answers[rank] = message
                else:  # an answer to a request that failed before it came
                    logger.debug("trainer rank %d: skipped %s", rank, message.header.get("t"))
            if not ready and deadline.expired():
                late = sorted(set(channels) - set(answers))
                raise TrainerRankLostError(
                    f"trainer rank {late[0]} did not answer within {deadline} ({what}); "
                    f"ranks still silent: {late} (stopped, or far behind the others)",
                    rank=late[0])
        return answers

    def read_layouts(self, deadline: Deadline) -> dict[int, dict[str, Any]]:
        """The layout each rank connected since the last check sent (``rank.layout``, its
        first message on a connection)."""
        with self.cond:
            unchecked = {r: c for r, c in self.channels.items() if r not in self.checked}
        layouts: dict[int, dict[str, Any]] = {}
        for rank, channel in sorted(unchecked.items()):
            try:
                message = channel.recv(timeout=deadline.remaining(), max_payload=0)
            except ChannelTimeout as exc:
                raise TrainerRankLostError(
                    f"trainer rank {rank} sent no layout within {deadline} (it connected "
                    "but did not send)", rank=rank) from exc
            except ChannelClosed as exc:
                self.drop(rank)
                raise TrainerRankLostError(f"trainer rank {rank} hung up before sending its "
                                           f"layout: {exc}", rank=rank) from exc
            if message.header.get("t") != "rank.layout":
                self.drop(rank)
                raise TrainerRankLostError(f"trainer rank {rank} broke the protocol: "
                                           f"{message.header.get('t')!r} before its layout",
                                           rank=rank)
            layouts[rank] = message.header
        return layouts

    def mark_checked(self, ranks: list[int]) -> None:
        with self.cond:
            self.checked.update(r for r in ranks if r in self.channels)

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(1.0)
        self._listener.close()
        with self.cond:
            for channel in self.channels.values():
                channel.close()
            self.channels.clear()


class RankLink:
    """Rank ``rank``'s authenticated connection to rank 0."""

    def __init__(self, address: str, token: str, uid: int, rank: int) -> None:
        self.address, self.token, self.uid, self.rank = rank_address(address), token, uid, rank
        self.channel: Channel | None = None
        self.joined_at = NO_VERSION

    def open(self, deadline: Deadline) -> None:
        try:
            channel = connect_channel(self.address, deadline.remaining())
        except ChannelTimeout as exc:
            raise WeightSyncTimeoutError(
                f"trainer rank {self.rank}: rank 0 is not listening after {deadline} "
                "(has rank 0 created its sender and called connect()?)") from exc
        try:
            peer = peer_credentials(channel.socket)
            if peer.uid != self.uid:
                raise HandshakeError(f"rank 0's address is held by uid {peer.uid}")
            challenge = read_frame(channel.socket, deadline.remaining)
            nonce, hub_nonce = new_nonce(), str(challenge.get("nonce"))
            channel.send({"t": "rank.hello", "rank": self.rank, "nonce": nonce,
                          "proof": rank_proof(self.token, hub_nonce, nonce, self.rank)},
                         timeout=deadline.remaining())
            welcome = channel.recv(timeout=deadline.remaining(), max_payload=0)
            if not proofs_match(rank_hub_proof(self.token, hub_nonce, nonce, self.rank),
                                welcome.header.get("proof")):
                raise HandshakeError("the process at rank 0's address does not hold the "
                                     "scheme's token")
        except (HandshakeError, ChannelClosed, ChannelTimeout, TimeoutError) as exc:
            channel.close()
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: could not join rank 0: {exc}", rank=0) from exc
        self.joined_at = int(welcome.header.get("joined_at", NO_VERSION))
        self.channel = channel

    def send(self, header: dict[str, Any]) -> None:
        assert self.channel is not None
        try:
            self.channel.send(header, timeout=5.0)
        except (ChannelClosed, ChannelTimeout, OSError) as exc:
            raise TrainerRankLostError(f"trainer rank {self.rank}: rank 0 hung up: {exc}",
                                       rank=0) from exc

    def recv(self, deadline: Deadline, waiting_for: str) -> Message:
        assert self.channel is not None
        try:
            return self.channel.recv(timeout=deadline.remaining(), max_payload=0)
        except ChannelTimeout as exc:
            raise WeightSyncTimeoutError(
                f"trainer rank {self.rank}: {waiting_for} did not come from rank 0 within "
                f"{deadline}") from exc
        except ChannelClosed as exc:
            raise TrainerRankLostError(f"trainer rank {self.rank}: rank 0 hung up ({exc})",
                                       rank=0) from exc

    def close(self) -> None:
        if self.channel is not None:
            with contextlib.suppress(OSError):
                self.channel.close()
            self.channel = None
