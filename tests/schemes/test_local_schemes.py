"""The contract's promises for every scheme whose ends can run on one host (conftest's
``SCHEMES``: SharedMem, MultiProcess, the network scheme on loopback, the directory), with real
processes, real shared memory and real sockets. Every wait has a timeout."""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import signal
import threading
import time

import pytest
import torch
from workers import (
    checksum,
    drain,
    echo_worker,
    fill_all,
    hammer_worker,
    lag_when,
    make_model,
    mismatched_worker,
    scribble_worker,
    trainer_process,
)

import weightsync as ws


def start(workers, scheme, n, target=echo_worker, *args, method=None):
    for i in range(n):
        workers.start(target, scheme, i, *args, method=method)


def connected_sender(scheme, model):
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    return sender


def connected(workers, n):
    return sorted(drain(workers.out, n), key=lambda m: m[1])


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_connect_and_send_with_every_start_method(scheme_cls, workers, method):
    scheme = scheme_cls(num_workers=2, timeout=30)
    scheme = pickle.loads(pickle.dumps(scheme))  # schemes are plain, picklable data
    start(workers, scheme, 2, method=method)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        assert sender.connect(timeout=60) == 0
        assert [m[2] for m in connected(workers, 2)] == [0, 0]
        fill_all(model, 3.0)
        assert sender.send(timeout=30) == 1
        got = drain(workers.out, 2)
        assert {(m[0], m[2], m[3]) for m in got} == {("version", 1, checksum(model))}
        assert lag_when(sender, {0: 0, 1: 0}) == {0: 0, 1: 0}
        assert sender.stats()["worker_lag"] == {0: 0, 1: 0}


def test_snapshot_optimizer_writes_after_send_do_not_reach_workers(scheme_cls, workers):
    scheme = scheme_cls(num_workers=1, timeout=30)
    start(workers, scheme, 1)
    model = make_model()
    sender = connected_sender(scheme, model)
    drain(workers.out, 1)
    fill_all(model, 1.0)
    sender.send_async()
    fill_all(model, 99.0)  # the optimizer steps while the send is in flight
    assert sender.wait_async(timeout=30) == 1
    (_, _, version, total), = drain(workers.out, 1)
    expected = checksum(make_model()) * 0 + sum(t.numel() for t in model.state_dict().values())
    assert (version, total) == (1, float(expected))
    sender.close()


def test_send_explicit_weights_does_not_touch_the_trainer_model(scheme_cls, workers):
    scheme = scheme_cls(num_workers=1, timeout=30)
    start(workers, scheme, 1)
    model = make_model()
    before = checksum(model)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    drain(workers.out, 1)
    other = {k: torch.full_like(v, 2.0) for k, v in model.state_dict().items()}
    assert sender.send(weights=other, timeout=30) == 1
    (_, _, version, total), = drain(workers.out, 1)
    assert version == 1 and total == checksum_of(other)
    assert checksum(model) == before
    sender.close()


def checksum_of(weights):
    return float(sum(t.double().sum() for t in weights.values()))


def test_worker_writing_its_own_copy_changes_nothing_elsewhere(scheme_cls, workers):
    scheme = scheme_cls(num_workers=2, timeout=30)
    workers.start(scribble_worker, scheme, 0)
    workers.start(echo_worker, scheme, 1)
    model = make_model()
    before = checksum(model)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    if getattr(scheme, "zero_copy", False):
        # zero-copy weights are read-only views: the stray write is a crash of the writer,
        # never a change seen by anyone else
        msgs = {m[0]: m for m in drain(workers.out, 1)}
        workers.procs[0].join(20)
        assert workers.procs[0].exitcode == -signal.SIGSEGV
    else:
        msgs = {m[0]: m for m in drain(workers.out, 2)}
        assert msgs["scribbled"][3] != before
    assert msgs["connected"][3] == before  # worker 1 still holds the trainer's values
    assert checksum(model) == before
    # a later send still carries the trainer's weights, not worker 0's scribbles
    sender.send(worker_ids=[1], timeout=30)
    (_, _, v, total), = drain(workers.out, 1)
    assert (v, total) == (1, before)
    sender.close()


