"""Who may talk to whom on one host: peer credentials and a challenge-response handshake.

An abstract Unix socket has no file permissions: any local process, of any user, can
connect to the trainer's address, and once the trainer is gone any process can bind it.
So both ends check the peer's credentials (``SO_PEERCRED``: the scheme's user only), and
both prove they hold the scheme's token without sending it: each side sends a random
nonce and answers the other's with an HMAC over both nonces and the worker index.

Before a peer is authenticated it may send one small JSON frame: no payload, no file
descriptors (any passed are closed at once), at most :data:`PREAUTH_MAX_HEADER` bytes,
and every parse failure is a refusal, never an exception out of the trainer's hub.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any

PREAUTH_MAX_HEADER = 4096
_PREFIX = struct.Struct("!IQ")  # the channel's frame prefix: header length, payload length
_FD_SPACE = socket.CMSG_SPACE(64 * array.array("i").itemsize)


class HandshakeError(ConnectionError):
    """A peer failed authentication or broke the handshake protocol."""


@dataclass(frozen=True)
class PeerCredentials:
    """The process on the other end of a Unix socket, as the kernel reports it."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected Unix socket (Linux)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


def new_nonce() -> str:
    return secrets.token_hex(16)


def _proof(token: str, role: str, first: str, second: str, worker_idx: int) -> str:
    message = f"weightsync/{role}/{first}/{second}/{worker_idx}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def worker_proof(token: str, sender_nonce: str, worker_nonce: str, worker_idx: int) -> str:
    """What a worker sends to prove it holds ``token`` (bound to both nonces)."""
    return _proof(token, "worker", sender_nonce, worker_nonce, worker_idx)


def sender_proof(token: str, sender_nonce: str, worker_nonce: str, worker_idx: int) -> str:
    """What the sender sends back to prove it holds ``token``: a different message, so a
    worker's proof can never be replayed as the sender's."""
    return _proof(token, "sender", worker_nonce, sender_nonce, worker_idx)


def rank_proof(token: str, hub_nonce: str, rank_nonce: str, rank: int) -> str:
    """What a sharded trainer's rank ``rank`` sends rank 0 to prove it holds ``token``."""
    return _proof(token, "rank", hub_nonce, rank_nonce, rank)


def rank_hub_proof(token: str, hub_nonce: str, rank_nonce: str, rank: int) -> str:
    """Rank 0's answer to a rank: a message of its own, never a replayed rank proof."""
    return _proof(token, "rank-hub", rank_nonce, hub_nonce, rank)


def proofs_match(expected: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected, given)


def parse_small_frame(data: bytes | bytearray) -> tuple[dict[str, Any] | None, int]:
    """Parse one pre-authentication frame from the start of ``data``.

    Returns ``(header, consumed)``, or ``(None, 0)`` when more bytes are needed; raises
    :class:`HandshakeError` for anything that is not a small JSON object with no payload.
    """
    if len(data) < _PREFIX.size:
        return None, 0
    header_len, payload_len = _PREFIX.unpack_from(data)
    if header_len > PREAUTH_MAX_HEADER:
        raise HandshakeError(f"handshake frame of {header_len} bytes (at most {PREAUTH_MAX_HEADER})")
    if payload_len:
        raise HandshakeError("a payload before the handshake")
    end = _PREFIX.size + header_len
    if len(data) < end:
        return None, 0
    try:
        header = json.loads(bytes(data[_PREFIX.size:end]))
    except (ValueError, RecursionError) as exc:
        raise HandshakeError(f"handshake frame is not JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise HandshakeError(f"handshake frame is a JSON {type(header).__name__}, not an object")
    return header, end


def recv_no_fds(sock: socket.socket, nbytes: int) -> bytes:
    """Read up to ``nbytes`` without blocking; any file descriptors the peer passed are
    closed at once. Raises BlockingIOError when nothing is there, returns b"" at EOF."""
    data, ancillary, _flags, _addr = sock.recvmsg(nbytes, _FD_SPACE, socket.MSG_DONTWAIT)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
    return data


class PreauthBuffer:
    """Accumulates one unauthenticated peer's bytes until a whole small frame is there.

    It reads exactly the frame's bytes (prefix, then header), never into the next frame,
    so a frame that follows (with file descriptors, once authenticated) stays intact."""

    def __init__(self) -> None:
        self._data = bytearray()

    def _wanted(self) -> int:
        if len(self._data) < _PREFIX.size:
            return _PREFIX.size - len(self._data)
        header_len, _payload = _PREFIX.unpack_from(self._data)
        return min(header_len, PREAUTH_MAX_HEADER) + _PREFIX.size - len(self._data)

    def feed(self, sock: socket.socket) -> dict[str, Any] | None:
        """Read what is available; return the frame once complete. Raises
        :class:`HandshakeError` on a malformed frame or EOF, BlockingIOError if idle."""
        while True:
            header, _consumed = parse_small_frame(self._data)
            if header is not None:
                self._data.clear()
                return header
            chunk = recv_no_fds(sock, self._wanted())
            if not chunk:
                raise HandshakeError("the peer closed the connection during the handshake")
            self._data += chunk


def read_frame(sock: socket.socket, deadline_remaining: Any) -> dict[str, Any]:
    """Block (up to ``deadline_remaining()`` seconds at a time) for one small frame."""
    import select

    buffer = PreauthBuffer()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        try:
            header = buffer.feed(sock)
        except BlockingIOError:
            header = None
        if header is not None:
            return header
        left = deadline_remaining()
        if left is not None and left <= 0:
            raise TimeoutError("no handshake reply in time")
        poller.poll(None if left is None else max(1, int(left * 1000)))
