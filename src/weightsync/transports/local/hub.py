"""The trainer's same-host hub: admits workers, and reads their messages on one thread.

The hub listens at the scheme's address through an accept loop that a connection flood
cannot kill (:mod:`weightsync.transports.local.accept`: accept errors such as ``EMFILE``
are logged and retried, at most :data:`MAX_HANDSHAKES` connections are in their handshake
at once, each within one deadline). Each connection's handshake runs on a thread of that
loop: peer credentials first, then a challenge and the worker's hello (one small frame).
An authenticated worker is handed to the hub's owner, the sender. The hub's own thread
then reads the workers' small control messages (acks, mismatches, goodbyes) and reports
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
import weakref
from typing import Any, Protocol

from weightsync.transports.local.accept import AcceptLoop, Admission
from weightsync.transports.local.address import ChannelListener
from weightsync.transports.local.auth import (
    HandshakeError,
    PeerCredentials,
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

logger = logging.getLogger(__name__)

HUB_TICK = 0.2
#: an unauthenticated connection gets this long for its whole handshake (a starved worker
#: that misses it joins again within its own deadline)
HANDSHAKE_TIMEOUT = 5.0
#: connections in their handshake at once; more are closed at once (a flood, logged)
MAX_HANDSHAKES = 32


class HubOwner(Protocol):
    """What the hub calls on the sender (from the hub's threads)."""

    def hub_channels(self) -> dict[int, Channel]:
        """The authenticated workers' channels, to watch for messages and hang-ups."""
        ...

    def admit(self, channel: Channel, hello: dict[str, Any], peer: PeerCredentials,
              welcome_proof: str) -> None:
        """An authenticated worker said hello: take it in (sending the welcome, carrying
        ``welcome_proof``) or refuse it; the channel is the owner's from here on. Called
        from a handshake thread, one worker at a time."""
        ...

    def on_message(self, worker_idx: int, channel: Channel, message: Message) -> None:
        """A worker sent a control message."""
        ...

    def on_hangup(self, worker_idx: int, channel: Channel, why: str) -> None:
        """A worker's connection ended or broke the protocol."""
        ...


def display_address(address: str) -> str:
    """An address as ``ss`` and ``/proc/net/unix`` show it (``@name`` when abstract)."""
    return "@" + address[1:] if address.startswith("\0") else address


class Hub:
    """Listens at ``address`` for workers of one scheme (``token``, user ``uid``)."""

    def __init__(self, address: str, token: str, uid: int, owner: HubOwner) -> None:
        self._token = token
        self._uid = uid
        self._owner_ref = weakref.ref(owner)
        self._listener = ChannelListener(address)
        self._wake_r, self._wake_w = os.pipe()
        #: held while a worker's message is read and handed to the owner; another thread
        #: that finds a worker lost takes it to read what the worker sent before (a
        #: mismatch, a goodbye) instead of dropping it with the connection
        self.read_lock = threading.RLock()
        #: held while an authenticated worker is handed to the owner: one at a time, and
        #: none after stop() returned
        self._admitting = threading.RLock()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weightsync-hub", daemon=True)
        self._acceptor: AcceptLoop[Channel] = AcceptLoop(
            self._listener.accept, self._handshake, socket_of=lambda channel: channel.socket,
            what=f"the trainer's hub for workers at {display_address(address)}",
            handshake_timeout=HANDSHAKE_TIMEOUT, max_pending=MAX_HANDSHAKES,
            name="weightsync-hub-accept", connection_name="weightsync-hub-handshake")

    def start(self) -> None:
        self._thread.start()
        self._acceptor.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def stop(self) -> None:
        """Stop the threads, close the listener and every unauthenticated connection."""
        self._stop = True
        self.wake()
        self._acceptor.stop(5.0, wake=self._listener.shutdown)
        if self._admitting.acquire(timeout=5.0):  # a worker being admitted is the owner's
            self._admitting.release()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ admitting workers
    def _handshake(self, channel: Channel, admission: Admission) -> None:
        """One connection, on a thread of the accept loop: the peer's credentials, the
        challenge and the worker's hello, within the admission's one deadline; an
        authenticated worker is handed to the owner."""
        try:
            peer = peer_credentials(channel.socket)
        except OSError:
            channel.close()
            return
        if peer.uid != self._uid:
            admission.refused("the trainer's hub refused a connection from pid %d: it runs as "
                              "uid %d, the scheme's user is uid %d", peer.pid, peer.uid, self._uid)
            channel.close()  # before a byte is read
            return
        nonce, deadline = new_nonce(), admission.deadline
        try:
            channel.send({"t": "challenge", "nonce": nonce}, timeout=deadline.remaining())
            hello = read_frame(channel.socket, deadline.remaining)
        except (HandshakeError, ChannelClosed, TimeoutError, OSError) as exc:
            if isinstance(exc, TimeoutError) or admission.cut:  # cut: shut at the deadline
                self._refuse(channel, peer, admission,
                             f"no hello within {HANDSHAKE_TIMEOUT:g} s", kind="expired")
            else:
                self._refuse(channel, peer, admission, f"bad handshake: {exc}")
            return
        idx, worker_nonce = hello.get("worker_idx"), hello.get("nonce")
        if (
            hello.get("t") != "hello" or not isinstance(idx, int) or isinstance(idx, bool)
            or not isinstance(worker_nonce, str) or len(worker_nonce) > 64
            or not proofs_match(worker_proof(self._token, nonce, worker_nonce, idx),
                                hello.get("proof"))
        ):
            self._refuse(channel, peer, admission, "bad handshake: not a worker of this scheme")
            return
        admission.done()  # authenticated: no longer among the pending handshakes
        proof = sender_proof(self._token, nonce, worker_nonce, idx)
        with self._admitting:
            owner = None if self._stop else self._owner_ref()
            if owner is None:  # closed, or dropped, meanwhile
                channel.close()
                return
            owner.admit(channel, hello, peer, proof)
            del owner  # no strong reference outlives the call
        self.wake()  # the hub thread watches the new worker's channel from now on

    def _refuse(self, channel: Channel, peer: PeerCredentials, admission: Admission, why: str,
                kind: str = "auth") -> None:
        """Close a connection that did not authenticate; ``kind="expired"``: it was too slow
        (a starved worker retries within its own deadline), "auth": it is refused."""
        admission.refused("the trainer's hub refused a connection from pid %d: %s", peer.pid, why)
        with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
            channel.send_nowait({"t": "refused", "kind": kind, "error": why})
        channel.close()

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
        poller.register(self._wake_r, select.POLLIN)
        by_fd: dict[int, tuple[int, Channel]] = {}
        for idx, channel in channels.items():
            with contextlib.suppress(OSError, ValueError):
                poller.register(channel.fileno(), select.POLLIN)
                by_fd[channel.fileno()] = (idx, channel)
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
            elif fd in by_fd:
                self._read_from(*by_fd[fd])

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