def test_isolation_worker_ids(scheme_cls, workers):
    scheme = scheme_cls(num_workers=2, timeout=30)
    start(workers, scheme, 2)
    model = make_model()
    sender = connected_sender(scheme, model)
    base = connected(workers, 2)[1][3]
    fill_all(model, 5.0)
    assert sender.send(worker_ids=[0], timeout=30) == 1
    (_, idx, v, total), = drain(workers.out, 1)
    assert (idx, v, total) == (0, 1, checksum(model))
    time.sleep(0.3)
    assert workers.out.empty(), "worker 1 must not receive a version it was not sent"
    assert lag_when(sender, {0: 0, 1: 1}) == {0: 0, 1: 1}
    assert sender.stats()["worker_lag"] == {0: 0, 1: 1}
    fill_all(model, 6.0)
    assert sender.send(worker_ids=1, timeout=30) == 2
    (_, idx, v, total), = drain(workers.out, 1)
    assert (idx, v) == (1, 2) and total != base
    sender.close()


@pytest.mark.slow
def test_tear_free_hammer(scheme_cls, workers):
    scheme = scheme_cls(num_workers=2, timeout=30)
    start(workers, scheme, 2, hammer_worker, 64)
    model = make_model(64)
    fill_all(model, 0.0)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    for version in range(1, 301):
        fill_all(model, float(version))
        assert sender.send(timeout=30) == version
    time.sleep(0.2)
    workers.stop.set()
    results = drain(workers.out, 2)
    for _, idx, reads, violations, applied, first_bad, final in results:
        assert violations == 0, f"worker {idx}: torn read {first_bad} ({violations}/{reads})"
        assert reads >= 1000, f"worker {idx} made only {reads} reads"
        assert applied >= 1 and final == 300
    sender.close()


def test_killed_worker_raises_then_others_continue_and_restart_rejoins(scheme_cls, workers):
    scheme = scheme_cls(num_workers=2, timeout=10)
    start(workers, scheme, 2)
    model = make_model()
    sender = connected_sender(scheme, model)
    connected(workers, 2)
    workers.kill(1)
    fill_all(model, 2.0)
    t0 = time.monotonic()
    with pytest.raises(ws.WorkerLostError) as info:
        sender.send(timeout=10)
    assert info.value.worker_ids == (1,) and "worker 1" in str(info.value)
    assert time.monotonic() - t0 < 10
    (_, idx, v, _), = drain(workers.out, 1)
    assert (idx, v) == (0, 1)  # the survivor got it
    fill_all(model, 3.0)
    assert sender.send(timeout=10) == 2  # the lost worker was reported once
    assert drain(workers.out, 1)[0][1:3] == (0, 2)
    # restart worker 1 while the trainer makes no call at all
    workers.start(echo_worker, scheme, 1, method="spawn")
    (event, idx, v, total), = drain(workers.out, 1, timeout=60)
    assert (event, idx, v, total) == ("connected", 1, 2, checksum(model))
    fill_all(model, 4.0)
    assert sender.send(timeout=10) == 3
    assert sorted(m[1:3] for m in drain(workers.out, 2)) == [(0, 3), (1, 3)]
    sender.close()


@pytest.mark.slow
def test_worker_killed_during_send(scheme_cls, workers):
    scheme = scheme_cls(num_workers=2, timeout=10)
    start(workers, scheme, 2, echo_worker, 2048)
    model = make_model(2048)  # ~4 MB per version, so sends take a while
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    connected(workers, 2)
    killer = threading.Timer(0.05, workers.kill, args=(1,))
    killer.start()
    lost_at = None
    give_up = time.monotonic() + 10  # sends until the kill lands, however fast they are
    for version in itertools.count(1):
        if time.monotonic() > give_up:
            break
        try:
            sender.send(timeout=10)
        except ws.WorkerLostError as exc:
            lost_at = version
            assert exc.worker_ids == (1,)
            break
    killer.join(10)
    assert lost_at is not None
    assert sender.send(timeout=10) == lost_at + 1
    sender.close()


