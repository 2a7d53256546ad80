"""CUDA weights over NetWeightSyncScheme: the trainer packs from the GPU and a worker
applies the staged version into its GPU model; needs a GPU (skipped without one)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

import weightsync as ws

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_net_worker(scheme: ws.NetWeightSyncScheme, out: Any) -> None:
    model = torch.nn.Linear(512, 512).cuda()
    with scheme.create_receiver(0) as receiver:
        receiver.register_model(model)
        receiver.connect(timeout=60)
        for _ in range(2):
            version = receiver.receive(timeout=60)
            torch.cuda.synchronize()
            out.put((version, model.weight.device.type, float(model.weight.double().sum()),
                     float(model.bias.double().sum())))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cuda_trainer_to_cuda_worker_over_net(dtype: torch.dtype | None) -> None:
    ctx = mp.get_context("spawn")
    scheme = ws.NetWeightSyncScheme(num_workers=1, dtype=dtype)
    out = ctx.Queue()
    proc = ctx.Process(target=cuda_net_worker, args=(scheme, out), daemon=True)
    proc.start()
    model = torch.nn.Linear(512, 512).cuda()
    try:
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=120)
            for fill in (0.5, -0.25):
                with torch.no_grad():
                    model.weight.fill_(fill)
                    model.bias.fill_(2 * fill)
                version = sender.send(timeout=60)
                got = out.get(timeout=60)
                # 0.5 and -0.25 are exact in bf16, so the sums are exact either way
                assert got == (version, "cuda", fill * 512 * 512, 2 * fill * 512)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
