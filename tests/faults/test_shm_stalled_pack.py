"""SharedMem copy mode with a trainer that stops in the middle of a pack: killed (the
workers get ``SenderLostError``) or frozen (``poll()`` stays quick and returns None).
Never a repeated apply of the version the worker already holds. Every wait has a timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import weightsync as ws
from weightsync.transports.shm.slots import _HEADER_WORDS, _PACKED_BASE, _unpack_target

#: 160 MB: a pack lasts long enough to stop the trainer in the middle of it
_NUMEL = 40_000_000


def _big_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(_NUMEL)}


def looping_trainer(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    """Connect, wait a moment, then send version ``v`` (every weight ``v``) in a loop."""
    torch.set_num_threads(1)
    model = _big_model()
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    time.sleep(0.3)
    while not stop.is_set():
        model["w"].fill_(float(sender.version + 1))
        sender.send(timeout=30)
    sender.close()


def _connected(scheme: Any, workers: Any) -> Any:
    """A copy-mode receiver (in this process) of a ``looping_trainer`` about to send."""
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(_big_model())
    workers.start(looping_trainer, scheme, 99)
    assert receiver.connect(timeout=30) == 0
    return receiver


def _signal_mid_pack(receiver: Any, pid: int, how: signal.Signals) -> None:
    """Send ``how`` to the trainer once a quarter of its next pack is done."""
    t0 = time.monotonic()
    while not receiver.newer_published():
        assert time.monotonic() - t0 < 20, "the trainer published nothing"
        time.sleep(0.0002)
    rmodel = receiver.reader.slots._models["policy"]
    _, slot = _unpack_target(rmodel.ctrl[_HEADER_WORDS + 0])
    while rmodel.ctrl[_PACKED_BASE + slot] < rmodel.plan.total // 4:
        assert time.monotonic() - t0 < 20, "the pack does not move"
        time.sleep(0.0002)
    os.kill(pid, how)
    time.sleep(0.05)  # a stopped process stops within this
    assert rmodel.ctrl[_PACKED_BASE + slot] < rmodel.plan.total, "the pack ended first"


def _stop_trainer_mid_pack(scheme: Any, workers: Any, how: signal.Signals) -> Any:
    """A connected copy-mode receiver whose trainer got ``how`` in the middle of a pack."""
    receiver = _connected(scheme, workers)
    _signal_mid_pack(receiver, workers.procs[99].pid, how)
    return receiver


def _assert_whole(receiver: Any, value: float) -> None:
    w = receiver.model["w"]
    assert bool((w == value).all()), f"torn or wrong weights: {w.min()}..{w.max()}, want {value}"


def test_a_trainer_killed_mid_pack_ends_in_sender_lost_never_a_reapply(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    receiver = _stop_trainer_mid_pack(scheme, workers, signal.SIGKILL)
    held = receiver.version
    t0 = time.monotonic()
    with pytest.raises(ws.SenderLostError):
        while time.monotonic() - t0 < 5:
            assert receiver.poll() is None, "poll() re-applied the version it holds"
            _assert_whole(receiver, float(held))
            assert receiver.receive(timeout=0.3) is None, "receive() re-applied the version"
            _assert_whole(receiver, float(held))
    assert receiver.version == held
    _assert_whole(receiver, float(held))
    receiver.close()


def test_a_trainer_killed_while_receive_follows_its_pack_is_lost_not_reapplied(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    receiver = _connected(scheme, workers)
    killer = threading.Thread(target=_signal_mid_pack,
                              args=(receiver, workers.procs[99].pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ws.SenderLostError):
            while time.monotonic() - t0 < 5:  # the first receive() follows the pack
                assert receiver.receive(timeout=0.3) is None, "receive() re-applied a version"
                _assert_whole(receiver, 0.0)
    finally:
        killer.join(30)
    assert receiver.version == 0
    _assert_whole(receiver, 0.0)
    receiver.close()


def test_poll_stays_quick_while_the_trainer_is_frozen_mid_pack(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    receiver = _stop_trainer_mid_pack(scheme, workers, signal.SIGSTOP)
    pid = workers.procs[99].pid
    try:
        held = receiver.version
        slowest = 0.0
        for _ in range(20):
            t0 = time.monotonic()
            assert receiver.poll() is None
            slowest = max(slowest, time.monotonic() - t0)
            _assert_whole(receiver, float(held))
        assert slowest < 0.1, f"a poll() blocked {slowest:.3f} s on the frozen trainer"
        assert receiver.receive(timeout=0.5) is None
        _assert_whole(receiver, float(held))
    finally:
        os.kill(pid, signal.SIGCONT)
    version = receiver.receive(timeout=20)
    assert version is not None and version > held
    _assert_whole(receiver, float(version))
    workers.stop.set()
    receiver.close()
