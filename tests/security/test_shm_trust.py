"""The shared-memory trust model (docs/security.md), one test per promise.

- A connected worker holds the fds of the control block and of every slot, but cannot
  map them writable, write them, resize them or punch holes in them (``memfd`` seals),
  through its own fd or one reopened via ``/proc/self/fd``.
- A worker writes only its own ack segment: whatever it writes through every fd it
  holds, the other workers' targets, versions and weights and what the trainer records
  for them are unchanged.
- Another process of the same user, without the token, cannot open a running trainer's
  fds through ``/proc/<pid>/fd`` nor take them with ``pidfd_getfd``: the trainer is not
  dumpable (unless ``WEIGHTSYNC_DUMPABLE=1`` opts out).
- The Ray node-local path hands its fds over a socket, against a one-time ticket.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import select
import signal
import time
from typing import Any

import pytest
import torch
from other_user import NOBODY, needs_root, run_as_user, run_in_child

from weightsync import SharedMemTransport
from weightsync.core.deadline import Deadline

_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3
_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}
_FORGED = 777


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)))


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), value), "b": torch.full((64,), value)}


def _connected(n: int) -> tuple[SharedMemTransport, list[SharedMemTransport], list[Any]]:
    """A sender and ``n`` connected receivers over pipes (one process), at version 0."""
    sender = SharedMemTransport()
    receivers, pipes = [], []
    for _ in range(n):
        a, b = mp.Pipe(duplex=True)
        pipes += [a, b]
        sender.register_pipe(a)
        receiver = SharedMemTransport()
        receiver.register_pipe(b)
        receivers.append(receiver)
    sender.send_weights("policy", _weights(0.0))
    for idx, receiver in enumerate(receivers):
        weights = receiver.setup_connection_and_weights_on_receiver(
            worker_idx=idx, weights=_weights(-1.0), timeout=10)
        assert float(weights["w"][0, 0]) == 0.0
    return sender, receivers, pipes


def _close(sender: SharedMemTransport, receivers: list[SharedMemTransport], pipes: list[Any]) -> None:
    for receiver in receivers:
        receiver.close()
    sender.close()
    for pipe in pipes:
        pipe.close()


def _worker_fds(receiver: SharedMemTransport) -> dict[str, int]:
    """Every shared-memory fd a connected worker holds: control block, slots, its ack."""
    model = receiver.reader._models["policy"]
    fds = {"control": model.control.fd}
    for index, slot in model.slots.items():
        fds[f"slot {index}"] = slot.segments["cpu"].fd
    ack = getattr(model, "ack_segment", None)  # the worker's own (the fix adds it)
    if ack is not None:
        fds["own ack"] = ack.fd
    return fds


def _writable_map(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _try(fn: Any) -> str:
    try:
        result = fn()
    except OSError as exc:
        return type(exc).__name__
    if isinstance(result, mmap.mmap):
        result.close()
    return "allowed"


def _reopen_rw_and_map(fd: int) -> None:
    other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        _writable_map(other).close()
    finally:
        os.close(other)


def test_a_worker_cannot_write_the_slots_or_the_control_block() -> None:
    sender, receivers, pipes = _connected(1)
    try:
        fds = _worker_fds(receivers[0])
        fds.pop("own ack", None)
        outcomes = {name: {
            "mmap writable": _try(lambda fd=fd: _writable_map(fd)),
            "reopened O_RDWR, mmap writable": _try(lambda fd=fd: _reopen_rw_and_map(fd)),
        } for name, fd in fds.items()}
        expected = {name: dict.fromkeys(tries, "PermissionError")
                    for name, tries in outcomes.items()}
        assert outcomes == expected
        # only once nothing could be mapped: these would crash the old code (SIGBUS)
        changes = {name: {
            "pwrite": _try(lambda fd=fd: os.pwrite(fd, b"\x01", 0)),
            "shrink": _try(lambda fd=fd: os.ftruncate(fd, 0)),
            "grow": _try(lambda fd=fd: os.ftruncate(fd, os.fstat(fd).st_size * 2)),
        } for name, fd in fds.items()}
        assert changes == {name: dict.fromkeys(tries, "PermissionError")
                           for name, tries in changes.items()}
        # the worker's own mappings are read-only too: its views cannot be written
        model = receivers[0].reader._models["policy"]
        assert model.ctrl.readonly
        # and the trainer's next version still reaches it whole
        sender.send_weights("policy", _weights(1.0))
        got = receivers[0].receive_weights(timeout=5, weights=_weights(-1.0))
        assert got is not None and float(got["w"].sum()) == 64 * 64
    finally:
        _close(sender, receivers, pipes)


def _forge_everything_writable(fds: dict[str, int]) -> list[str]:
    """What a hostile worker does with the fds it holds: every segment it can map
    writable gets every int64 word set to a forged value; returns those it wrote."""
    written = []
    for name, fd in fds.items():
        try:
            mapping = _writable_map(fd)
        except OSError:
            continue
        words = memoryview(mapping).cast("q")
        for i in range(len(words)):
            words[i] = _FORGED * 1024  # a target for "version 777, slot 0"
        words.release()
        mapping.close()
        written.append(name)
    return written


def test_a_worker_writes_only_its_own_ack_region() -> None:
    sender, receivers, pipes = _connected(2)
    attacker, victim = receivers
    try:
        sender.send_weights("policy", _weights(1.0))
        got = victim.receive_weights(timeout=5, weights=_weights(-1.0))
        assert got is not None
        assert sender.applied_version(1) == 1
        fds = _worker_fds(attacker)
        victim_model = victim.reader._models["policy"]
        victim_ack = getattr(victim_model, "ack_segment", None)
        if victim_ack is not None:  # the victim's ack is no fd the attacker holds
            attacker_inodes = {os.fstat(fd).st_ino for fd in fds.values()}
            assert os.fstat(victim_ack.fd).st_ino not in attacker_inodes
        written = _forge_everything_writable(fds)
        # the victim and the trainer's view of it are untouched: no forged version
        assert victim.published_version(1) == 1
        assert victim.receive_weights(timeout=0.5, weights=_weights(-1.0)) is None
        assert sender.applied_version(1) == 1
        # the attacker could only write, and lie about, its own state
        assert written == ["own ack"]
        assert sender.applied_version(0) == _FORGED * 1024
        sender.send_weights("policy", _weights(2.0))
        got = victim.receive_weights(timeout=5, weights=_weights(-1.0))
        assert got is not None and float(got["w"].sum()) == 2.0 * 64 * 64
        assert sender.applied_version(1) == 2
    finally:
        _close(sender, receivers, pipes)


def test_a_worker_that_joins_again_gets_a_fresh_ack_segment() -> None:
    """A process that kept the old ack segment of a worker index writes nothing the
    trainer reads once that index is attached again."""
    sender, receivers, pipes = _connected(1)
    try:
        old_ack = receivers[0].reader._models["policy"].ack_segment
        old = _writable_map(old_ack.fd)
        a, b = mp.Pipe(duplex=True)
        pipes += [a, b]
        fresh = SharedMemTransport()
        fresh.register_pipe(b)
        receivers.append(fresh)
        sender.detach_worker(0)
        sender.attach_worker(0, _channel(a))
        fresh.wait_for_model("policy", Deadline(5.0), pump=fresh._pump)
        words = memoryview(old).cast("q")
        words[0] = _FORGED
        words.release()
        old.close()
        assert sender.applied_version(0) != _FORGED
    finally:
        _close(sender, receivers, pipes)


def _channel(pipe: Any) -> Any:
    from weightsync.transports.local.channel import Channel

    return Channel.from_pipe(pipe)


# ------------------------------------------------------ another process of the same user
def _run_trainer_as(uid: int, report_w: int, stop_r: int, opt_out: bool) -> None:
    """A trainer started normally by user ``uid`` (dumpable, as after a plain exec), with
    one version published; reports its pid and fds, then waits to be told to stop."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if opt_out:
        os.environ["WEIGHTSYNC_DUMPABLE"] = "1"
    _prctl(_PR_SET_DUMPABLE, 1)  # a setuid() made us non-dumpable; a real trainer is not
    transport = SharedMemTransport()
    transport.register_weights("policy", _weights(3.0))
    model = transport.publisher._models["policy"]
    fds = [model.control.fd] + [slot.segments["cpu"].fd for slot in model.slots]
    os.write(report_w, json.dumps({"pid": os.getpid(), "fds": fds,
                                   "dumpable": _prctl(_PR_GET_DUMPABLE)}).encode())
    select.select([stop_r], [], [], 30)


