"""A worker's connection to a same-host trainer: the authenticated handshake and a reader
thread for the trainer's messages.

The trainer must run as the scheme's user, be the process that created the scheme (or one
of its descendants) and prove it holds the scheme's token; the token never crosses the
socket. The reader thread records versions announced to this worker, hands transport
messages to the transport that holds the link, and notices a trainer that left or died, or
(where the transport can take a worker back, :attr:`LocalLink.rejoinable`) a live trainer
that dropped this worker, which may then join again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    SchemaMismatchError,
    SenderLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerDroppedError,
)
from weightsync.core.liveness import ProcessWatch, is_same_or_descendant, process_dying
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.address import connect_channel
from weightsync.transports.local.auth import (
    HandshakeError,
    new_nonce,
    peer_credentials,
    proofs_match,
    read_frame,
    sender_proof,
    worker_proof,
)
from weightsync.transports.local.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    Message,
)
from weightsync.transports.local.hub import HUB_TICK
from weightsync.transports.local.members import ACK, BYE, CLOSE, MISMATCH, VERSION

logger = logging.getLogger(__name__)

#: the longest one wait for a handshake frame lasts before the deadline is looked at again
_HANDSHAKE_SLICE = 0.2
#: a transport message from the trainer, taken in the reader thread; True if it was one
MessageEvent = Callable[[Message, Channel], bool]


class HandshakeExpired(Exception):
    """The hub closed this worker's handshake for taking too long (the worker was starved):
    the trainer is alive, and the worker may try again within its deadline."""


class LocalLink:
    """Worker ``worker_idx``'s authenticated connection to the trainer at ``address``."""

    def __init__(self, address: str, token: str, uid: int, creator_pid: int,
                 worker_idx: int, timeout: float) -> None:
        self.address, self.token, self.uid = address, token, uid
        self.creator_pid = creator_pid
        self.worker_idx = worker_idx
        self.timeout = timeout
        self.channel: Channel | None = None
        self.cond = threading.Condition()
        self.delivered = NO_VERSION  # newest version announced to this worker
        self.acked = NO_VERSION
        self.sender_lost: str | None = None
        self._sender_watch: ProcessWatch | None = None
        self._reader: threading.Thread | None = None
        self._on_message: MessageEvent | None = None
        #: called (from the reader thread) once the trainer is gone, to end a wait early
        self.on_sender_lost: Callable[[], None] | None = None
        self._stop = False
        self._handshake_peer: int | None = None  # the verified trainer pid of a handshake
        #: a connection the live trainer closes is a drop this worker may rejoin after
        #: (set by a transport that can rejoin); otherwise it counts as the sender lost
        self.rejoinable = False
        #: why the live trainer dropped this worker, until it joins again
        self.dropped: str | None = None
        self.dropped_version: int | None = None  # the version in flight when dropped
        self._drop_reported = False
        self._in_flight: int | None = None  # the version whose message is being read

    # ------------------------------------------------------------------ joining
    def open(self, deadline: Deadline, on_message: MessageEvent) -> Channel:
        """Connect, authenticate both ways and start the reader thread."""
        if self.channel is not None and self.dropped is None:
            raise RuntimeError(f"worker {self.worker_idx} is already connected")
        while True:
            try:
                channel = self._handshake(deadline)
                break
            except (ChannelTimeout, TimeoutError) as exc:
                raise WeightSyncTimeoutError(f"worker {self.worker_idx}: {exc}") from exc
            except (ChannelClosed, HandshakeError, HandshakeExpired) as exc:
                # the hub gives a handshake 5 s: a worker starved longer (a loaded host) was
                # cut off by a live trainer, and joins again within its own deadline
                trainer = self._handshake_peer
                alive = trainer is not None and not process_dying(trainer)
                if not alive or deadline.expired():
                    why = "its handshake took too long" if isinstance(exc, HandshakeExpired) else \
                        "sender hung up"
                    raise SenderLostError(f"worker {self.worker_idx}: {why}: {exc}") from exc
                logger.info("worker %d: handshake cut short (%s); the trainer (pid %d) is alive: "
                            "joining again", self.worker_idx, exc, trainer)
                time.sleep(0.05)
        self.channel = channel
        self._on_message = on_message
        self._reader = threading.Thread(
            target=self._run_reader, name=f"weightsync-reader-{self.worker_idx}", daemon=True
        )
        self._reader.start()
        return channel

    def _handshake(self, deadline: Deadline) -> Channel:
        """Connect to the sender and authenticate both ways; an impostor bound to the
        address (after the trainer died) learns nothing and is refused before anything it
        sends is used."""
        idx = self.worker_idx
        self._handshake_peer = None

        def waited() -> float | None:  # short waits: a cancelled deadline is seen at once
            return deadline.slice(_HANDSHAKE_SLICE)

        channel = connect_channel(self.address, deadline)
        try:
            peer = peer_credentials(channel.socket)
            if peer.uid != self.uid:
                raise WeightSyncError(
                    f"worker {idx}: refused the process at the sender's address (pid "
                    f"{peer.pid}): it runs as uid {peer.uid}, the scheme's user is uid {self.uid}"
                )
            if not is_same_or_descendant(peer.pid, self.creator_pid):
                raise WeightSyncError(
                    f"worker {idx}: refused the process at the sender's address (pid "
                    f"{peer.pid}): it is neither the process that created the scheme (pid "
                    f"{self.creator_pid}) nor one of its descendants"
                )
            self._handshake_peer = peer.pid
            challenge = read_frame(channel.socket, waited)
            sender_nonce = challenge.get("nonce")
            if challenge.get("t") != "challenge" or not isinstance(sender_nonce, str):
                raise WeightSyncError(f"worker {idx}: the sender's address answered with "
                                      f"{challenge.get('t')!r}, not a challenge")
            nonce = new_nonce()
            channel.send({
                "t": "hello", "worker_idx": idx, "pid": os.getpid(), "nonce": nonce,
                "proof": worker_proof(self.token, sender_nonce, nonce, idx),
            }, timeout=deadline.slice(10.0))
            reply = read_frame(channel.socket, waited)
            if reply.get("t") == "refused" and reply.get("kind") == "expired":
                raise HandshakeExpired(f"the sender closed the handshake: {reply.get('error')}")
            if reply.get("t") == "refused":
                raise WeightSyncError(
                    f"worker {idx}: the sender refused the connection: {reply.get('error')}"
                )
            expected = sender_proof(self.token, sender_nonce, nonce, idx)
            if reply.get("t") != "welcome" or not proofs_match(expected, reply.get("proof")):
                raise WeightSyncError(
                    f"worker {idx}: the process at the sender's address (pid {peer.pid}) "
                    "could not prove it holds the scheme's token: refusing it"
                )
        except BaseException:
            channel.close()
            raise
        self._sender_watch = ProcessWatch(peer.pid)
        return channel

    # ------------------------------------------------------------------ reader thread
    def _run_reader(self) -> None:
        channel = self.channel
        assert channel is not None and self._on_message is not None
        while not self._stop:
            try:
                if not channel.readable(HUB_TICK):
                    watch = self._sender_watch
                    if watch is not None and watch.dying():  # a forked child may hold the socket
                        self._set_sender_lost(f"the sender's process (pid {watch.pid}) died")
                        return
                    continue
                if self._stop:
                    return
                message = channel.recv_header(timeout=self.timeout)
                kind = message.header.get("t")
                if kind == VERSION:
                    self.mark_delivered(int(message.header["v"]))
                elif kind == CLOSE:
                    self._set_sender_lost("the sender closed")
                    return
                else:
                    version = message.header.get("v")
                    self._in_flight = version if isinstance(version, int) else None
                    if not self._on_message(message, channel):
                        logger.debug("worker %d ignored message %r", self.worker_idx, kind)
                    self._in_flight = None
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                if not self._stop:
                    self._connection_broke(f"connection to the sender lost: {exc}")
                return

    def _connection_broke(self, why: str) -> None:
        """The connection ended without the trainer's goodbye: the sender is lost if its
        process is dead or exiting; a live trainer closed it on purpose (it gave up on this
        worker), which a rejoinable link reports as a drop."""
        watch = self._sender_watch
        if not self.rejoinable or watch is None or watch.dying():
            self._set_sender_lost(why)
            return
        version = self._in_flight
        during = (f"during version {version}" if version is not None
                  else f"while holding version {max(self.delivered, self.acked)}")
        logger.warning("worker %d: the trainer (pid %d) is alive but dropped this worker %s (%s)",
                       self.worker_idx, watch.pid, during, why)
        with self.cond:
            self.dropped = (f"the trainer (pid {watch.pid}) dropped this worker (it stopped "
                            f"responding {during})")
            self.dropped_version = version
            self._drop_reported = False
            self.cond.notify_all()

    def mark_delivered(self, version: int) -> None:
        with self.cond:
            self.delivered = max(self.delivered, version)
            self.cond.notify_all()

    def _set_sender_lost(self, why: str) -> None:
        if self.sender_lost is None:
            clean = why == "the sender closed"
            (logger.info if clean else logger.warning)("worker %d: %s", self.worker_idx, why)
        with self.cond:
            self.sender_lost = why
            self.cond.notify_all()
        if self.on_sender_lost is not None:
            self.on_sender_lost()

    # ------------------------------------------------------------------ the reader's needs
    def ack(self, version: int, timeout: float = 1.0) -> None:
        """Tell the trainer this worker holds (or has the bytes of) ``version``, once."""
        if self.channel is None or version <= self.acked:
            return
        self.acked = version
        with contextlib.suppress(ChannelClosed, ChannelTimeout):
            self.channel.send({"t": ACK, "v": version}, timeout=timeout)

    def report_mismatch(self, error: SchemaMismatchError | str) -> None:
        """Tell the trainer this worker refuses the weights, and on which key (sent before
        the worker hangs up: the trainer reads it before taking the hang-up)."""
        if self.channel is None:
            return
        header: dict[str, object] = {"t": MISMATCH, "error": str(error)}
        if isinstance(error, SchemaMismatchError):
            header |= {name: _plain(getattr(error, name)) for name in ("key", "expected", "got")}
        with contextlib.suppress(ChannelClosed, ChannelTimeout):
            self.channel.send(header, timeout=1.0)

    def sender_alive(self) -> bool:
        """Whether the trainer's process is alive (one ``pread`` of its /proc entry): for a
        read that a forked child of a dead trainer could keep open."""
        watch = self._sender_watch
        return watch is None or not watch.dying()

    def check_connected(self) -> None:
        if self.channel is None:
            raise RuntimeError(f"worker {self.worker_idx}: call connect() first")

    def check_sender(self, version: int) -> None:
        self.check_connected()
        if self.sender_lost is not None:
            raise SenderLostError(
                f"worker {self.worker_idx} (at version {version}): {self.sender_lost}"
            )
        self._check_dropped(version)

    def _check_dropped(self, version: int) -> None:
        """Raise :class:`WorkerDroppedError` once per drop (the calls after it rejoin)."""
        if self.dropped is None or self._drop_reported:
            return
        self._drop_reported = True
        raise WorkerDroppedError(
            f"worker {self.worker_idx} (at version {version}): {self.dropped}; the trainer is "
            "alive: the next receive(), poll() or connect() joins it again and takes the "
            "current version", worker_ids=[self.worker_idx], version=self.dropped_version,
        )

    def needs_rejoin(self, reported_only: bool = True) -> bool:
        """Whether the live trainer dropped this worker and it should join again now
        (``reported_only``: only once the drop was raised to the caller)."""
        return self.dropped is not None and self.sender_lost is None and (
            self._drop_reported or not reported_only)

    def rejoin(self, deadline: Deadline, on_message: MessageEvent,
               reset: Callable[[], None]) -> None:
        """Join the trainer again after it dropped this worker: the old reader thread has
        ended (it saw the connection close); ``reset`` clears the transport's state for the
        new connection, whose first version is the trainer's current one. A trainer that is
        gone meanwhile makes this (and every later call) a :class:`SenderLostError`."""
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        if self.channel is not None:
            self.channel.close()
        if self._sender_watch is not None:
            self._sender_watch.close()
        reset()
        with self.cond:
            self.delivered = self.acked = NO_VERSION  # the trainer counts afresh
        try:
            self.open(deadline, on_message)
        except SenderLostError as exc:
            self.sender_lost = f"it could not join again after the trainer dropped it: {exc}"
            raise
        with self.cond:
            self.dropped = self.dropped_version = None
            self._drop_reported = False
        logger.info("worker %d joined the trainer again after it was dropped", self.worker_idx)

    def wait(self, version: int, deadline: Deadline, newer: Callable[[], bool]) -> None:
        """Wait a short while for a version newer than ``version`` (``newer()`` looks)."""
        with self.cond:
            if self.sender_lost is not None:
                raise SenderLostError(
                    f"worker {self.worker_idx} (at version {version}): {self.sender_lost}"
                )
            self._check_dropped(version)
            if self.dropped is not None:
                return  # the caller rejoins at its next look
            if not newer():
                self.cond.wait(deadline.slice(0.05))

    def close(self) -> None:
        """Say goodbye (a clean leave, not a loss), stop the reader thread."""
        self._stop = True
        if self.channel is not None:
            with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                self.channel.send_nowait({"t": BYE})
            self.channel.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        if self._sender_watch is not None:
            self._sender_watch.close()


def _plain(value: object) -> str | None:
    """A mismatch's detail as the frame's JSON carries it."""
    return None if value is None else str(value)[:500]