def test_receiver_whose_trainer_died_gets_an_error_not_a_hang(scheme_cls, workers):
    import multiprocessing as mp

    scheme = scheme_cls(num_workers=1, timeout=30)
    if isinstance(scheme, ws.VLLMDoubleBufferSyncScheme):
        pytest.skip("the directory's send returns once each worker applied the version (its "
                    "ack); this trainer sends while the worker does not poll (the directory's "
                    "own trainer-death tests: tests/faults/test_directory_faults.py)")
    ctx = mp.get_context("fork")
    trainer = ctx.Process(target=trainer_process, args=(scheme, workers.out.new(), 2), daemon=True)
    trainer.start()
    try:
        receiver = scheme.create_receiver(0)
        model = make_model()
        receiver.register_model(model)
        # the trainer may already have moved on: connect applies the newest version
        assert receiver.connect(timeout=30) in (0, 1, 2)
        assert drain(workers.out, 1)[0] == ("trainer-ready", 2)
        assert receiver.receive(timeout=5) == 2 or receiver.version == 2
        trainer.kill()
        trainer.join(10)
        t0 = time.monotonic()
        with pytest.raises(ws.WeightSyncError, match="sender"):
            while time.monotonic() - t0 < 5:
                receiver.receive(timeout=1)
        with pytest.raises(ws.WeightSyncError):
            receiver.poll()
        assert time.monotonic() - t0 < 5
        receiver.close()
    finally:
        trainer.kill()
        trainer.join(10)


def test_schema_mismatch_on_send_changes_nothing(scheme_cls, workers):
    scheme = scheme_cls(num_workers=2, timeout=30)
    start(workers, scheme, 2)
    model = make_model()
    sender = connected_sender(scheme, model)
    before = connected(workers, 2)
    good = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    cases = {
        "0.weight": torch.zeros(3, 3),
        "0.bias": torch.zeros(16, dtype=torch.float64),
    }
    for key, bad_tensor in cases.items():
        bad = dict(good, **{key: bad_tensor})
        with pytest.raises(ws.SchemaMismatchError) as info:
            sender.send(weights=bad, timeout=10)
        assert info.value.key == key and key in str(info.value)
        assert info.value.expected is not None and info.value.got is not None
    missing = dict(good)
    missing.pop("3.bias")
    with pytest.raises(ws.SchemaMismatchError, match="'3.bias'"):
        sender.send(weights=missing)
    with pytest.raises(ws.SchemaMismatchError, match="'extra'"):
        sender.send(weights=dict(good, extra=torch.zeros(1)))
    assert sender.version == 0
    time.sleep(0.2)
    assert workers.out.empty()
    assert sender.send(timeout=10) == 1  # nothing was bumped by the failures
    assert {m[3] for m in drain(workers.out, 2)} == {before[0][3]}
    sender.close()


def test_bad_input_is_refused_without_a_version_bump(scheme_cls, workers):
    scheme = scheme_cls(num_workers=1, timeout=30)
    start(workers, scheme, 1)
    sender = scheme.create_sender()
    with pytest.raises(TypeError, match="nn.Module"):
        sender.register_model(42)
    with pytest.raises(RuntimeError, match="register_model"):
        sender.connect(timeout=1)
    sender.register_model(make_model())
    sender.connect(timeout=30)
    with pytest.raises(ValueError, match="worker_ids"):
        sender.send(worker_ids=[5])
    with pytest.raises(TypeError):
        sender.send(weights=[1, 2, 3])
    with pytest.raises(RuntimeError, match="pending"):
        sender.wait_async()
    sender.send_async()
    with pytest.raises(RuntimeError, match="pending"):
        sender.send_async()
    assert sender.wait_async(timeout=30) == 1
    assert sender.version == 1
    if not isinstance(scheme, ws.VLLMDoubleBufferSyncScheme):  # any process that sees the
        with pytest.raises(ValueError):                         # directory may read it; only
            scheme.create_receiver(worker_idx=3)                # num_workers are waited for
    sender.close()


