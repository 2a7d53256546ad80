"""A one-way byte pipe from the trainer to one worker that maps the sender's pages into the
pipe (``vmsplice``) instead of copying them: the worker's read is the transfer's only copy,
where a Unix socket makes two (into the kernel, then out), so on a busy host the trainer
keeps a core for the pack while the bytes move.

Since the pipe holds references to the sender's pages, not copies, the sender must not
rewrite them until the worker has read them: :meth:`PipeWriter.commit` waits until the
pipe is drained, then writes a trailer naming the version. A worker stages a version only
after reading its trailer, so bytes read from pages the sender let go of (a transfer cut
off, a sender that died) never count. Linux only; elsewhere, or where the pipe cannot be
made large enough, the socket carries the bytes as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import select
import struct
import sys
import termios
import time
from collections.abc import Callable

from weightsync.core.deadline import Deadline
from weightsync.transports.local.channel import ChannelClosed, ChannelTimeout

logger = logging.getLogger(__name__)

#: the pipe's capacity we ask for (Linux's default ceiling for unprivileged users is 1 MiB)
PIPE_BYTES = 1 << 20
#: below this capacity the per-call overhead outweighs the copy saved: use the socket
MIN_PIPE_BYTES = 256 << 10
#: smaller versions go by the socket: for them the wait for the pipe to drain costs more
#: than the copy it saves (measured: even at 16 MB, ahead from 64 MB)
MIN_PAYLOAD_BYTES = 16 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's value where Python lacks it
_TRAILER = struct.Struct("!q")  # the version, written once its payload is drained
_SPLICE_F_NONBLOCK = 0x02  # vmsplice ignores the pipe's O_NONBLOCK: a full pipe would block
#: how often a blocked read or write looks at its cancel flag
_TICK = 0.1


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def _load_vmsplice() -> Callable[..., int] | None:
    """libc's ``vmsplice``, once it proved to work here; None where it does not."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        vmsplice = libc.vmsplice
    except (OSError, AttributeError):
        return None
    vmsplice.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_size_t, ctypes.c_uint]
    vmsplice.restype = ctypes.c_ssize_t
    return vmsplice if _works(vmsplice) else None  # type: ignore[no-any-return]


def _works(vmsplice: Callable[..., int]) -> bool:
    """Whether a byte mapped into a pipe reads back (a sandbox may forbid the call)."""
    probe = ctypes.create_string_buffer(b"w", 1)
    read_fd, write_fd = os.pipe()
    try:
        iov = _IoVec(ctypes.addressof(probe), 1)
        return vmsplice(write_fd, ctypes.byref(iov), 1, _SPLICE_F_NONBLOCK) == 1 and \
            os.read(read_fd, 1) == b"w"
    except OSError:
        return False
    finally:
        os.close(read_fd)
        os.close(write_fd)


def _poll(fd: int, events: int, seconds: float) -> int:
    poller = select.poll()
    poller.register(fd, events)
    ready = poller.poll(max(0, int(seconds * 1000)))
    return ready[0][1] if ready else 0