def _start_trainer(uid: int, opt_out: bool = False) -> tuple[int, int, dict[str, Any]]:
    report_r, report_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(report_r)
            os.close(stop_w)
            _run_trainer_as(uid, report_w, stop_r, opt_out)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(stop_r)
    try:
        ready, _, _ = select.select([report_r], [], [], 20)
        data = os.read(report_r, 65536) if ready else b""
    finally:
        os.close(report_r)
    if not data:
        _stop_trainer(pid, stop_w)
        raise AssertionError("the trainer child reported nothing")
    return pid, stop_w, json.loads(data)


def _stop_trainer(pid: int, stop_w: int) -> None:
    os.close(stop_w)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _steal_fds(pid: int, fds: list[int]) -> dict[str, Any]:
    """What a process of the trainer's user, without the token, gets of its fds."""
    import platform

    outcome: dict[str, Any] = {"proc": {}, "pidfd_getfd": {}}
    for fd in fds:
        try:
            os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY))
            outcome["proc"][fd] = "opened"
        except OSError as exc:
            outcome["proc"][fd] = type(exc).__name__
    number = _SYS_PIDFD_GETFD.get(platform.machine())
    if number is not None and hasattr(os, "pidfd_open"):
        libc = ctypes.CDLL(None, use_errno=True)
        pidfd = os.pidfd_open(pid)
        try:
            for fd in fds:
                got = libc.syscall(ctypes.c_long(number), ctypes.c_long(pidfd),
                                   ctypes.c_long(fd), ctypes.c_long(0))
                if got >= 0:
                    os.close(got)
                    outcome["pidfd_getfd"][fd] = "opened"
                else:
                    outcome["pidfd_getfd"][fd] = os.strerror(ctypes.get_errno())
        finally:
            os.close(pidfd)
    with open(f"/proc/{pid}/stat") as handle:  # liveness checks still read it
        outcome["stat"] = bool(handle.read())
    return outcome


