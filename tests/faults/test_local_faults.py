"""Faults on the same-host schemes, with real processes: goodbyes, stopped and frozen
workers, forks, models changed under the receiver, close racing an apply, dropped
senders, and inputs outside the contract. Every wait has a timeout."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from stopped import stop_process
from workers import checksum, close_during_connect, drain, echo_worker, fill_all, make_model

import weightsync as ws
from weightsync.transports.local.address import AddressInUseError

LOCAL = {
    "shm": ws.SharedMemWeightSyncScheme,
    "mp": ws.MultiProcessWeightSyncScheme,
}


@pytest.fixture(params=sorted(LOCAL))
def local_scheme(request: pytest.FixtureRequest) -> Any:
    return LOCAL[request.param]


def _get(out: Any, timeout: float = 30) -> Any:
    return out.get(timeout=timeout)


def _sender_with_worker(scheme: Any, workers: Any, target: Any = echo_worker) -> Any:
    """A connected sender (of ``make_model()``) whose worker 0 runs ``target`` and has
    reported its first event."""
    workers.start(target, scheme, 0)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.connect(timeout=30)
    event = _get(workers.out)
    assert event[0] in ("connected", "forked"), event
    return sender


# ---------------------------------------------------------------- goodbyes
def goodbye_worker(scheme: Any, idx: int, out: Any, stop: Any, last: int) -> None:
    model = make_model()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    receiver.connect(timeout=30)
    while receiver.version < last:
        receiver.receive(timeout=30)
    receiver.close()
    out.put(("bye", idx, last))


def test_a_worker_that_takes_the_last_version_and_closes_is_not_lost(local_scheme, workers, caplog):
    scheme = local_scheme(num_workers=2, timeout=30)
    for i in range(2):
        workers.start(goodbye_worker, scheme, i, 3)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.connect(timeout=30)
    with caplog.at_level(logging.DEBUG, logger="weightsync"):
        for _ in range(3):
            sender.send(timeout=30)
        assert sorted(_get(workers.out)[1] for _ in range(2)) == [0, 1]
        time.sleep(0.5)  # let the hub see both hang-ups
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "lost" in r.message]
    assert any("left" in r.message for r in caplog.records)
    sender.close()


# ---------------------------------------------------------------- deadlines
def test_send_to_a_stopped_worker_ends_within_its_one_deadline(workers):
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=2, timeout=30)
    for i in range(2):
        workers.start(echo_worker, scheme, i, 512)
    sender = scheme.create_sender()
    sender.register_model(make_model(width=512))
    sender.connect(timeout=30)
    stop_process(workers.procs[1].pid)
    try:
        t0 = time.monotonic()
        with pytest.raises((ws.WeightSyncTimeoutError, ws.WorkerLostError)) as info:
            for _ in range(50):  # until the stopped worker's socket buffer is full
                sender.send(timeout=2)
        assert time.monotonic() - t0 < 2 * 50
        assert info.value.worker_ids == (1,), "only the stopped worker may be blamed"
        t0 = time.monotonic()
        with pytest.raises(ws.WeightSyncError):
            sender.send(timeout=2)
        assert time.monotonic() - t0 < 3.0, "send(timeout=2) must end within about 2 s"
    finally:
        os.kill(workers.procs[1].pid, signal.SIGCONT)
    sender.close()


def test_a_frozen_shared_memory_worker_never_slows_sends(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=2, timeout=30)
    for i in range(2):
        workers.start(echo_worker, scheme, i)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.connect(timeout=30)
    time.sleep(0.3)  # both are blocked in receive() now
    stop_process(workers.procs[1].pid)
    try:
        t0 = time.monotonic()
        slowest = 0.0
        for _ in range(15000):  # far more notices than a socket buffer holds
            s0 = time.monotonic()
            sender.send(timeout=5)
            slowest = max(slowest, time.monotonic() - s0)
        assert slowest < 2.5, f"a send waited {slowest:.2f}s (of its 5 s) on the frozen worker"
        assert time.monotonic() - t0 < 60
    finally:
        os.kill(workers.procs[1].pid, signal.SIGCONT)
    sender.close()


# ---------------------------------------------------------------- the model changed
def reassigned_worker(scheme: Any, idx: int, out: Any, stop: Any, how: str) -> None:
    model = make_model()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    if how == "assign":
        fresh = {k: torch.full_like(v, -7.0) for k, v in model.state_dict().items()}
        model.load_state_dict(fresh, assign=True)
    else:
        model[3] = torch.nn.Linear(16, 4)
    receiver.connect(timeout=30)
    out.put(("held", idx, receiver.version, checksum(model)))
    receiver.close()


@pytest.mark.parametrize("how", ["assign", "replaced-submodule"])
def test_a_model_changed_after_register_model_receives_the_weights(local_scheme, workers, how):
    scheme = local_scheme(num_workers=1, timeout=30)
    workers.start(reassigned_worker, scheme, 0, how)
    model = make_model()
    fill_all(model, 3.0)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    _, _, version, total = _get(workers.out)
    assert (version, total) == (0, checksum(model))
    sender.close()


def changed_after_connect_worker(scheme: Any, idx: int, out: Any, stop: Any, how: str,
                                 zero_copy: bool) -> None:
    model = make_model()
    receiver = (scheme.create_receiver(idx, zero_copy=True) if zero_copy
                else scheme.create_receiver(worker_idx=idx))
    receiver.register_model(model)
    receiver.connect(timeout=30)  # the model's tensors are found (and kept) here
    if how == "assign":
        fresh = {k: torch.full_like(v, -7.0) for k, v in model.state_dict().items()}
        model.load_state_dict(fresh, assign=True)
    elif how == "replaced-submodule":
        model[3] = torch.nn.Linear(16, 4)
    else:  # new buffer objects, put in place by torch with no registration hook
        model.double().float()
    out.put(("changed", idx))
    version = receiver.receive(timeout=30)
    out.put(("held", idx, version, checksum(model)))
    receiver.close()


@pytest.mark.parametrize("how", ["assign", "replaced-submodule", "dtype-round-trip"])
@pytest.mark.parametrize("kind", ["shm", "shm-zero-copy", "mp"])
def test_a_model_changed_after_connect_receives_the_next_version(workers, how, kind):
    scheme = LOCAL[kind.removesuffix("-zero-copy")](num_workers=1, timeout=30)
    workers.start(changed_after_connect_worker, scheme, 0, how, kind.endswith("zero-copy"))
    model = make_model()
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    assert _get(workers.out) == ("changed", 0)
    fill_all(model, 5.0)
    assert sender.send(timeout=30) == 1
    _, _, version, total = _get(workers.out)
    assert (version, total) == (1, checksum(model))
    sender.close()


# ---------------------------------------------------------------- fork
def forking_trainer(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    """Connect, fork a helper that outlives us, then die without closing anything."""
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.connect(timeout=30)
    if os.fork() == 0:
        time.sleep(20)
        os._exit(0)
    out.put(("forked", idx, sender.version))
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def test_receivers_learn_of_a_dead_trainer_whose_fork_keeps_its_sockets(local_scheme, workers):
    scheme = local_scheme(num_workers=1, timeout=30)
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(make_model())
    workers.start(forking_trainer, scheme, 99)
    receiver.connect(timeout=30)
    assert _get(workers.out)[0] == "forked"
    t0 = time.monotonic()
    with pytest.raises(ws.SenderLostError, match="died"):
        while time.monotonic() - t0 < 10:
            receiver.receive(timeout=0.2)
    receiver.close()


def test_a_forked_child_closing_its_copy_disconnects_nobody(local_scheme, workers):
    scheme = local_scheme(num_workers=1, timeout=30)
    sender = _sender_with_worker(scheme, workers)
    pid = os.fork()
    if pid == 0:
        sender.close()
        del sender
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    assert sender.send(timeout=10) == 1
    assert _get(workers.out)[:3] == ("version", 0, 1)
    sender.close()


def forking_worker(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(make_model())
    receiver.connect(timeout=30)
    if os.fork() == 0:
        time.sleep(20)
        os._exit(0)
    out.put(("forked", idx, receiver.version))
    time.sleep(300)


def test_a_dead_worker_whose_fork_keeps_its_socket_can_restart(local_scheme, workers):
    scheme = local_scheme(num_workers=1, timeout=30)
    sender = _sender_with_worker(scheme, workers, forking_worker)
    workers.kill(0)
    workers.start(echo_worker, scheme, 0)
    event = _get(workers.out, 20)
    assert event[:2] == ("connected", 0), event
    sender.close()


# ---------------------------------------------------------------- close racing an apply
def close_during_poll_worker(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    model = {"w": torch.zeros(50_000_000)}  # 200 MB: an apply takes a while
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    receiver.connect(timeout=60)
    while receiver.version < 1:
        time.sleep(0.01)
        if receiver.newer_published():
            break
    closer = threading.Timer(0.005, receiver.close)
    closer.start()
    try:
        receiver.poll()
        outcome = "applied"
    except RuntimeError as exc:
        outcome = f"refused: {exc}"
    closer.join(10)
    out.put(("survived", idx, outcome, float(model["w"][-1])))


def test_close_from_another_thread_during_a_large_poll_is_safe(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=60)
    workers.start(close_during_poll_worker, scheme, 0)
    weights = {"w": torch.zeros(50_000_000)}
    sender = scheme.create_sender()
    sender.register_model(weights)
    sender.connect(timeout=60)
    weights["w"].fill_(1.0)
    sender.send(timeout=60)
    event = _get(workers.out, 60)
    assert event[0] == "survived" and workers.procs[0].exitcode in (None, 0)
    assert event[3] in (0.0, 1.0)  # one whole version, whatever won the race
    sender.close()


# ---------------------------------------------------------------- dropped senders
def test_a_dropped_sender_is_collected_and_its_workers_told(local_scheme, workers):
    scheme = local_scheme(num_workers=1, timeout=30)
    sender = _sender_with_worker(scheme, workers)
    del sender
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("weightsync-hub") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the dropped sender's hub thread is still running"
        time.sleep(0.05)
    event = _get(workers.out, 10)
    assert event[0] == "error" and event[2] == "SenderLostError"


# ---------------------------------------------------------------- outside the contract
def test_inputs_outside_the_contract_get_clear_errors(local_scheme):
    scheme = local_scheme(num_workers=1, timeout=5)
    sender = scheme.create_sender()
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        sender.register_model(torch.nn.Linear(4, 4, device="meta"))
    with pytest.raises(TypeError, match="sparse"):
        sender.register_model({"w": torch.eye(3).to_sparse()})
    receiver = scheme.create_receiver(worker_idx=0)
    with pytest.raises(ValueError, match="meta device"):
        receiver.register_model(torch.nn.Linear(4, 4, device="meta"))
    sender.close()


def test_a_second_open_sender_of_a_scheme_gets_a_clear_error(local_scheme):
    scheme = local_scheme(num_workers=1, timeout=5)
    first = scheme.create_sender()
    with pytest.raises(AddressInUseError, match="close it first"):
        scheme.create_sender()
    first.close()
    scheme.create_sender().close()  # once the first is closed, a new one works


def test_poll_racing_close_raises_only_a_clear_error(local_scheme, workers):
    scheme = local_scheme(num_workers=1, timeout=30)
    sender_proc = workers.start(_trainer_sending, scheme, 99)
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(make_model())
    receiver.connect(timeout=30)
    errors: list[BaseException] = []

    def poll_forever() -> None:
        try:
            while True:
                receiver.poll()
        except RuntimeError as exc:
            errors.append(exc)
        except BaseException as exc:  # anything else is a bug
            errors.append(exc)

    thread = threading.Thread(target=poll_forever)
    thread.start()
    time.sleep(0.3)
    receiver.close()
    thread.join(10)
    assert len(errors) == 1 and type(errors[0]) is RuntimeError, errors
    assert "closed" in str(errors[0])
    sender_proc.kill()


def _trainer_sending(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    model = make_model()
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    while not stop.is_set():
        fill_all(model, float(sender.version + 1))
        with contextlib.suppress(ws.WeightSyncError):
            sender.send(timeout=5)
        time.sleep(0.001)
    sender.close()


def test_close_during_a_send_is_not_blamed_on_healthy_workers(workers):
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(echo_worker, scheme, 0, 2_000_000)
    sender = scheme.create_sender()
    sender.register_model(make_model(width=2_000_000))
    sender.connect(timeout=30)
    sender.send_async()
    sender.close()
    with pytest.raises(ws.WeightSyncError) as info:
        sender.wait_async(timeout=10)
    assert not isinstance(info.value, ws.WorkerLostError), info.value


def test_poll_never_blocks_on_a_slot_whose_handle_has_not_arrived():
    """A worker pointed at a slot whose descriptor is still in flight: ``poll`` (which
    applies with a zero deadline) returns None at once instead of waiting for it."""
    from weightsync.core.deadline import Deadline
    from weightsync.core.layout import Layout
    from weightsync.transports.shm import slots as shm_slots
    from weightsync.transports.shm import worker_slots
    from weightsync.transports.shm.reader import SlotReader

    layout = Layout.from_weights({"w": torch.zeros(4)})
    sender_side = shm_slots._SenderModel(layout, max_slots=4)
    reader = SlotReader()
    ack = sender_side.acks[0] = shm_slots._Ack()
    reader._models["policy"] = worker_slots._ReceiverModel(
        layout, os.dup(sender_side.control.fd), os.dup(ack.segment.fd))
    sender_side.set_target(0, shm_slots._pack_target(3, 2))  # version 3 in slot 2: never announced
    t0 = time.monotonic()
    assert reader.apply_latest(0, {"w": torch.zeros(4)}, 0, Deadline(0)) is None
    assert reader.adopt_latest(0, {"w": torch.zeros(4)}, 0, Deadline(0)) is None
    assert time.monotonic() - t0 < 0.5
    reader.close()
    sender_side.close()


# ---------------------------------------------------------------- close during connect
def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "(closed meanwhile)"


@pytest.mark.parametrize("trainer", ["absent", "created", "started"])
def test_close_from_another_thread_ends_a_waiting_connect(local_scheme, trainer):
    """A worker waiting in ``connect(timeout=30)`` for its trainer (none yet; one created
    whose hub does not answer yet; one whose hub admitted the worker but sent nothing) is
    closed from another thread: connect() raises the closed error at once, and nothing it
    opened (socket, reader thread, mapped file) stays behind."""
    from weightsync.core.deadline import Deadline

    scheme = local_scheme(num_workers=1, timeout=30)
    sender = None
    if trainer != "absent":
        sender = scheme.create_sender()  # binds the address; its hub starts at connect()
        sender.register_model(make_model())
        if trainer == "started":
            sender.writer.start(Deadline(5))  # the hub answers, but nothing is published
    before = _open_fds()
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(make_model())
    error = close_during_connect(receiver)
    assert error.__cause__ is not None  # what the transport was waiting on when cut
    # the trainer's hub (in this process) closes its end once it sees the goodbye: within
    # 0.2 s on an idle machine, later on a loaded one

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("weightsync-reader")]

    # one look decides (a descriptor another thread opens for a moment between two looks
    # is not one the receiver left); a leak stays for the whole 5 s
    deadline = time.monotonic() + 5.0
    while True:
        left = {fd: _fd_target(fd) for fd in _open_fds() - before}
        if not (readers() or left) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not readers()
    assert not left, f"the closed receiver left file descriptors open: {left}"
    if sender is not None:
        sender.close()


def test_close_from_a_signal_handler_ends_a_waiting_connect(local_scheme):
    """The handler runs in the very thread that waits in connect(): close() cuts the wait
    and connect() releases the receiver as it returns (no deadlock on its own locks)."""
    from weightsync.core.deadline import Deadline

    scheme = local_scheme(num_workers=1, timeout=30)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.writer.start(Deadline(5))
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(make_model())
    previous = signal.signal(signal.SIGALRM, lambda *_: receiver.close())
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(RuntimeError, match="this receiver is closed"):
            receiver.connect(timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 3.0
    assert not [t for t in threading.enumerate() if t.name.startswith("weightsync-reader")]
    with pytest.raises(RuntimeError, match="this receiver is closed"):
        receiver.poll()
    sender.close()


# ---------------------------------------------------------------- apply and close at once
def apply_and_close_worker(scheme: Any, idx: int, out: Any, stop: Any, zero_copy: bool) -> None:
    """Connect, wait until the trainer is inside its delivery, apply version 1, close."""
    receiver = scheme.create_receiver(worker_idx=idx, zero_copy=zero_copy)
    receiver.register_model(make_model())
    receiver.connect(timeout=30)
    out.put(("connected", idx, receiver.version))
    time.sleep(0.3)  # the trainer has read our (old) version by now
    t0 = time.monotonic()
    while receiver.poll() is None and time.monotonic() - t0 < 10:
        time.sleep(0.001)
    out.put(("applied", idx, receiver.version))
    receiver.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_shm_worker_that_applies_and_closes_during_delivery_is_not_lost(workers, monkeypatch,
                                                                          zero_copy):
    """The trainer reads the versions the targets hold, then looks for dead ones: a worker
    that applies the version and says goodbye in between got it (no WorkerLostError)."""
    from weightsync.transports.local import members as local_members

    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(apply_and_close_worker, scheme, 0, zero_copy)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.connect(timeout=30)
    assert _get(workers.out)[0] == "connected"
    drop_dead = local_members.Members.drop_dead

    def drop_dead_once_it_left(self: Any, worker_ids: list[int]) -> None:
        workers.procs[0].join(10)  # the worker applied the version and closed meanwhile
        drop_dead(self, worker_ids)

    monkeypatch.setattr(local_members.Members, "drop_dead", drop_dead_once_it_left)
    assert sender.send(timeout=30) == 1
    assert _get(workers.out)[:3] == ("applied", 0, 1)
    sender.close()


def _starved_in_handshake_worker(scheme, idx, out, stop):
    """A worker that stalls inside its handshake (a loaded host) past the hub's limit."""
    import weightsync.transports.local.link as local_link

    real_read, calls = local_link.read_frame, []

    def slow_first_read(*args, **kwargs):
        if not calls:
            calls.append(1)
            time.sleep(1.5)
        return real_read(*args, **kwargs)

    local_link.read_frame = slow_first_read
    receiver = scheme.create_receiver(idx)
    receiver.register_model(make_model())
    try:
        out.put(("connected", idx, receiver.connect(timeout=30)))
    except ws.WeightSyncError as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
    stop.wait(30)
    receiver.close()


