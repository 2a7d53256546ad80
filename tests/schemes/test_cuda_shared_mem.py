"""CUDA weights through SharedMem use CUDA IPC; needs a GPU (skipped without one)."""

from __future__ import annotations

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
