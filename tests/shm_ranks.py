"""Sharded-trainer ranks for the SharedMem tests: each a spawned process with gloo, an
FSDP2 (or tensor-parallel) model and its own sender of one scheme; each reports on its own
queue, and a test talks to rank 0 through a second queue (go on / stop)."""

from __future__ import annotations

import contextlib
import io
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



def _by_value(state: dict[str, torch.Tensor]) -> bytes:
    """A state as bytes: a tensor put in a queue travels as a handle to this process's
    shared memory, which is gone if the rank exits before the test reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()

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
        out.put(("version", rank, version, _by_value(state) if rank == 0 else None))
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
            out.put(("version", rank, version, _by_value(state) if rank == 0 else None))
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
            r, world, port, scheme.for_trainer_ranks(), how, steps, self.outs[r], self.go,
            hooks or {}))
            for r in range(world)]
        for p in self.procs:
            p.start()

    def next(self, rank: int, timeout: float = TIMEOUT) -> tuple[Any, ...]:
        try:
            message = self.outs[rank].get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"rank {rank} said nothing within {timeout} s") from None
        if message[0] == "version" and isinstance(message[3], bytes):
            return (*message[:3], torch.load(io.BytesIO(message[3])))
        return message

    def step(self) -> None:
        assert self.go is not None
        self.go.put("go")

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                with_suppress_kill(p.pid)
            p.join(5)


def with_suppress_kill(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- Megatron-style ranks
ROWS, COLS = 64, 32


def block_weights(rank: int, world: int, value: float) -> dict[str, Any]:
    """Rank ``rank``'s rows of ``w`` (uneven: the last rank takes the rest) and, on every
    rank, a plain ``b`` (rank 0 writes it), all filled with ``value``."""
    import weightsync as ws

    per = ROWS // world + 1
    lo, hi = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    rows = torch.full((hi - lo, COLS), value)
    return {"w": ws.LocalShard(rows, (ROWS, COLS), (lo, 0)), "b": torch.full((COLS,), value)}


class BlockModel(torch.nn.Module):
    """What a worker holds: the whole ``w`` and ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(ROWS, COLS))
        self.b = torch.nn.Parameter(torch.zeros(COLS))


def block_rank_main(rank: int, world: int, scheme: Any, out: Any, commands: Any,
                    rows: int | None = None, first_value: float = 0.0) -> None:
    """A rank that takes commands: ("send", timeout), ("hammer", n), ("kill_mid_write",),
    ("stop_mid_write",), ("close",). Each send fills its block with the version it is
    about to be (the n-th send is version n), so any mix of versions shows."""
    try:
        import weightsync.transports.shm.sharded as sharded

        sender = scheme.create_sender(rank=rank)
        weights = block_weights(rank, world, first_value)  # a restarted rank: its checkpoint
        if rows is not None:  # a rank that registers another model
            weights["w"] = type(weights["w"])(torch.zeros(rows, COLS), (ROWS + rows, COLS), (0, 0))
        sender.register_model(weights)
        out.put(("connected", rank, sender.connect(timeout=TIMEOUT)))
        while True:
            command = commands.get(timeout=TIMEOUT)
            if command[0] == "close":
                sender.close()
                out.put(("closed", rank))
                return
            if command[0] in ("kill_mid_write", "stop_mid_write"):
                real = sharded.write_pieces
                sig = signal.SIGKILL if command[0] == "kill_mid_write" else signal.SIGSTOP

                def half_then_die(pieces: Any, views: Any, real: Any = real, sig: Any = sig) -> int:
                    sharded.write_pieces = real  # once
                    for view in views.values():  # scribble half, as a dying copy would
                        view.view(-1)[: view.numel() // 2].fill_(-1.0)
                    os.kill(os.getpid(), sig)
                    return int(real(pieces, views))

                sharded.write_pieces = half_then_die  # type: ignore[assignment]
                command = ("send", TIMEOUT)
            count = command[1] if command[0] == "hammer" else 1
            timeout = command[1] if command[0] == "send" else TIMEOUT
            for _ in range(count):
                value = float(sender.version + 1)
                weights["w"].tensor.fill_(value)
                weights["b"].fill_(value)
                try:
                    version = sender.send(timeout=timeout)
                except Exception as exc:
                    out.put(("error", rank, type(exc).__name__, str(exc), getattr(exc, "rank", None)))
                    break
                out.put(("version", rank, version))
    except BaseException as exc:
        out.put(("crash", rank, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


class BlockRanks:
    """Megatron-style ranks (no process group): ``start(r)`` (re)starts rank ``r``."""

    def __init__(self, scheme: Any, world: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.scheme, self.world = scheme, world
        self.procs: dict[int, Any] = {}
        self.outs: dict[int, Any] = {}
        self.commands: dict[int, Any] = {}
        for r in range(world):
            self.start(r)

    def start(self, rank: int, rows: int | None = None, first_value: float = 0.0) -> None:
        self.outs[rank], self.commands[rank] = self.ctx.Queue(), self.ctx.Queue()
        self.procs[rank] = self.ctx.Process(target=block_rank_main, daemon=True, args=(
            rank, self.world, self.scheme.for_trainer_ranks(), self.outs[rank],
            self.commands[rank], rows,
            first_value))
        self.procs[rank].start()

    def tell(self, rank: int, *command: Any) -> None:
        self.commands[rank].put(command)

    def tell_all(self, *command: Any) -> None:
        for rank in self.procs:
            self.tell(rank, *command)

    def next(self, rank: int, timeout: float = TIMEOUT) -> tuple[Any, ...]:
        try:
            message = self.outs[rank].get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"rank {rank} said nothing within {timeout} s") from None
        return message

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                with_suppress_kill(p.pid)
            p.join(5)
