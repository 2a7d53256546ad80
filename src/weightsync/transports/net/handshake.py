"""Both ends of a network connection prove the receiving host's credential, without sending
it, and agree on the connection's seal (:mod:`.seal`) that authenticates every byte after.

The trainer holds one secret token per session and never hands it out: each host gets a
*credential* of its own, ``"<host id>.<HMAC(token, host id)>"``. The trainer derives any
host's credential from the id the host names in its hello; a host knows only its own. So a
server cannot pose as the trainer to another server (it cannot prove that server's
credential), and a relay on the path, holding none, cannot join or change a byte.

Each end sends a random nonce and answers the other's with an HMAC over both (the local
transport's proofs, ``local.auth``), the receiving host first. A peer that fails is dropped
before it may send anything but small frames."""

from __future__ import annotations

import hashlib
import hmac
import re
import socket

from weightsync.core.deadline import Deadline
from weightsync.transports.local.auth import (
    HandshakeError,
    new_nonce,
    proofs_match,
    sender_proof,
    worker_proof,
)
from weightsync.transports.net.seal import Seal, connection_key
from weightsync.transports.net.wire import PREAUTH_MAX_FRAME, PROTOCOL, recv_frame, send_frame

__all__ = ["HandshakeError", "accept_peer", "host_credential", "prove_to_trainer"]

_HOST_ID = re.compile(r"[A-Za-z0-9_:/@-]{1,128}")


def _check_host_id(host_id: object) -> str:
    if not isinstance(host_id, str) or not _HOST_ID.fullmatch(host_id):
        raise ValueError(f"a host id is 1-128 of [A-Za-z0-9_:/@-], got {host_id!r:.140}")
    return host_id


def host_credential(token: str, host_id: str) -> str:
    """The credential of host ``host_id`` in the session whose secret is ``token``: what
    the trainer hands that host (and only it)."""
    digest = hmac.new(token.encode(), f"weightsync-net host/{_check_host_id(host_id)}".encode(),
                      hashlib.sha256).hexdigest()
    return f"{host_id}.{digest}"


def _host_id(credential: str) -> str:
    host_id, dot, _ = credential.partition(".")
    if not dot:
        raise ValueError("a host credential is '<host id>.<secret>', as the trainer's "
                         "host_credential(token, host_id) makes it; got one without a '.'")
    return _check_host_id(host_id)


def _field(message: dict[str, object], name: str) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise HandshakeError(f"the handshake frame has no valid {name!r}")
    return value


def prove_to_trainer(sock: socket.socket, credential: str, host: str,
                     deadline: Deadline | None = None) -> Seal:
    """The receiving host's half: returns the connection's seal; raises ``HandshakeError``
    if the trainer cannot prove this host's credential (an impostor listening at the
    trainer's address, another server among them)."""
    mine = new_nonce()
    send_frame(sock, {"protocol": PROTOCOL, "nonce": mine, "id": _host_id(credential),
                      "host": host[:200]})
    reply = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
    if "error" in reply:
        raise HandshakeError(f"the trainer refused the connection: {reply['error']}")
    theirs = _field(reply, "nonce")
    send_frame(sock, {"proof": worker_proof(credential, theirs, mine, 0)})
    answer = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
    if "error" in answer:
        raise HandshakeError(f"the trainer refused the connection: {answer['error']}")
    if not proofs_match(sender_proof(credential, theirs, mine, 0), answer.get("proof")):
        raise HandshakeError("the peer at the trainer's address could not prove this host's "
                             "credential (it is not the trainer)")
    return Seal(connection_key(credential, theirs, mine), "host")


def accept_peer(sock: socket.socket, token: str,
                deadline: Deadline | None = None) -> tuple[str, Seal]:
    """The trainer's half: ``(the host's self-reported name, the connection's seal)`` once
    it proved the credential of the id it names; raises ``HandshakeError`` (and tells the
    peer) otherwise."""
    hello = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
    if hello.get("protocol") != PROTOCOL:
        send_frame(sock, {"error": f"expected protocol {PROTOCOL}"})
        raise HandshakeError(f"a peer speaking {hello.get('protocol')!r}, not {PROTOCOL}")
    theirs = _field(hello, "nonce")
    try:
        credential = host_credential(token, _field(hello, "id"))
    except ValueError as exc:
        send_frame(sock, {"error": "a hello without a valid host id"})
        raise HandshakeError(f"a peer without a valid host id ({exc})") from None
    host = f"{hello['id']} ({str(hello.get('host', '?'))[:200]})"
    mine = new_nonce()
    send_frame(sock, {"nonce": mine})
    proof = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline).get("proof")
    if not proofs_match(worker_proof(credential, mine, theirs, 0), proof):
        send_frame(sock, {"error": "wrong token"})
        raise HandshakeError(f"host {host!r} could not prove its credential")
    send_frame(sock, {"proof": sender_proof(credential, mine, theirs, 0)})
    return host, Seal(connection_key(credential, mine, theirs), "trainer")
