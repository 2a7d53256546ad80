"""Attacks on the same-host schemes: an impostor at the trainer's address, and hostile
connections to the trainer's hub, from another user (``nobody``) and from the same user
without the scheme's token. Each must be refused without harm, and real workers keep
joining."""

from __future__ import annotations

import array
import base64
import json
import os
import pickle
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from other_user import needs_root, run_as_user
from workers import echo_worker, make_model

import weightsync as ws

_PREFIX = struct.Struct("!IQ")


def _frame(header: Any, payload_len: int = 0) -> bytes:
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return _PREFIX.pack(len(body), payload_len) + body


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    prefix = b""
    while len(prefix) < _PREFIX.size:
        chunk = sock.recv(_PREFIX.size - len(prefix))
        if not chunk:
            raise ConnectionError("closed")
        prefix += chunk
    n, _ = _PREFIX.unpack(prefix)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return json.loads(body)


class _Marker:
    """A pickle that would create a file when unpickled: proof of code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def _impostor(address: str, marker: str, ready: Any, seen: list[bytes], rounds: int) -> None:
    """Bind the trainer's address and answer workers as a malicious sender would."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(4)
    server.settimeout(20)
    ready.set()
    evil = base64.b64encode(pickle.dumps((_Marker(marker),))).decode()
    try:
        for _ in range(rounds):
            conn, _ = server.accept()
            conn.settimeout(10)
            try:
                conn.sendall(_frame({"t": "challenge", "nonce": "00" * 16}))
                hello = _read_frame(conn)
                seen.append(json.dumps(hello).encode())
                conn.sendall(_frame({"t": "welcome", "worker_idx": 0, "proof": "f" * 64}))
                conn.sendall(_frame({"t": "shm.slot", "model_id": "policy", "index": 0,
                                     "devices": {"cuda:0": evil}}))
                conn.recv(1)
            except OSError:
                pass
            finally:
                conn.close()
    finally:
        server.close()


def _receiver_connect(scheme: Any) -> str:
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(make_model())
    try:
        receiver.connect(timeout=10)
    except ws.WeightSyncError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        receiver.close()
    return "connected"


def _connect_past_an_impostor(scheme: Any, tmp_path: Path) -> tuple[str, list[bytes], str]:
    """A receiver connects while an impostor (a thread of this process) holds the address:
    what connect() said, the hellos the impostor saw, and the file its pickle would make."""
    marker = str(tmp_path / "pwned")
    ready, seen = threading.Event(), []
    thread = threading.Thread(target=_impostor, args=(scheme.address, marker, ready, seen, 1))
    thread.start()
    ready.wait(5)
    outcome = _receiver_connect(scheme)
    thread.join(15)
    return outcome, seen, marker


@pytest.mark.parametrize("scheme_cls", [ws.SharedMemWeightSyncScheme, ws.MultiProcessWeightSyncScheme])
def test_impostor_without_the_token_is_refused_and_learns_nothing(scheme_cls, tmp_path):
    scheme = scheme_cls(num_workers=1, timeout=10)
    outcome, seen, marker = _connect_past_an_impostor(scheme, tmp_path)
    assert "could not prove it holds the scheme's token" in outcome
    assert not os.path.exists(marker), "the impostor's pickle ran in the worker"
    assert seen and all(scheme.token.encode() not in hello for hello in seen)


def _impostor_as_other_user(address: str, marker: str) -> str:
    ready = threading.Event()
    _impostor(address, marker, ready, [], 1)
    return "done"


@needs_root
@pytest.mark.multiuser
def test_impostor_of_another_user_is_refused_by_credentials(tmp_path):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=10)
    marker = str(tmp_path / "pwned")
    os.chmod(tmp_path, 0o777)
    result: dict[str, Any] = {}
    attacker = threading.Thread(target=lambda: result.setdefault(
        "r", _safe(run_as_user, _impostor_as_other_user, scheme.address, marker, timeout=30)))
    attacker.start()
    deadline = time.monotonic() + 10
    while not _bound(scheme.address) and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = _receiver_connect(scheme)
    attacker.join(35)
    assert "runs as uid 65534" in outcome
    assert not os.path.exists(marker)