def test_mismatched_receiver_fails_at_connect(scheme_cls, workers):
    scheme = scheme_cls(num_workers=1, timeout=30)
    workers.start(mismatched_worker, scheme, 0)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    with pytest.raises(ws.SchemaMismatchError, match="worker 0") as info:
        sender.connect(timeout=30)
    (event, _idx, key, message), = drain(workers.out, 1)
    assert event == "mismatch" and key is not None and key in message
    assert repr(key) in str(info.value)  # the trainer is told which key, and both shapes
    sender.close()


def test_connect_timeout_names_missing_workers(scheme_cls):
    scheme = scheme_cls(num_workers=2, timeout=30)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    t0 = time.monotonic()
    with pytest.raises(ws.WeightSyncTimeoutError) as info:
        sender.connect(timeout=0.5)
    assert info.value.worker_ids == (0, 1) and time.monotonic() - t0 < 3
    assert isinstance(info.value, TimeoutError)
    sender.close()


def test_a_scheme_timeout_of_zero_waits_only_where_a_call_says(scheme_cls, workers):
    """``timeout=0`` (the contract's "do not wait") as a scheme's default: a call without
    its own ``timeout=`` makes one attempt, a call with one waits that long, and the
    exchanges under way between the processes (a version half streamed, the workers' own
    waits) keep a peer's usual time to answer."""
    scheme = scheme_cls(num_workers=2, timeout=0)
    assert scheme.timeout == 0.0
    model = make_model(width=512)  # a version that takes more than one read to stream
    with scheme.create_sender() as sender:
        sender.register_model(model)
        started = time.monotonic()
        with pytest.raises(ws.WeightSyncTimeoutError):
            sender.connect()  # nobody is there, and it does not wait for them
        assert time.monotonic() - started < 2
        start(workers, scheme, 2, echo_worker, 512)
        assert sender.connect(timeout=60) == 0
        assert [m[2] for m in connected(workers, 2)] == [0, 0]
        for version in (1, 2, 3):
            fill_all(model, float(version))
            assert sender.send(timeout=30) == version
            got = drain(workers.out, 2)
            assert {(m[0], m[2], m[3]) for m in got} == {("version", version, checksum(model))}


def _shm_entries():
    # multiprocessing's own named semaphores (the harness's queues, here or in another test
    # run on the machine) and other tests' temporary directories are not ours: weightsync
    # creates no named segment at all, so any other new file is a leak
    return {entry.name for entry in os.scandir("/dev/shm")
            if not entry.name.startswith("sem.mp-") and not entry.is_dir(follow_symlinks=False)}


@pytest.mark.slow
def test_fifty_cycles_leave_nothing_behind(scheme_cls, workers):
    import multiprocessing as mp

    shm_before = _shm_entries()
    threads_before = threading.active_count()
    children_before = set(mp.active_children())  # e.g. a session-wide vLLM engine
    for cycle in range(50):
        scheme = scheme_cls(num_workers=2, timeout=10)
        start(workers, scheme, 2)
        with scheme.create_sender() as sender:
            sender.register_model(make_model())
            sender.connect(timeout=30)
            connected(workers, 2)
            if cycle % 10 == 0:
                workers.kill(1)
                with pytest.raises(ws.WorkerLostError):
                    sender.send(timeout=10)
            else:
                sender.send(timeout=10)
                drain(workers.out, 2)
        workers.stop.set()
        for proc in workers.procs.values():
            deadline = time.monotonic() + 10
            while proc.is_alive() and time.monotonic() < deadline:
                while not workers.out.empty():  # a child cannot exit with unflushed queue data
                    workers.out.get(timeout=1)
                proc.join(0.05)
            assert not proc.is_alive(), (cycle, proc.pid)
        while not workers.out.empty():
            workers.out.get(timeout=1)
        workers.out.close()
        workers.out.queues.clear()
        workers.stop.clear()
        workers.procs.clear()
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before, threading.enumerate()
    assert set(mp.active_children()) - children_before == set()
    assert _shm_entries() - shm_before == set()
