"""The trainer's same-host hub: one thread that admits workers and reads their messages.

The hub listens at the scheme's address, authenticates each connection without ever
blocking on it (peer credentials first, then a challenge-response read one frame at a
time from a poll loop), and hands authenticated workers to its owner, the sender. It then
reads the workers' small control messages (acks, mismatches, goodbyes) and reports
hang-ups; it is their only reader, except for a thread that found a worker lost and reads
what is left under the same lock.

The hub holds its owner through a weak reference: a sender that is dropped without
``close()`` is collected, and its ``__del__`` stops the hub. If the hub thread fails, the
error is kept and the owner's next call raises it instead of waiting for a worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from weightsync.transports.local.address import ChannelListener
from weightsync.transports.local.auth import (
    HandshakeError,
    PeerCredentials,
    PreauthBuffer,
    new_nonce,
    peer_credentials,
    proofs_match,
    sender_proof,
    worker_proof,
)
from weightsync.transports.local.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    Message,
)

logger = logging.getLogger(__name__)

HUB_TICK = 0.2
HANDSHAKE_TIMEOUT = 5.0  # an unauthenticated connection gets this long to say hello
MAX_HANDSHAKES = 32  # unauthenticated connections kept at once; the oldest go first


class HubOwner(Protocol):
    """What the hub calls on the sender (from the hub thread)."""

    def hub_channels(self) -> dict[int, Channel]:
        """The authenticated workers' channels, to watch for messages and hang-ups."""
        ...

    def admit(self, channel: Channel, hello: dict[str, Any], peer: PeerCredentials,
              welcome_proof: str) -> None:
        """An authenticated worker said hello: take it in (sending the welcome, carrying
        ``welcome_proof``) or refuse it; the channel is the owner's from here on."""
        ...

    def on_message(self, worker_idx: int, channel: Channel, message: Message) -> None:
        """A worker sent a control message."""
        ...

    def on_hangup(self, worker_idx: int, channel: Channel, why: str) -> None:
        """A worker's connection ended or broke the protocol."""
        ...


@dataclass
class _Handshake:
    channel: Channel
    peer: PeerCredentials
    nonce: str
    started: float = field(default_factory=time.monotonic)
    buffer: PreauthBuffer = field(default_factory=PreauthBuffer)