def test_a_worker_starved_in_its_handshake_joins_again_within_its_deadline(workers, monkeypatch):
    """The hub closes a handshake after its own limit; a live trainer must not read as a
    lost sender to a worker that was only slow, and the trainer's connect() succeeds."""
    import weightsync.transports.local.hub as local_hub

    monkeypatch.setattr(local_hub, "HANDSHAKE_TIMEOUT", 0.5)
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(_starved_in_handshake_worker, scheme, 0)
    with scheme.create_sender() as sender:
        sender.register_model(make_model())
        assert sender.connect(timeout=30) == 0
        assert drain(workers.out, 1) == [("connected", 0, 0)]


# ---------------------------------------------------------------- dropped and rejoining
def big_weights(mb: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mb << 18,), value)}


def dropped_worker(scheme: Any, idx: int, out: Any, stop: Any, mb: int, how: str) -> None:
    """Follow versions by ``how`` (receive, poll), reporting each one and every error;
    after a drop, ``how="connect"`` calls connect() again. Stops when the sender is lost
    (or the test says so)."""
    model = big_weights(mb, -1.0)
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    out.put(("connected", idx, receiver.connect(timeout=60), float(model["w"][0])))
    try:
        while not stop.is_set():
            try:
                if how == "poll":
                    version = receiver.poll()
                    time.sleep(0.01)
                else:
                    version = receiver.receive(timeout=0.2)
            except ws.SenderLostError as exc:
                out.put(("error", idx, type(exc).__name__, str(exc)))
                return
            except ws.WeightSyncError as exc:
                out.put(("error", idx, type(exc).__name__, str(exc)))
                if how == "connect" and isinstance(exc, ws.WorkerDroppedError):
                    version = receiver.connect(timeout=30)
                    out.put(("version", idx, version, float(model["w"][0])))
                continue
            if version is not None:
                out.put(("version", idx, version, float(model["w"][0])))
    finally:
        receiver.close()


