"""Every byte after the handshake is authenticated: a *seal* is the pair of MAC streams of
one connection, keyed from the host's token and both handshake nonces.

Each message (a JSON frame, or a chunk's header with the chunk's final bytes) gets a
16-byte Poly1305 tag under a one-time key, ``HMAC-SHA256(direction key, message number)``:
the construction of ChaCha20-Poly1305 without the cipher. The message number makes a
dropped, repeated, reordered or replayed message fail; the direction keys keep a host's
messages from being reflected as the trainer's; the connection key (from fresh nonces)
keeps one connection's messages out of another. Poly1305 runs at memory speed (about
10 GB/s a core), so a chunk costs a fraction of its copy. Nothing is encrypted: a relay on
the path still reads the weights, it only cannot change them unseen."""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.poly1305 import Poly1305

from weightsync.core.errors import IntegrityError

TAG_BYTES = 16
_TO_HOST = b"trainer->host"
_TO_TRAINER = b"host->trainer"

Bytes = bytes | bytearray | memoryview


def connection_key(token: str, trainer_nonce: str, host_nonce: str) -> bytes:
    """The key of one connection: both ends derive it once the handshake proved the token."""
    label = f"weightsync-net/2 seal/{trainer_nonce}/{host_nonce}".encode()
    return hmac.new(token.encode(), label, hashlib.sha256).digest()


class Seal:
    """One end's MACs: tags what it sends (its own numbering) and checks what it receives
    (the peer's numbering). ``role`` is ``"trainer"`` or ``"host"``."""

    def __init__(self, key: bytes, role: str) -> None:
        if role not in ("trainer", "host"):
            raise ValueError(f"a seal's role is 'trainer' or 'host', got {role!r}")
        to_host = hmac.new(key, _TO_HOST, hashlib.sha256).digest()
        to_trainer = hmac.new(key, _TO_TRAINER, hashlib.sha256).digest()
        self._out, self._in = (to_host, to_trainer) if role == "trainer" else (to_trainer, to_host)
        self._sent = 0
        self._received = 0

    @staticmethod
    def _tag(direction: bytes, number: int, parts: tuple[Bytes, ...]) -> bytes:
        one_time = hmac.new(direction, number.to_bytes(8, "big"), hashlib.sha256).digest()
        mac = Poly1305(one_time)
        for part in parts:
            mac.update(part)
        return mac.finalize()

    def sign(self, *parts: Bytes) -> bytes:
        """The tag of the next message this end sends, over ``parts`` in order."""
        tag = self._tag(self._out, self._sent, parts)
        self._sent += 1
        return tag

    def check(self, tag: Bytes, *parts: Bytes, what: str) -> None:
        """Verify the next message from the peer; ``IntegrityError`` naming ``what`` if it
        was changed, swapped, replayed or truncated on the way (or came from no holder of
        this connection's key)."""
        want = self._tag(self._in, self._received, parts)
        self._received += 1
        if not hmac.compare_digest(want, bytes(tag)):
            raise IntegrityError(
                f"{what} failed its MAC: it was changed, reordered, replayed or cut short on "
                "the way, or did not come from the peer that proved the token")
