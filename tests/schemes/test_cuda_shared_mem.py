"""CUDA weights through SharedMem use CUDA IPC; needs a GPU (skipped without one)."""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch

import weightsync as ws

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_worker(scheme, out):
    model = torch.nn.Linear(256, 256).cuda()
    receiver = scheme.create_receiver(0)
    receiver.register_model(model)
    receiver.connect(timeout=60)
    out.put(float(model.weight.sum()))
    version = receiver.receive(timeout=30)
    out.put((version, float(model.weight.sum())))
    receiver.close()


def test_cuda_weights_over_cuda_ipc():
    ctx = mp.get_context("spawn")
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=60)
    out = ctx.Queue()
    proc = ctx.Process(target=cuda_worker, args=(scheme, out), daemon=True)
    proc.start()
    model = torch.nn.Linear(256, 256).cuda()
    try:
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=120)
            assert out.get(timeout=60) == pytest.approx(float(model.weight.sum()), rel=1e-5)
            with torch.no_grad():
                model.weight.fill_(0.5)
            assert sender.send(timeout=60) == 1
            assert out.get(timeout=60) == (1, pytest.approx(0.5 * 256 * 256))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def holding_worker(scheme, out):
    """Maps the CUDA slots, says so, then waits to be killed."""
    model = torch.nn.Linear(2048, 2048).cuda()
    receiver = scheme.create_receiver(0)
    receiver.register_model(model)
    receiver.connect(timeout=60)
    out.put("holding")
    import time

    time.sleep(600)


def test_a_killed_cuda_workers_slots_are_freed_at_close():
    """A worker SIGKILLed with the CUDA slots open leaves torch's consumer counts up; the
    sender takes them back when it detaches the worker, and close() frees the slots."""
    ctx = mp.get_context("spawn")
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=60)
    out = ctx.Queue()
    proc = ctx.Process(target=holding_worker, args=(scheme, out), daemon=True)
    proc.start()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = torch.nn.Linear(2048, 2048).cuda()
    try:
        sender = scheme.create_sender()
        sender.register_model(model)
        sender.connect(timeout=120)
        assert out.get(timeout=60) == "holding"
        proc.kill()
        proc.join(30)
        with pytest.raises(ws.WorkerLostError):
            sender.send(timeout=30)
        sender.close()
        del model, sender
        gc.collect()  # the WorkerLostError's traceback frames held the model's tensors
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= before, "the dead worker's slots stay pinned"
    finally:
        if proc.is_alive():
            proc.kill()