class Hub:
    """Listens at ``address`` for workers of one scheme (``token``, user ``uid``)."""

    def __init__(self, address: str, token: str, uid: int, owner: HubOwner) -> None:
        self._token = token
        self._uid = uid
        self._owner_ref = weakref.ref(owner)
        self._listener = ChannelListener(address)
        self._wake_r, self._wake_w = os.pipe()
        self._handshakes: dict[int, _Handshake] = {}
        #: held while a worker's message is read and handed to the owner; another thread
        #: that finds a worker lost takes it to read what the worker sent before (a
        #: mismatch, a goodbye) instead of dropping it with the connection
        self.read_lock = threading.RLock()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weightsync-hub", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def stop(self) -> None:
        """Stop the thread, close the listener and every unauthenticated connection."""
        self._stop = True
        self.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for handshake in self._handshakes.values():
            handshake.channel.close()
        self._handshakes.clear()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            while not self._stop:
                owner = self._owner_ref()
                if owner is None:
                    return
                channels = owner.hub_channels()
                del owner  # hold no strong reference while blocked in poll
                self._step(channels)
        except BaseException as exc:  # kept for the owner's next call
            self.error = exc
            logger.exception("the weightsync hub thread stopped")

    def _step(self, channels: dict[int, Channel]) -> None:
        poller = select.poll()
        poller.register(self._listener.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        by_fd: dict[int, tuple[int, Channel]] = {}
        for idx, channel in channels.items():
            with contextlib.suppress(OSError, ValueError):
                poller.register(channel.fileno(), select.POLLIN)
                by_fd[channel.fileno()] = (idx, channel)
        for fd in self._handshakes:
            poller.register(fd, select.POLLIN)
        try:
            events = poller.poll(int(HUB_TICK * 1000))
        except InterruptedError:
            return
        for fd, _event in events:
            if self._stop:
                return
            if fd == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            elif fd == self._listener.fileno():
                self._accept()
            elif fd in self._handshakes:
                self._continue_handshake(fd)
            elif fd in by_fd:
                self._read_from(*by_fd[fd])
        self._expire_handshakes()

    def _accept(self) -> None:
        channel = self._listener.accept(timeout=0.0)
        if channel is None:
            return
        try:
            peer = peer_credentials(channel.socket)
        except OSError:
            channel.close()
            return
        if peer.uid != self._uid:
            logger.warning("refused a connection from pid %d: it runs as uid %d, the scheme's "
                           "user is uid %d", peer.pid, peer.uid, self._uid)
            channel.close()
            return
        handshake = _Handshake(channel, peer, new_nonce())
        try:
            channel.send({"t": "challenge", "nonce": handshake.nonce}, timeout=0.5)
        except (ChannelClosed, ChannelTimeout, OSError):
            channel.close()
            return
        if len(self._handshakes) >= MAX_HANDSHAKES:
            oldest = min(self._handshakes, key=lambda fd: self._handshakes[fd].started)
            self._refuse(self._handshakes.pop(oldest), "too many connections are handshaking")
        self._handshakes[channel.fileno()] = handshake

    def _continue_handshake(self, fd: int) -> None:
        handshake = self._handshakes[fd]
        try:
            hello = handshake.buffer.feed(handshake.channel.socket)
        except BlockingIOError:
            return
        except (HandshakeError, OSError) as exc:
            del self._handshakes[fd]
            self._refuse(handshake, f"bad handshake: {exc}")
            return
        if hello is None:
            return
        del self._handshakes[fd]
        idx = hello.get("worker_idx")
        worker_nonce = hello.get("nonce")
        if (
            hello.get("t") != "hello" or not isinstance(idx, int) or isinstance(idx, bool)
            or not isinstance(worker_nonce, str) or len(worker_nonce) > 64
            or not proofs_match(worker_proof(self._token, handshake.nonce, worker_nonce, idx),
                                hello.get("proof"))
        ):
            self._refuse(handshake, "bad handshake: not a worker of this scheme")
            return
        owner = self._owner_ref()
        if owner is None:
            handshake.channel.close()
            return
        proof = sender_proof(self._token, handshake.nonce, worker_nonce, idx)
        owner.admit(handshake.channel, hello, handshake.peer, proof)

    def _refuse(self, handshake: _Handshake, why: str, kind: str = "auth") -> None:
        """Close a connection that did not authenticate; ``kind="expired"``: it was too slow
        (a starved worker retries within its own deadline), "auth": it is refused."""
        logger.warning("refused a connection from pid %d: %s", handshake.peer.pid, why)
        with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
            handshake.channel.send_nowait({"t": "refused", "kind": kind, "error": why})
        handshake.channel.close()

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for fd in [fd for fd, h in self._handshakes.items() if now - h.started > HANDSHAKE_TIMEOUT]:
            self._refuse(self._handshakes.pop(fd), "no hello in time", kind="expired")

    def _read_from(self, idx: int, channel: Channel) -> None:
        owner = self._owner_ref()
        if owner is None:
            return
        with self.read_lock:  # a message read here is handed over before any loss is taken
            if channel.closed:
                return  # lost meanwhile: whoever found the loss read what was left
            try:
                message = channel.recv(timeout=5.0, max_payload=0)
            except (ChannelClosed, ChannelTimeout) as exc:
                hangup = str(exc)
            else:
                close_passed_fds(message)
                owner.on_message(idx, channel, message)
                return
        owner.on_hangup(idx, channel, hangup)


def close_passed_fds(message: Message) -> None:
    """Workers pass no descriptors: never keep one."""
    for fd in message.fds:
        with contextlib.suppress(OSError):
            os.close(fd)
