"""Frames of the network transport: length-prefixed JSON objects (typed headers, never
pickled), chunk headers as fixed structs, and raw chunk bytes read straight into their
destination. After the handshake every frame carries its MAC (:mod:`.seal`). A read is
bounded by the call's one :class:`~weightsync.core.deadline.Deadline` when it is given
one (a fetch: the whole call), by the socket's timeout otherwise."""

from __future__ import annotations

import errno
import json
import socket
import struct
import time
from typing import Any

import torch

from weightsync.core.checksum import checksum
from weightsync.core.deadline import Deadline
from weightsync.transports.net.seal import TAG_BYTES, Seal

PROTOCOL = "weightsync-net/2"
#: a JSON frame's length prefix, and the largest frame accepted after the handshake (the
#: version header lists every tensor's name, dtype and shape)
_FRAME = struct.Struct("!I")
MAX_FRAME = 64 << 20
#: before the peer is authenticated, frames are small
PREAUTH_MAX_FRAME = 4096
#: one chunk's header: kind (see ``delta.codec``), payload bytes, checksum of the new chunk
CHUNK_HEADER = struct.Struct("!BQQ")
#: what a chunk's MAC binds it to besides its header and bytes: its version and index
CHUNK_POSITION = struct.Struct("!QQ")
CHUNK_BYTES = 8 << 20


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow, or closed mid-message."""


class DeadlinePassed(TimeoutError):
    """A read or write ran past the deadline of the call it belongs to."""


def send_frame(sock: socket.socket, message: dict[str, Any], seal: Seal | None = None) -> int:
    """One JSON frame; with ``seal``, followed by its MAC. Returns the bytes sent."""
    data = json.dumps(message, separators=(",", ":")).encode()
    head = _FRAME.pack(len(data))
    tag = b"" if seal is None else seal.sign(head, data)
    sock.sendall(head + data + tag)
    return len(head) + len(data) + len(tag)


def recv_exact(sock: socket.socket, nbytes: int, deadline: Deadline | None = None) -> bytearray:
    buffer = bytearray(nbytes)
    recv_into_exact(sock, memoryview(buffer), deadline)
    return buffer


#: a long read wakes up once this much has arrived (``SO_RCVLOWAT``), not at every segment:
#: each wake-up takes the GIL, and in a vLLM worker the engine's thread waits for it between
#: its kernels (at 1 Gb/s a fetch thread was switched out about 2,000 times a second)
WAKE_BYTES = 1 << 20
#: reads up to this size (frames, chunk headers) wake up as their bytes come
_SHORT_READ = 64 << 10


def _wake_after(sock: socket.socket, nbytes: int) -> bool:
    """Have ``sock`` wake its reader only once ``nbytes`` are queued (TCP only: a Unix
    socket's poll ignores it); False when the socket does not take it."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
    except OSError:
        return False
    return True


def _queued(sock: socket.socket, view: memoryview) -> int:
    """Read, without waiting, what arrived but stayed below the wake-up threshold (a
    timeout's error names it)."""
    timeout = sock.gettimeout()
    try:
        _wake_after(sock, 1)
        sock.settimeout(0)
        return sock.recv_into(view, len(view))
    except OSError:
        return 0
    finally:
        sock.settimeout(timeout)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: Deadline | None = None) -> None:
    """Fill ``view`` from ``sock``; ``ProtocolError`` if the peer closes first,
    ``DeadlinePassed`` once ``deadline`` passes (a trickling peer included). A long read
    wakes up once per :data:`WAKE_BYTES` (or the bytes it still lacks, when fewer)."""
    got, total = 0, len(view)
    waking = total > _SHORT_READ
    low = 1  # the socket's wake-up threshold now
    try:
        while got < total:
            wanted = min(total - got, WAKE_BYTES)
            if waking and wanted != low:
                waking = _wake_after(sock, wanted)
                low = wanted if waking else 1
            if deadline is not None:
                left = deadline.remaining()
                if left is not None and left <= 0:
                    raise DeadlinePassed(f"{got} of {total} bytes arrived within {deadline}")
                sock.settimeout(left)
            try:
                n = sock.recv_into(view[got:], total - got)
            except TimeoutError:
                got += _queued(sock, view[got:]) if low != 1 else 0
                if deadline is not None:
                    raise DeadlinePassed(f"{got} of {total} bytes arrived within {deadline}"
                                         ) from None
                raise
            if n == 0:
                raise ProtocolError(f"the peer closed the connection after {got} of {total} bytes")
            got += n
    finally:
        if low != 1:
            _wake_after(sock, 1)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME, seal: Seal | None = None,
               deadline: Deadline | None = None, what: str = "a frame") -> dict[str, Any]:
    """One JSON object frame of at most ``max_bytes``; ``ProtocolError`` otherwise. With
    ``seal``, its MAC is checked first (``IntegrityError`` naming ``what``)."""
    head = recv_exact(sock, _FRAME.size, deadline)
    (length,) = _FRAME.unpack(head)
    if length > max_bytes:
        raise ProtocolError(f"a frame of {length} bytes (at most {max_bytes} here)")
    data = recv_exact(sock, length + (0 if seal is None else TAG_BYTES), deadline)
    if seal is not None:
        body = memoryview(data)[:length]
        seal.check(memoryview(data)[length:], head, body, what=what)
        data = data[:length]
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"a frame that is not JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame that is a JSON {type(message).__name__}, not an object")
    return message


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, without a copy."""
    return memoryview(tensor.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer


def chunk_checksum(chunk: torch.Tensor) -> int:
    """The checksum of a uint8 chunk: the one every checksummed path uses
    (:mod:`weightsync.core.checksum`), which sees where each byte is, so swapped or
    compensating bytes are caught too (the handshake's MACs, not this sum, keep out an
    attacker)."""
    return checksum(chunk)


def split_address(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) as ``(host, port)``; ValueError naming
    the address otherwise."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address {address!r} is not HOST:PORT (a port from 0 to 65535)")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6): what :func:`split_address` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: errors of a peer that is not listening yet (or not reachable yet): tried again
NOT_LISTENING_YET = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)


def connect_when_listening(address: str, deadline: Deadline) -> socket.socket:
    """A TCP connection (no Nagle) to ``address``, trying again with a growing pause while
    nothing listens there yet; ``TimeoutError`` once ``deadline`` passes, the ``OSError``
    of any other failure at once."""
    host, port = split_address(address)
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline.slice(5.0), 0.05))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            if exc.errno not in NOT_LISTENING_YET and not isinstance(exc, TimeoutError):
                raise
            if deadline.expired():
                raise TimeoutError(f"nothing listening at {address} within {deadline} "
                                   f"({exc})") from exc
            time.sleep(deadline.slice(delay))
            delay = min(delay * 2, 0.2)
