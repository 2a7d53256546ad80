"""A process forked from a zero-copy SharedMem worker holds weights that never change
under it: the slot's lock belongs to the parent (fcntl locks do not cross fork), so the
child's views become a private copy at the fork. Every wait has a timeout."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import weightsync as ws

_NUMEL = 2_000_000  # 8 MB: packed in pieces, a rewrite under a reader is seen torn


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(_NUMEL)}


def _watch(model: dict[str, torch.Tensor], seconds: float) -> tuple[int, int, int]:
    """(reads, reads that saw another value than the first, torn reads) over ``seconds``."""
    w = model["w"]
    first = float(w[0])
    reads = changed = torn = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = float(w[0])
        if not bool((w == value).all()):
            torn += 1
        if value != first:
            changed += 1
        reads += 1
    return reads, changed, torn


def forking_zero_copy_worker(scheme: Any, idx: int, out: Any, stop: Any, child_out: Any) -> None:
    """Connect zero-copy, fork a child that watches its weights for 3 s, keep polling."""
    model = _model()
    receiver = scheme.create_receiver(worker_idx=idx, zero_copy=True)
    receiver.register_model(model)
    receiver.connect(timeout=30)
    while receiver.version < 3:
        receiver.receive(timeout=10)
    pid = os.fork()
    if pid == 0:
        try:
            child_out.put(("child", *_watch(model, 3.0)))
            child_out.close()
            child_out.join_thread()
        finally:
            os._exit(0)
    out.put(("forked", idx, receiver.version))
    applied = 0
    end = time.monotonic() + 20
    while not stop.is_set() and time.monotonic() < end:
        if receiver.poll() is not None:
            applied += 1
        time.sleep(0.001)
    os.waitpid(pid, 0)
    out.put(("applied", idx, applied))
    receiver.close()


def test_a_forked_child_of_a_zero_copy_worker_holds_weights_that_never_change(workers):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    child_out = workers.out.new()
    workers.start(forking_zero_copy_worker, scheme, 0, child_out)
    model = _model()
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    t0 = time.monotonic()
    forked = None
    while time.monotonic() - t0 < 25:
        model["w"].fill_(float(sender.version + 1))
        sender.send(timeout=10)
        if forked is None and not workers.out.queues[1].empty():
            forked = workers.out.queues[1].get(timeout=5)
        if forked is not None and not child_out.empty():
            break
        time.sleep(0.002)
    assert forked is not None and forked[0] == "forked", forked
    _, reads, changed, torn = child_out.get(timeout=10)
    assert reads > 0
    assert (changed, torn) == (0, 0), f"the child's weights changed under it: {changed} " \
        f"reads saw a new value, {torn} were torn, of {reads}"
    workers.stop.set()
    sender.close()
