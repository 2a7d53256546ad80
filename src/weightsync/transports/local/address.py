"""Where same-host channels meet: addresses, the trainer's listener, a worker's connect.

Listeners bind in Linux's abstract socket namespace, so nothing is left on disk when a
process dies; a second listener at a taken address is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import sys
import tempfile
import time
import uuid

from weightsync.core.deadline import Deadline
from weightsync.transports.local.accept import ListenerClosed
from weightsync.transports.local.channel import Channel, ChannelTimeout, _wait


def new_address() -> str:
    """A fresh address: in the abstract namespace on Linux (nothing on disk), else a temp path."""
    name = f"weightsync-{os.getpid()}-{uuid.uuid4().hex}"
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), name + ".sock")


class AddressInUseError(OSError):
    """The scheme's address is taken: another sender of the same scheme is open."""


class ChannelListener:
    """Accepts channels at ``address`` (see :func:`new_address`)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(address)
        except OSError as exc:
            self._sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(
                    "another sender of this scheme is still open (in this or another "
                    "process): close it first, or create a new scheme"
                ) from None
            raise
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._shut = False

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def socket(self) -> socket.socket:
        """The underlying Unix socket (for peer credentials and the handshake)."""
        return self._sock

    def accept(self, timeout: float | None = 0.0) -> Channel | None:
        """A new channel within ``timeout`` seconds (None: however long it takes), or None.
        Raises :class:`~weightsync.transports.local.accept.ListenerClosed` once the
        listener is shut down or closed, and ``accept()``'s own ``OSError`` (``EMFILE``,
        ...) otherwise: an accept loop retries those."""
        deadline = Deadline(timeout)
        while True:
            if self._shut or self._sock.fileno() < 0:
                raise ListenerClosed(f"the listener at {self.address!r} is closed")
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                if deadline.expired():
                    return None
                try:
                    _wait(self._sock, select.POLLIN, deadline, "accept")
                except ChannelTimeout:
                    return None
                continue
            try:
                return Channel(conn)
            except OSError:
                conn.close()
                raise

    def shutdown(self) -> None:
        """Take no more connections and wake an ``accept()`` waiting in another thread (it
        raises ``ListenerClosed``); the address stays bound until :meth:`close`."""
        self._shut = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._shut = True
        self._sock.close()
        if not self.address.startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(self.address)


def connect_channel(address: str, timeout: float | Deadline | None) -> Channel:
    """Connect to a listener, retrying while it is not up yet, until ``timeout`` (a
    :class:`Deadline` to share a caller's, whose ``cancel()`` then ends the retries)."""
    deadline = timeout if isinstance(timeout, Deadline) else Deadline(timeout)
    delay = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            return Channel(sock)
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                raise
            if deadline.expired():
                raise ChannelTimeout(
                    f"no sender listening at {address!r} after {deadline}"
                ) from exc
            time.sleep(deadline.slice(delay))
            delay = min(delay * 2, 0.1)
