"""Both ends of a network connection prove they hold the token the trainer made for this
session, without sending it: each sends a random nonce and answers the other's with an
HMAC over both (the same proofs as the local transport's, ``local.auth``), the receiving
host first. A peer that fails is dropped before it may send anything but small frames."""

from __future__ import annotations

import socket

from weightsync.transports.local.auth import (
    HandshakeError,
    new_nonce,
    proofs_match,
    sender_proof,
    worker_proof,
)
from weightsync.transports.net.wire import PREAUTH_MAX_FRAME, PROTOCOL, recv_frame, send_frame

__all__ = ["HandshakeError", "accept_peer", "prove_to_trainer"]


def _field(message: dict[str, object], name: str) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise HandshakeError(f"the handshake frame has no valid {name!r}")
    return value


def prove_to_trainer(sock: socket.socket, token: str, host: str) -> None:
    """The receiving host's half: raises ``HandshakeError`` if the trainer cannot prove
    the token (an impostor listening at the trainer's address)."""
    mine = new_nonce()
    send_frame(sock, {"protocol": PROTOCOL, "nonce": mine, "host": host[:200]})
    reply = recv_frame(sock, PREAUTH_MAX_FRAME)
    if "error" in reply:
        raise HandshakeError(f"the trainer refused the connection: {reply['error']}")
    theirs = _field(reply, "nonce")
    send_frame(sock, {"proof": worker_proof(token, theirs, mine, 0)})
    answer = recv_frame(sock, PREAUTH_MAX_FRAME)
    if "error" in answer:
        raise HandshakeError(f"the trainer refused the connection: {answer['error']}")
    if not proofs_match(sender_proof(token, theirs, mine, 0), answer.get("proof")):
        raise HandshakeError("the peer at the trainer's address could not prove the token")


def accept_peer(sock: socket.socket, token: str) -> str:
    """The trainer's half: returns the host's self-reported name once it proved the token;
    raises ``HandshakeError`` (and tells the peer) otherwise."""
    hello = recv_frame(sock, PREAUTH_MAX_FRAME)
    if hello.get("protocol") != PROTOCOL:
        send_frame(sock, {"error": f"expected protocol {PROTOCOL}"})
        raise HandshakeError(f"a peer speaking {hello.get('protocol')!r}, not {PROTOCOL}")
    theirs = _field(hello, "nonce")
    host = str(hello.get("host", "?"))[:200]
    mine = new_nonce()
    send_frame(sock, {"nonce": mine})
    proof = recv_frame(sock, PREAUTH_MAX_FRAME).get("proof")
    if not proofs_match(worker_proof(token, mine, theirs, 0), proof):
        send_frame(sock, {"error": "wrong token"})
        raise HandshakeError(f"host {host!r} could not prove the token")
    send_frame(sock, {"proof": sender_proof(token, mine, theirs, 0)})
    return host