class PipeWriter:
    """The trainer's end of one worker's pipe (non-blocking; one thread writes)."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.fd = fd
        self.capacity = capacity
        self.cancelled = False

    @classmethod
    def open(cls) -> tuple[PipeWriter, int] | None:
        """A new pipe: its writer and the read end to pass to the worker (the caller closes
        its copy once passed); None where page-mapping pipes are not available."""
        if _load_vmsplice() is None:
            return None
        read_fd, write_fd = os.pipe()
        try:
            capacity = fcntl.fcntl(write_fd, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            capacity = 0
        if capacity < MIN_PIPE_BYTES:
            logger.debug("pipe capacity %d bytes is too small: the socket carries the bytes",
                         capacity)
            os.close(read_fd)
            os.close(write_fd)
            return None
        os.set_blocking(write_fd, False)
        return cls(write_fd, capacity), read_fd

    def write(self, address: int, nbytes: int, deadline: Deadline) -> None:
        """Map ``nbytes`` at ``address`` into the pipe; the pages must stay unchanged until
        :meth:`commit` returns."""
        vmsplice = _load_vmsplice()
        assert vmsplice is not None
        iov = _IoVec()
        end = address + nbytes
        while address < end:
            iov.base, iov.len = address, end - address
            n = vmsplice(self.fd, ctypes.byref(iov), 1, _SPLICE_F_NONBLOCK)
            if n >= 0:
                address += n
                continue
            code = ctypes.get_errno()
            if code == errno.EAGAIN:
                self._wait_writable(deadline)
            elif code == errno.EINTR:
                continue
            elif code in (errno.EPIPE, errno.EBADF):
                raise ChannelClosed("the worker closed its pipe")
            else:
                raise OSError(code, f"vmsplice: {os.strerror(code)}")

    def commit(self, version: int, deadline: Deadline) -> None:
        """Once the worker has read every byte (the pages are free to change), write the
        trailer that lets it stage ``version``."""
        pause = 0.00005
        while self._unread():
            self._check(deadline, "the worker to read the last bytes")
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        view = memoryview(_TRAILER.pack(version))
        while len(view):
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                self._wait_writable(deadline)
            except (BrokenPipeError, OSError) as exc:
                raise ChannelClosed(f"the worker's pipe broke: {exc}") from exc

    def _unread(self) -> int:
        buf = bytearray(4)
        try:
            fcntl.ioctl(self.fd, termios.FIONREAD, buf)
        except OSError as exc:
            raise ChannelClosed(f"the worker's pipe broke: {exc}") from exc
        return int.from_bytes(buf, sys.byteorder)

    def _wait_writable(self, deadline: Deadline) -> None:
        self._check(deadline, "room in the worker's pipe")
        events = _poll(self.fd, select.POLLOUT, deadline.slice(_TICK))
        if events & select.POLLERR:
            raise ChannelClosed("the worker closed its pipe")

    def _check(self, deadline: Deadline, what: str) -> None:
        if self.cancelled:
            raise ChannelClosed("the transfer was cancelled")
        if deadline.expired():
            raise ChannelTimeout(f"waited for {what} for {deadline}")

    def close(self) -> None:
        """Close the write end, once: a second call must not close the number's next owner."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class PipeReader:
    """A worker's end of its pipe: payloads read straight into staging, then the trailer."""

    def __init__(self, fd: int, sender_alive: Callable[[], bool] | None = None) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.cancelled = False
        #: looked at each tick of a blocked read: a dead trainer's forked child may keep
        #: the write end open, so end-of-file alone would not tell
        self._sender_alive = sender_alive

    def read_into(self, view: memoryview, deadline: Deadline) -> None:
        """Fill ``view`` from the pipe; ChannelClosed if the trainer's end closed first."""
        while len(view):
            try:
                n = os.readv(self.fd, [view])
            except BlockingIOError:
                if self.cancelled:
                    raise ChannelClosed("the worker is closing") from None
                if self._sender_alive is not None and not self._sender_alive():
                    raise ChannelClosed("the trainer died mid-transfer") from None
                if deadline.expired():
                    raise ChannelTimeout(f"the trainer's bytes stopped for {deadline}") from None
                _poll(self.fd, select.POLLIN, deadline.slice(_TICK))
                continue
            except OSError as exc:
                raise ChannelClosed(f"the trainer's pipe broke: {exc}") from exc
            if n == 0:
                raise ChannelClosed("the trainer's pipe closed mid-transfer")
            view = view[n:]

    def read_commit(self, version: int, deadline: Deadline) -> None:
        """The trailer that makes the bytes just read ``version`` for good."""
        trailer = bytearray(_TRAILER.size)
        self.read_into(memoryview(trailer), deadline)
        (committed,) = _TRAILER.unpack(trailer)
        if committed != version:
            raise ChannelClosed(f"the trailer names version {committed}, expected {version}")

    def close(self) -> None:
        """Close the read end, once: a second call must not close the number's next owner
        (a read still running fails on -1 as on a closed pipe)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
