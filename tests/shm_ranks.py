"""Sharded-trainer ranks for the SharedMem tests: each a spawned process with gloo, an
FSDP2 (or tensor-parallel) model and its own sender of one scheme; each reports on its own
queue, and a test talks to rank 0 through a second queue (go on / stop)."""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 60.0


def tiny_model(how: str = "fsdp") -> torch.nn.Module:
    """FSDP2: uneven under 2 and 4 ranks (7 and 3 rows), the LayerNorm sharded too. Tensor
    parallel splits the first Linear by rows (``Shard(0)``), the second by columns
    (``Shard(1)``), and keeps the LayerNorm whole on every rank (replicated)."""
    torch.manual_seed(0)
    if how == "tp":
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
                                   torch.nn.LayerNorm(3))
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


def shard(model: torch.nn.Module, world: int, how: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    elif how == "tp":  # column-parallel first Linear (Shard(0)), row-parallel last (Shard(1))
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        # the LayerNorm stays plain tensors on every rank: rank 0 writes it
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gathered model (a collective: every rank calls it), for the test to compare."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def rank_main(rank: int, world: int, port: int, scheme: Any, how: str, steps: int,
              out: Any, go: Any, hooks: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = shard(tiny_model(how), world, how)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sender = scheme.create_sender(rank=rank)
        sender.register_model(model)
        version = sender.connect(timeout=TIMEOUT)
        state = full_state(model)
        out.put(("version", rank, version, state if rank == 0 else None))
        for step in range(steps):
            if rank == 0 and go is not None:
                go.get(timeout=TIMEOUT)
            loss = model(torch.randn(4, 5)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state = full_state(model)
            if hooks.get("stop_at") == (rank, step):
                os.kill(os.getpid(), signal.SIGSTOP if hooks.get("how") == "stop" else signal.SIGKILL)
            try:
                version = sender.send(timeout=hooks.get("send_timeout", TIMEOUT))
            except Exception as exc:  # reported, then the rank carries on
                out.put(("error", rank, type(exc).__name__, str(exc), getattr(exc, "rank", None)))
                continue
            out.put(("version", rank, version, state if rank == 0 else None))
        out.put(("done", rank))
        if hooks.get("linger"):
            time.sleep(hooks["linger"])
        sender.close()
        dist.destroy_process_group()
    except BaseException as exc:
        out.put(("crash", rank, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


class Ranks:
    """``world`` rank processes, each with its own result queue; killed at the end."""

    def __init__(self, scheme: Any, world: int, how: str = "fsdp", steps: int = 3,
                 hooks: dict[str, Any] | None = None, paced: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.outs = [ctx.Queue() for _ in range(world)]
        self.go = ctx.Queue() if paced else None
        port = 29000 + os.getpid() % 2000
        self.procs = [ctx.Process(target=rank_main, daemon=True, args=(
            r, world, port, scheme, how, steps, self.outs[r], self.go, hooks or {}))
            for r in range(world)]
        for p in self.procs:
            p.start()

    def next(self, rank: int, timeout: float = TIMEOUT) -> tuple[Any, ...]:
        try:
            return self.outs[rank].get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"rank {rank} said nothing within {timeout} s") from None

    def step(self) -> None:
        assert self.go is not None
        self.go.put("go")

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                with_suppress_kill(p.pid)
            p.join(5)


def with_suppress_kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
