"""Frames of the network transport: length-prefixed JSON objects (typed headers, never
pickled), chunk headers as fixed structs, and raw chunk bytes read straight into their
destination. Every read is bounded by the socket's timeout."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import torch

from weightsync.core.checksum import checksum

PROTOCOL = "weightsync-net/1"
#: a JSON frame's length prefix, and the largest frame accepted after the handshake (the
#: version header lists every tensor's name, dtype and shape)
_FRAME = struct.Struct("!I")
MAX_FRAME = 64 << 20
#: before the peer is authenticated, frames are small
PREAUTH_MAX_FRAME = 4096
#: one chunk's header: kind (see ``delta.codec``), payload bytes, checksum of the new chunk
CHUNK_HEADER = struct.Struct("!BQQ")
CHUNK_BYTES = 8 << 20


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow, or closed mid-message."""


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(len(data)) + data)


def recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    recv_into_exact(sock, memoryview(buffer))
    return buffer


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ProtocolError`` if the peer closes first."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ProtocolError(f"the peer closed the connection after {got} of {total} bytes")
        got += n


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME) -> dict[str, Any]:
    """One JSON object frame of at most ``max_bytes``; ``ProtocolError`` otherwise."""
    (length,) = _FRAME.unpack(recv_exact(sock, _FRAME.size))
    if length > max_bytes:
        raise ProtocolError(f"a frame of {length} bytes (at most {max_bytes} here)")
    try:
        message = json.loads(recv_exact(sock, length))
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