@pytest.mark.parametrize("how", ["receive", "poll", "connect"])
def test_a_worker_stopped_mid_transfer_is_told_it_was_dropped_and_rejoins(workers, how):
    """A worker stopped (SIGSTOP) while a large version is on its way misses the send's
    deadline: the trainer drops it (WorkerLostError). Resumed, the worker is told that the
    live trainer dropped it (WorkerDroppedError, not that the trainer's pipe closed), and
    its next receive(), poll() or connect() joins again and takes the current version, then
    every later one."""
    mb = 128
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(dropped_worker, scheme, 0, mb, how)
    weights = big_weights(mb)
    sender = scheme.create_sender()
    sender.register_model(weights)
    try:
        assert sender.connect(timeout=60) == 0
        assert _get(workers.out)[:3] == ("connected", 0, 0)
        pid = workers.procs[0].pid
        weights["w"].fill_(1.0)
        stop_process(pid)  # stopped as version 1 goes out
        try:
            t0 = time.monotonic()
            # named lost, or (when the streamer had not started the transfer by the deadline,
            # on a loaded machine) a timeout naming it: either way the streamer drops it
            with pytest.raises((ws.WorkerLostError, ws.WeightSyncTimeoutError)) as info:
                sender.send(timeout=2)
            assert tuple(info.value.worker_ids) == (0,)
            assert time.monotonic() - t0 < 4.0
        finally:
            os.kill(pid, signal.SIGCONT)
        event = _get(workers.out, 15)
        assert event[0] == "error", event
        assert event[2] == "WorkerDroppedError", event
        assert "dropped this worker" in event[3] and "version 1" in event[3], event
        assert "pipe closed" not in event[3], event
        assert _get(workers.out, 15) == ("version", 0, 1, 1.0)  # rejoined: the current one
        weights["w"].fill_(2.0)
        assert sender.send(timeout=30) == 2
        assert _get(workers.out, 15) == ("version", 0, 2, 2.0)
    finally:
        sender.close()