def _safe(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        return exc


def _bound(address: str) -> bool:
    names = Path("/proc/net/unix").read_text()
    return "@" + address[1:] in names


# ---------------------------------------------------------------- attacks on the hub
def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(address)
    return sock


def _send_one(address: str, data: bytes) -> str:
    """Connect and send ``data``; "refused" if the hub hung up on us first."""
    sock = _connect(address)
    try:
        sock.sendall(data)
        time.sleep(0.2)
        return "sent"
    except OSError:
        return "refused"
    finally:
        sock.close()


def _nested_json(address: str) -> str:
    return _send_one(address, _frame(b"[" * 100000 + b"]" * 100000))


def _not_an_object(address: str) -> str:
    return _send_one(address, _frame([]))


def _huge_payload(address: str) -> str:
    return _send_one(address, _frame({"t": "hello"}, payload_len=2**62))


def _silent_connections(address: str) -> list[socket.socket]:
    return [_connect(address) for _ in range(4)]


def _fd_flood(address: str) -> str:
    spare = os.open("/dev/null", os.O_RDONLY)
    fds = array.array("i", [spare] * 64)
    socks = []
    for _ in range(100):
        try:
            sock = _connect(address)
            sock.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            socks.append(sock)
        except OSError:
            break
    time.sleep(0.5)
    for sock in socks:
        sock.close()
    os.close(spare)
    return "sent"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


ATTACKS = {
    "nested-json": _nested_json,
    "not-an-object": _not_an_object,
    "huge-payload": _huge_payload,
    "fd-flood": _fd_flood,
}


def _sender_that_keeps_working(scheme: Any, workers: Any, attack: Any, fd_slack: int = 8) -> None:
    """Run ``attack(address)`` against a live hub, then check that a new worker joins
    within seconds and sends still reach it."""
    sender = scheme.create_sender()
    sender.register_model(make_model())
    workers.start(echo_worker, scheme, 0)
    sender.connect(timeout=30)
    assert workers.out.get(timeout=30)[0] == "connected"
    fds_before = _open_fds()
    attack()
    workers.kill(0)
    t0 = time.monotonic()
    workers.start(echo_worker, scheme, 0)
    event = workers.out.get(timeout=20)
    assert event[0] == "connected", f"a real worker could not rejoin after the attack: {event}"
    assert time.monotonic() - t0 < 10
    version = sender.send(timeout=10)
    assert workers.out.get(timeout=20)[:3] == ("version", 0, version)
    deadline = time.monotonic() + 7  # unanswered handshakes expire after 5 s
    while _open_fds() > fds_before + fd_slack and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_fds() <= fds_before + fd_slack, "the attack left descriptors open in the trainer"
    sender.close()


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_hub_survives_same_user_attacks_before_the_handshake(name, workers):
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
    _sender_that_keeps_working(
        scheme, workers, lambda: ATTACKS[name](scheme.address)
    )


def test_silent_connections_do_not_stall_joining_workers(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    held: list[socket.socket] = []
    _sender_that_keeps_working(
        scheme, workers, lambda: held.extend(_silent_connections(scheme.address)),
        fd_slack=16,  # the test's own four sockets and the hub's ends, until they expire
    )
    for sock in held:
        sock.close()


@needs_root
@pytest.mark.multiuser
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_hub_refuses_another_user_at_once(name, workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    _sender_that_keeps_working(
        scheme, workers,
        lambda: run_as_user(ATTACKS[name], scheme.address, timeout=30),
    )


def test_cuda_ipc_handles_are_typed_fields_never_unpickled(tmp_path):
    from weightsync.transports.memory.cuda_ipc import checked_fields

    marker = str(tmp_path / "pwned")
    evil = base64.b64encode(pickle.dumps((_Marker(marker),))).decode()
    with pytest.raises(ValueError, match="exactly the fields"):
        checked_fields(evil)
    fields = {"nbytes": 16, "offset": 0, "device": 0, "handle": evil,
              "storage_size_bytes": 16, "storage_offset_bytes": 0,
              "ref_counter_handle": "", "ref_counter_offset": 0, "event_handle": "",
              "event_sync_required": False}
    decoded = checked_fields(fields)
    assert isinstance(decoded["handle"], bytes) and not os.path.exists(marker)
    with pytest.raises(ValueError, match="must be an int"):
        checked_fields(fields | {"device": "0"})


def _scheme_made_elsewhere() -> Any:
    return ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=10)


def test_a_trainer_outside_the_creators_process_tree_is_refused(tmp_path):
    from other_user import run_in_child

    scheme = run_in_child(_scheme_made_elsewhere)  # created (and owned) by another process
    outcome, seen, _marker = _connect_past_an_impostor(scheme, tmp_path)
    assert "nor one of its descendants" in outcome
    assert seen == [], "the worker must not even say hello to such a process"
