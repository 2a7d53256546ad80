"""The receiver of a same-host scheme: the authenticated handshake, a reader thread for
the sender's messages, and applying whole versions only inside ``connect``, ``poll`` and
``receive`` (``close`` waits for an apply in progress).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import threading

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    SchemaMismatchError,
    SenderLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.fork_safety import track_for_fork
from weightsync.core.layout import Layout
from weightsync.core.liveness import ProcessWatch, is_same_or_descendant
from weightsync.core.versions import NO_VERSION
from weightsync.schemes.base import WeightReceiver
from weightsync.schemes.local import LocalScheme
from weightsync.transports.local_auth import (
    HandshakeError,
    new_nonce,
    peer_credentials,
    proofs_match,
    read_frame,
    sender_proof,
    worker_proof,
)
from weightsync.transports.local_channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    Message,
    connect_channel,
)
from weightsync.transports.local_hub import HUB_TICK as _HUB_TICK

logger = logging.getLogger(__name__)


class LocalReceiver(WeightReceiver):
    """Receiver of a same-host scheme; subclasses say how a version is applied."""

    def __init__(self, scheme: LocalScheme, worker_idx: int) -> None:
        super().__init__(scheme, worker_idx)
        if worker_idx >= scheme.num_workers:
            raise ValueError(
                f"worker_idx {worker_idx} is out of range: the scheme has "
                f"num_workers={scheme.num_workers}"
            )
        self.scheme: LocalScheme = scheme
        self._channel: Channel | None = None
        self._cond = threading.Condition()
        # held while a version is applied: close() waits for it, so nothing is unmapped
        # while a copy (or a swap of views) reads it
        self._apply_lock = threading.Lock()
        self._delivered = NO_VERSION
        self._sender_lost: str | None = None
        self._sender_watch: ProcessWatch | None = None
        self._reader: threading.Thread | None = None
        self._stop = False
        self._forked_copy = False
        track_for_fork(self)

    # ================================================================== transport hooks
    @abc.abstractmethod
    def _handle(self, message: Message, channel: Channel) -> bool:
        """Take a transport message in the reader thread; True if it was one."""

    @abc.abstractmethod
    def _sender_layout(self, deadline: Deadline) -> Layout:
        """Block until the sender's layout has arrived; return it."""

    @abc.abstractmethod
    def _apply_newest(self, dest: dict[str, torch.Tensor], deadline: Deadline) -> int | None:
        """Copy the newest delivered version into ``dest`` if newer than ours."""

    def _close_transport(self) -> None:
        """Release the transport's resources."""

    def _newer_available(self) -> bool:
        """A cheap look: may a version newer than ours be ready to apply? (When False,
        ``poll`` returns at once without resolving the model's tensors.)"""
        return self._delivered > self._version

    def newer_published(self) -> bool:
        """Has the sender published a version newer than the one this worker holds? A cheap
        look that applies nothing. ``poll()`` may still return None for a moment (a new
        shared-memory slot's handle in flight); ``receive(timeout)`` waits for it."""
        return self._newer_available()

    # ================================================================== reader thread
    def _run_reader(self) -> None:
        channel = self._channel
        assert channel is not None
        while not self._stop:
            try:
                if not channel.readable(_HUB_TICK):
                    watch = self._sender_watch
                    if watch is not None and watch.dying():  # a forked child may hold the socket
                        self._set_sender_lost(f"the sender's process (pid {watch.pid}) died")
                        return
                    continue
                if self._stop:
                    return
                message = channel.recv_header(timeout=self.scheme.timeout)
                kind = message.header.get("t")
                if kind == "version":
                    self._mark_delivered(int(message.header["v"]), channel)
                elif kind == "close":
                    self._set_sender_lost("the sender closed")
                    return
                elif not self._handle(message, channel):
                    logger.debug("worker %d ignored message %r", self.worker_idx, kind)
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                if not self._stop:
                    self._set_sender_lost(f"connection to the sender lost: {exc}")
                return

    #: ack a version when its bytes arrived (streams), else when applied (shared memory)
    _ack_on_delivery = True

    def _mark_delivered(self, version: int, channel: Channel) -> None:
        # recorded before the ack: once the sender hears of it, poll() must find it
        with self._cond:
            self._delivered = max(self._delivered, version)
            self._cond.notify_all()
        # before connect() has checked the layout and applied a version, nothing is acked:
        # connect() acks what it applied, or reports the mismatch instead
        if self._ack_on_delivery and self._version != NO_VERSION:
            channel.send({"t": "ack", "v": version}, timeout=self.scheme.timeout)

    def _applied(self, version: int) -> int:
        logger.debug("worker %d applied version %d", self.worker_idx, version)
        self._version = version
        if not self._ack_on_delivery:
            self._confirm_applied(version)
        return version

    def _confirm_applied(self, version: int) -> None:
        """Tell the sender which version this worker now holds (for ``worker_lag``)."""
        if self._channel is not None:
            with contextlib.suppress(ChannelClosed, ChannelTimeout):
                self._channel.send({"t": "ack", "v": version}, timeout=1.0)

    def _set_sender_lost(self, why: str) -> None:
        if self._sender_lost is None:
            clean = why == "the sender closed"
            (logger.info if clean else logger.warning)("worker %d: %s", self.worker_idx, why)
        with self._cond:
            self._sender_lost = why
            self._cond.notify_all()

    # ================================================================== API
    def _handshake(self, deadline: Deadline) -> Channel:
        """Connect to the sender and authenticate both ways; returns the channel.

        The peer must run as the scheme's user and prove it holds the scheme's token; the
        token itself never crosses the socket, so an impostor bound to the address (after
        the trainer died) learns nothing and is refused before anything it sends is used.
        """
        idx = self.worker_idx
        channel = connect_channel(self.scheme.address, deadline.remaining())
        try:
            peer = peer_credentials(channel.socket)
            if peer.uid != self.scheme.uid:
                raise WeightSyncError(
                    f"worker {idx}: refused the process at the sender's address (pid "
                    f"{peer.pid}): it runs as uid {peer.uid}, the scheme's user is uid "
                    f"{self.scheme.uid}"
                )
            if not is_same_or_descendant(peer.pid, self.scheme.creator_pid):
                raise WeightSyncError(
                    f"worker {idx}: refused the process at the sender's address (pid "
                    f"{peer.pid}): it is neither the process that created the scheme (pid "
                    f"{self.scheme.creator_pid}) nor one of its descendants"
                )
            challenge = read_frame(channel.socket, deadline.remaining)
            sender_nonce = challenge.get("nonce")
            if challenge.get("t") != "challenge" or not isinstance(sender_nonce, str):
                raise WeightSyncError(f"worker {idx}: the sender's address answered with "
                                      f"{challenge.get('t')!r}, not a challenge")
            nonce = new_nonce()
            channel.send({
                "t": "hello", "worker_idx": idx, "pid": os.getpid(), "nonce": nonce,
                "proof": worker_proof(self.scheme.token, sender_nonce, nonce, idx),
            }, timeout=deadline.slice(10.0))
            reply = read_frame(channel.socket, deadline.remaining)
            if reply.get("t") == "refused":
                raise WeightSyncError(
                    f"worker {idx}: the sender refused the connection: {reply.get('error')}"
                )
            expected = sender_proof(self.scheme.token, sender_nonce, nonce, idx)
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

    def connect(self, timeout: float | None = None) -> int:
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        dest = self._destination()
        if self._channel is not None:
            raise RuntimeError(f"worker {self.worker_idx} is already connected")
        local_layout = Layout.from_weights(dest)
        try:
            channel = self._handshake(deadline)
        except (ChannelTimeout, TimeoutError) as exc:
            raise WeightSyncTimeoutError(f"worker {self.worker_idx}: {exc}") from exc
        except (ChannelClosed, HandshakeError) as exc:
            raise SenderLostError(f"worker {self.worker_idx}: sender hung up: {exc}") from exc
        self._channel = channel
        self._reader = threading.Thread(
            target=self._run_reader, name=f"weightsync-reader-{self.worker_idx}", daemon=True
        )
        self._reader.start()
        try:
            sender_layout = self._sender_layout(deadline)
            sender_layout.check_compatible(local_layout, other_name=f"worker {self.worker_idx}")
        except SchemaMismatchError as exc:
            with contextlib.suppress(ChannelClosed, ChannelTimeout):
                channel.send({"t": "mismatch", "error": str(exc)}, timeout=1.0)
            self.close()
            raise
        while True:
            with self._apply_lock:
                self._check_not_closed()
                applied = self._apply_newest(self._destination(), deadline)
            if applied is not None:
                self._version = applied
                break
            self._wait_for_delivery(deadline, "connect")
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: no weights arrived within {deadline}"
                )
        channel.send({"t": "ack", "v": self._version}, timeout=deadline.slice(10.0))
        logger.info("worker %d connected, holds version %d", self.worker_idx, self._version)
        return self._version

    def _check_not_closed(self) -> None:
        if self._closed:
            raise RuntimeError(f"worker {self.worker_idx}: this receiver is closed")

    def _check_sender(self) -> None:
        if self._channel is None:
            raise RuntimeError(f"worker {self.worker_idx}: call connect() first")
        if self._sender_lost is not None:
            raise SenderLostError(
                f"worker {self.worker_idx} (at version {self._version}): {self._sender_lost}"
            )

    def _wait_for_delivery(self, deadline: Deadline, what: str) -> None:
        with self._cond:
            if self._sender_lost is not None:
                raise SenderLostError(
                    f"worker {self.worker_idx} ({what}, at version {self._version}): "
                    f"{self._sender_lost}"
                )
            if self._delivered <= self._version:
                self._cond.wait(deadline.slice(0.05))

    def poll(self) -> int | None:
        """Apply the newest delivered version, if newer; never blocks. A version delivered
        before the sender died is still applied, after that the loss is raised."""
        if self._channel is None:
            raise RuntimeError(f"worker {self.worker_idx}: call connect() first")
        with self._apply_lock:
            self._check_not_closed()
            if self._newer_available():
                applied = self._apply_newest(self._destination(), Deadline(0))
                if applied is not None:
                    return self._applied(applied)
        self._check_sender()
        return None

    def receive(self, timeout: float | None = None) -> int | None:
        """Block for a newer version (up to ``timeout``, default the scheme's) and apply it;
        None if none came in time."""
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        while True:
            if self._channel is None:
                raise RuntimeError(f"worker {self.worker_idx}: call connect() first")
            with self._apply_lock:
                self._check_not_closed()
                applied = self._apply_newest(self._destination(), Deadline(deadline.slice(0.05)))
                if applied is not None:
                    return self._applied(applied)
            self._check_sender()
            if deadline.expired():
                return None
            self._wait_for_delivery(deadline, "receive")

    def close(self) -> None:
        """Say goodbye to the sender (a clean leave, not a loss) and release everything;
        waits for an apply in progress in another thread."""
        if self._closed:
            return
        self._closed = True
        if self._forked_copy:
            return
        self._stop = True
        with self._apply_lock:
            if self._channel is not None:
                with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                    self._channel.send_nowait({"t": "bye"})
                self._channel.close()
            if self._reader is not None and self._reader is not threading.current_thread():
                self._reader.join(5.0)
            if self._sender_watch is not None:
                self._sender_watch.close()
            self._close_transport()
