"""``weightsync demo``: a trainer and N worker processes keeping a small policy in sync.

The trainer fits a small MLP policy by gradient descent; after every step it sends the
weights, and each worker process evaluates its copy on held-out data, reporting the
version it holds and its loss. The versions advance and the workers' losses fall with
the trainer's: the sync carries real, complete weights.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.schemes.base import WeightSyncScheme


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 2),
    )


def _task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.stack([torch.sin(x[:, 0] * 2) + x[:, 1], x[:, 2] * x[:, 3]], dim=1)
    return x, y


def _worker(scheme: WeightSyncScheme, idx: int, out: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    policy = make_policy()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(policy)
    receiver.connect(timeout=60)
    x, y = _task(512, seed=100 + idx)
    while not stop.is_set():
        try:
            version = receiver.receive(timeout=0.2)
        except Exception as exc:  # the trainer closed: the demo is over
            out.put((idx, "closed", repr(exc)))
            break
        if version is not None:
            with torch.no_grad():
                loss = float(torch.nn.functional.mse_loss(policy(x), y))
            out.put((idx, version, loss))
    receiver.close()


@dataclass
class DemoResult:
    steps: int
    final_version: int
    first_loss: float
    final_loss: float
    worker_versions: dict[int, int]
    median_send_ms: float


def run_demo(
    transport: str = "shm", workers: int = 2, steps: int = 200, log: Any = print,
) -> DemoResult:
    from weightsync import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    torch.set_num_threads(1)
    torch.manual_seed(0)
    scheme_cls = {"shm": SharedMemWeightSyncScheme, "mp": MultiProcessWeightSyncScheme}[transport]
    scheme = scheme_cls(num_workers=workers, timeout=30)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(scheme, i, out, stop), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    x, y = _task(2048, seed=0)
    send_times: list[float] = []
    latest: dict[int, tuple[int, float]] = {}
    first_loss = None
    try:
        with scheme.create_sender() as sender:
            sender.register_model(policy)
            log(f"trainer: waiting for {workers} workers over {transport} ...")
            sender.connect(timeout=60)
            log(f"trainer: all workers hold version 0 ({sender.layout})")
            for step in range(1, steps + 1):
                loss = torch.nn.functional.mse_loss(policy(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                t0 = time.perf_counter()
                version = sender.send(timeout=30)
                send_times.append(time.perf_counter() - t0)
                _collect(out, latest)
                if first_loss is None and latest:
                    first_loss = statistics_mean(latest)
                if step % max(1, steps // 10) == 0 or step == steps:
                    held = {i: v for i, (v, _) in sorted(latest.items())}
                    log(f"step {step:4d}  version {version:4d}  train loss {float(loss):.4f}  "
                        f"workers hold {held}  worker loss {statistics_mean(latest):.4f}  "
                        f"send {send_times[-1] * 1e3:.2f} ms")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                latest.get(i, (-1, 0.0))[0] < sender.version for i in range(workers)
            ):
                _collect(out, latest, wait=0.1)
            final_version = sender.version
            stats = sender.stats()
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    send_times.sort()
    result = DemoResult(
        steps, final_version, first_loss or float("nan"), statistics_mean(latest),
        {i: v for i, (v, _) in latest.items()}, send_times[len(send_times) // 2] * 1e3,
    )
    log(f"done: {steps} sends, every worker on version {result.worker_versions}, worker loss "
        f"{result.first_loss:.4f} -> {result.final_loss:.4f}, median send "
        f"{result.median_send_ms:.2f} ms, {stats['bytes_sent']} bytes delivered")
    return result


def statistics_mean(latest: dict[int, tuple[int, float]]) -> float:
    return sum(loss for _, loss in latest.values()) / max(1, len(latest))


def _collect(out: Any, latest: dict[int, tuple[int, float]], wait: float = 0.0) -> None:
    while True:
        try:
            idx, version, loss = out.get(timeout=wait) if wait else out.get_nowait()
        except queue.Empty:
            return
        if version != "closed":
            latest[idx] = (version, loss)
        wait = 0.0
