"""Lagging zero-copy SharedMem workers pin slots (the one they view and their target):
the default pool makes room for them, and an explicit cap that is too small is reported
naming the workers that pin the slots. Every wait has a timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest
from workers import make_model

import weightsync as ws


def lagging_zero_copy_worker(scheme: Any, idx: int, out: Any, stop: Any, last: int) -> None:
    """Zero-copy: poll until holding ``last``, then never again (a worker that lags)."""
    receiver = scheme.create_receiver(worker_idx=idx, zero_copy=True)
    receiver.register_model(make_model())
    receiver.connect(timeout=30)
    t0 = time.monotonic()
    while receiver.version < last and time.monotonic() - t0 < 20:
        receiver.poll()
        time.sleep(0.001)
    out.put(("holds", idx, receiver.version))
    stop.wait(30)
    receiver.close()


def _two_lagging_workers(workers: Any, max_slots: int | None) -> Any:
    """A sender whose zero-copy workers 0 and 1 view different slots and then lag, each
    pointed at a version it will never take: four slots pinned, one more is the newest."""
    scheme = ws.SharedMemWeightSyncScheme(num_workers=2, timeout=30, max_slots=max_slots)
    workers.start(lagging_zero_copy_worker, scheme, 0, 1)
    workers.start(lagging_zero_copy_worker, scheme, 1, 2)
    sender = scheme.create_sender()
    sender.register_model(make_model())
    sender.connect(timeout=30)
    assert sender.send(worker_ids=[0], timeout=10) == 1
    assert workers.out.get(timeout=30) == ("holds", 0, 1)
    assert sender.send(worker_ids=[1], timeout=10) == 2
    assert workers.out.get(timeout=30) == ("holds", 1, 2)
    assert sender.send(worker_ids=[0], timeout=10) == 3
    assert sender.send(worker_ids=[1], timeout=10) == 4
    return sender


def test_two_lagging_zero_copy_workers_never_exhaust_the_default_pool(workers):
    sender = _two_lagging_workers(workers, None)
    t0 = time.monotonic()
    for i in range(4):
        sender.send(timeout=2)
        sender.send(worker_ids=[i % 2], timeout=2)
    assert sender.version == 12
    assert time.monotonic() - t0 < 2.0, "a send waited for a lagging worker"
    sender.close()


def test_a_pool_capped_too_small_for_lagging_zero_copy_workers_names_them(workers):
    sender = _two_lagging_workers(workers, 4)
    t0 = time.monotonic()
    with pytest.raises(ws.WeightSyncTimeoutError) as info:
        sender.send(timeout=1)
    assert time.monotonic() - t0 < 3.0
    message = str(info.value)
    assert "worker 0" in message and "worker 1" in message, message
    assert "max_slots" in message, message
    sender.close()