@needs_root
@pytest.mark.multiuser
def test_another_process_of_the_same_user_cannot_open_the_trainers_fds() -> None:
    pid, stop_w, report = _start_trainer(NOBODY)
    try:
        assert report["dumpable"] == 0  # the sender made itself non-dumpable
        stolen = run_as_user(_steal_fds, pid, report["fds"], timeout=20)
    finally:
        _stop_trainer(pid, stop_w)
    assert set(stolen["proc"].values()) == {"PermissionError"}, stolen
    assert set(stolen["pidfd_getfd"].values()) <= {os.strerror(1)}, stolen
    assert stolen["stat"]


@needs_root
@pytest.mark.multiuser
def test_the_opt_out_keeps_the_trainer_dumpable() -> None:
    """``WEIGHTSYNC_DUMPABLE=1``: debugging works, and the fds are open to the user (the
    documented cost of the opt-out)."""
    pid, stop_w, report = _start_trainer(NOBODY, opt_out=True)
    try:
        assert report["dumpable"] == 1
        stolen = run_as_user(_steal_fds, pid, report["fds"], timeout=20)
    finally:
        _stop_trainer(pid, stop_w)
    assert set(stolen["proc"].values()) == {"opened"}


def _dumpable_after_a_send() -> int:
    _prctl(_PR_SET_DUMPABLE, 1)
    transport = SharedMemTransport()
    transport.send_weights("policy", _weights(1.0))
    try:
        return _prctl(_PR_GET_DUMPABLE)
    finally:
        transport.close()


def test_a_shared_memory_sender_makes_its_process_non_dumpable() -> None:
    assert run_in_child(_dumpable_after_a_send, timeout=20) == 0


# ------------------------------------------------------------------ Ray node-local path
def _raw_ticket_request(address: str, ticket: str) -> tuple[bytes, int]:
    """Ask the fd server for a ticket's fds in its own framing, with no check of who
    answers; (the answer's header, the number of fds passed)."""
    from weightsync.transports.local.address import connect_channel

    try:
        channel = connect_channel(address, 5)
    except OSError:
        return b"", 0
    try:
        channel.send({"ticket": ticket}, timeout=5)
        message = channel.recv(5)
    except OSError:  # closed unread: refused
        return b"", 0
    finally:
        channel.close()
    for fd in message.fds:
        os.close(fd)
    return json.dumps(message.header).encode(), len(message.fds)


def _request_ticket(address: str, pid: int, ticket: str) -> str:
    from weightsync.transports.ray.node_local import _request

    try:
        answer, fds = _request(address, pid, {"ticket": ticket}, 4)
    except OSError as exc:
        return type(exc).__name__
    for fd in fds:
        os.close(fd)
    return f"answer {answer}, {len(fds)} fds"


@needs_root
@pytest.mark.multiuser
def test_node_local_fds_need_a_one_time_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.transports.ray import node_local as ray_local

    monkeypatch.setattr(ray_local, "current_node_id", lambda: "this-node")
    local = ray_local.NodeLocalSender(max_slots=3)
    try:
        local.attach(0)
        local.publish(_weights(5.0), [0], 0, timeout=10)
        messages = local.messages_for(0)
        tickets = [m["ticket"] for m in messages if m.get("ticket")]
        assert tickets and all(m.get("fds") is None for m in messages)  # no fd numbers
        # another user reaches the socket, never a ticket's fds
        assert run_as_user(_raw_ticket_request, local.info.address, tickets[0],
                           timeout=20) == (b"", 0)
        # the actor it was meant for redeems it once; a made-up ticket gets nothing
        assert ray_local.probe_node_local(local.info)
        receiver = ray_local.NodeLocalReceiver(0, local.info)
        try:
            receiver.take_messages(messages)
            dest = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
            assert receiver.apply(dest, -1, Deadline(5.0)) == 0
            assert float(dest["w"][0, 0]) == 5.0
            with pytest.raises(PermissionError):
                receiver.take_messages(messages[:1])  # redeemed already
            again = _request_ticket(local.info.address, local.info.pid, "00" * 16)
            assert again == "answer {'ok': False}, 0 fds"
        finally:
            receiver.close()
    finally:
        local.close()
