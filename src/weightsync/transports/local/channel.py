"""A framed message channel between processes of one host, over a Unix stream socket.

Each message is a JSON header, an optional raw payload (tensor bytes, never pickled) and
optional file descriptors (shared-memory segments). Every wait has a deadline, and one
thread may send while another receives. Addresses, listeners and connecting are in
``local.address``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.core.deadline import Deadline

logger = logging.getLogger(__name__)

_PREFIX = struct.Struct("!IQ")  # header length, payload length
_MAX_HEADER = 64 * 1024 * 1024
_MAX_FDS = 64
_SOCKET_BUFFER = 4 * 1024 * 1024
_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class ChannelClosed(ConnectionError):
    """The peer closed the connection or its process died."""


class ChannelTimeout(TimeoutError):
    """A send or receive on a channel ran past its deadline."""


@dataclass
class Message:
    """One received message: its JSON header, raw payload (if read) and passed fds."""

    header: dict[str, Any]
    payload_nbytes: int = 0
    payload: bytearray | None = None
    fds: list[int] = field(default_factory=list)


def _wait(sock: socket.socket, events: int, deadline: Deadline, what: str) -> None:
    poller = select.poll()
    poller.register(sock.fileno(), events)
    while True:
        left = deadline.remaining()
        ready = poller.poll(None if left is None else max(0, int(left * 1000)))
        if ready:
            return
        if deadline.expired():
            raise ChannelTimeout(f"{what} timed out after {deadline}")


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


def hung_up(channels: Sequence[Channel]) -> list[Channel]:
    """The channels whose peer hung up (or errored), found with a single ``poll``."""
    poller = select.poll()
    by_fd = {}
    for channel in channels:
        if channel.closed:
            continue
        with contextlib.suppress(OSError, ValueError):
            poller.register(channel.fileno(), _HANGUP)
            by_fd[channel.fileno()] = channel
    found = [channel for channel in channels if channel.closed]
    for fd, events in poller.poll(0):
        if events & _HANGUP:
            found.append(by_fd[fd])
    return found


class Channel:
    """A connected, framed, deadline-aware message channel (one sender thread at a time)."""

    def __init__(self, sock: socket.socket) -> None:
        _tune(sock)
        self._sock = sock
        self._send_lock = threading.Lock()
        self._closed = False
        self._owner_pid = os.getpid()

    @classmethod
    def from_pipe(cls, pipe: Any) -> Channel:
        """Wrap a ``Channel``, a Unix ``socket.socket`` or a duplex ``multiprocessing.Pipe``
        end. A pipe's fd is duplicated: both ends must be wrapped, since framing differs."""
        if isinstance(pipe, Channel):
            return pipe
        if isinstance(pipe, socket.socket):
            return cls(pipe)
        fileno = getattr(pipe, "fileno", None)
        if fileno is None:
            raise TypeError(
                f"register_pipe: got {type(pipe).__name__}; expected a Channel, a Unix socket or a "
                "duplex multiprocessing.Pipe() end"
            )
        fd = os.dup(fileno())
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            os.close(fd)
            raise TypeError(
                "register_pipe: the pipe must be a Unix socket (mp.Pipe(duplex=True))"
            ) from exc
        if sock.family != socket.AF_UNIX:
            sock.close()
            raise TypeError("register_pipe: the pipe must be a Unix socket (mp.Pipe(duplex=True))")
        return cls(sock)

    @classmethod
    def pair(cls) -> tuple[Channel, Channel]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(a), cls(b)

    # ------------------------------------------------------------------ state
    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def socket(self) -> socket.socket:
        """The underlying Unix socket (for peer credentials and the handshake)."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def peer_closed(self) -> bool:
        """True if the peer hung up (EOF pending and nothing else to read first)."""
        if self._closed:
            return True
        try:
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return data == b""

    def close(self) -> None:
        """Close this end. ``shutdown`` (which the peer sees at once) only in the process
        that made the channel: a forked child's copy closes its descriptor and nothing else."""
        if not self._closed:
            self._closed = True
            if os.getpid() == self._owner_pid:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    # ------------------------------------------------------------------ sending
    def send(
        self, header: dict[str, Any], payload: bytes | bytearray | memoryview | None = None,
        fds: Sequence[int] = (), timeout: float | None = None,
    ) -> None:
        """Send one message; raises ChannelClosed or ChannelTimeout (a partly written message
        cannot be taken back: the channel is then shut down)."""
        view = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
        self._send_frame(header, len(view), [view], list(fds), Deadline(timeout))

    def send_stream(
        self, header: dict[str, Any], nbytes: int, pieces: Iterable[memoryview],
        timeout: float | None = None,
    ) -> None:
        """Send one message whose ``nbytes`` of payload come from ``pieces`` as they are
        produced, each written as soon as it is yielded. If ``pieces`` fails or falls short,
        the frame is broken: the channel is shut down (the peer sees it end at once) and
        the error raised."""
        self._send_frame(header, nbytes, pieces, [], Deadline(timeout))

    def _send_frame(self, header: dict[str, Any], nbytes: int, pieces: Iterable[memoryview],
                    fds: list[int], deadline: Deadline) -> None:
        body = json.dumps(header, separators=(",", ":")).encode()
        first = _PREFIX.pack(len(body), nbytes) + body
        with self._send_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            sent = 0
            try:
                sent = self._send_first(first, fds, deadline)
                self._send_all(memoryview(first)[sent:], deadline)
                for piece in pieces:
                    nbytes -= len(piece)
                    if nbytes < 0:
                        break
                    self._send_all(piece, deadline)
                if nbytes != 0:
                    raise ChannelClosed(f"the payload missed its announced size by {nbytes} bytes")
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise ChannelClosed(f"peer closed the connection: {exc}") from exc
            except BaseException:
                # a frame begun and not finished can never be read: end the stream now, so
                # the peer sees it at once (as in close(): never from a forked copy)
                if sent and os.getpid() == self._owner_pid:
                    with contextlib.suppress(OSError):
                        self._sock.shutdown(socket.SHUT_RDWR)
                raise

    def _send_first(self, data: bytes, fds: list[int], deadline: Deadline) -> int:
        while True:
            try:
                if fds:
                    return socket.send_fds(self._sock, [data], fds)
                return self._sock.send(data)
            except BlockingIOError:
                _wait(self._sock, select.POLLOUT, deadline, "send")

    def _send_all(self, view: memoryview, deadline: Deadline) -> None:
        while len(view):
            try:
                n = self._sock.send(view)
            except BlockingIOError:
                _wait(self._sock, select.POLLOUT, deadline, "send")
                continue
            view = view[n:]

    # ------------------------------------------------------------------ receiving
    def _recv_into(self, view: memoryview, deadline: Deadline, fds: list[int] | None) -> None:
        while len(view):
            try:
                if fds is not None and not fds:
                    data, got_fds, _flags, _addr = socket.recv_fds(self._sock, len(view), _MAX_FDS)
                    fds.extend(got_fds)
                    n = len(data)
                    view[:n] = data
                else:
                    n = self._sock.recv_into(view)
            except BlockingIOError:
                _wait(self._sock, select.POLLIN, deadline, "receive")
                continue
            except OSError as exc:
                raise ChannelClosed(f"connection lost: {exc}") from exc
            if n == 0:
                raise ChannelClosed("peer closed the connection")
            view = view[n:]

    def recv_header(self, timeout: float | None = None, *, max_payload: int | None = None) -> Message:
        """Receive the next message's header and fds; its payload (``payload_nbytes``) must
        then be read with :meth:`recv_payload_into` or :meth:`recv_payload`. A malformed
        frame (not a JSON object, or a payload over ``max_payload``) raises ChannelClosed:
        the stream cannot be trusted after it."""
        deadline = Deadline(timeout)
        prefix = bytearray(_PREFIX.size)
        fds: list[int] = []
        try:  # descriptors that came with a frame not returned are closed, never leaked
            self._recv_into(memoryview(prefix), deadline, fds)
            header_len, payload_len = _PREFIX.unpack(prefix)
            if header_len > _MAX_HEADER:
                raise ChannelClosed(f"malformed frame: header of {header_len} bytes")
            body = bytearray(header_len)
            self._recv_into(memoryview(body), deadline, None)
            try:
                header = json.loads(body)
            except (ValueError, RecursionError) as exc:
                raise ChannelClosed(f"malformed frame header: {type(exc).__name__}") from None
            if not isinstance(header, dict):
                raise ChannelClosed(f"malformed frame: a JSON {type(header).__name__}, not an "
                                    "object")
            if max_payload is not None and payload_len > max_payload:
                raise ChannelClosed(f"malformed frame: a payload of {payload_len} bytes")
        except BaseException:
            _close_fds(fds)
            raise
        return Message(header=header, payload_nbytes=payload_len, fds=fds)

    def recv_payload_into(self, view: memoryview, timeout: float | None = None) -> None:
        self._recv_into(view.cast("B") if view.format != "B" else view, Deadline(timeout), None)

    def recv_payload(self, message: Message, timeout: float | None = None) -> bytearray:
        data = bytearray(message.payload_nbytes)
        self._recv_into(memoryview(data), Deadline(timeout), None)
        message.payload = data
        return data

    def recv(self, timeout: float | None = None, *, max_payload: int | None = None) -> Message:
        """Receive one whole message, payload included."""
        deadline = Deadline(timeout)
        message = self.recv_header(deadline.remaining(), max_payload=max_payload)
        if message.payload_nbytes:
            try:
                self.recv_payload(message, deadline.remaining())
            except BaseException:
                _close_fds(message.fds)
                raise
        return message

    def send_nowait(self, header: dict[str, Any]) -> bool:
        """Send a small message only if the socket can take it now; False if its buffer is
        full (a peer that does not read). A frame begun is always finished."""
        body = json.dumps(header, separators=(",", ":")).encode()
        data = memoryview(_PREFIX.pack(len(body), 0) + body)
        with self._send_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                return False
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise ChannelClosed(f"peer closed the connection: {exc}") from exc
            if sent < len(data):
                self._send_all(data[sent:], Deadline(1.0))
        return True

    def readable(self, timeout: float = 0.0) -> bool:
        """True if a message (or EOF) is waiting to be read."""
        if self._closed:
            return True
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
