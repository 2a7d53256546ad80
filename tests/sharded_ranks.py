"""Start the ranks of a sharded trainer as real processes (spawned), each with its own result
queue, and collect every rank's result or error; a rank still running at the timeout is
killed. Generic: any scheme's tests can use it (the function gets ``rank, world, *args``).

    outcomes = run_ranks(my_rank_fn, 2, 60, directory)
    assert all(o.ok for o in outcomes), outcomes

``init_gloo(rank, world, port)`` sets up a CPU process group (for FSDP2 / DTensor models)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RankOutcome:
    """What one rank returned, or raised (type name, message, ``.rank`` if the error had
    one), or that it died (``exitcode``) or was killed at the timeout (``timed_out``)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str = ""
    error_rank: int | None = None
    traceback: str = ""
    exitcode: int | None = None
    timed_out: bool = False
    finished: bool = False

    @property
    def ok(self) -> bool:
        return self.finished and self.error_type is None


def _child(fn: Callable[..., Any], rank: int, world: int, results: Any, args: tuple[Any, ...]) -> None:
    try:
        value = fn(rank, world, *args)
    except BaseException as exc:  # reported, never lost
        results.put(("error", type(exc).__name__, str(exc), getattr(exc, "rank", None),
                     traceback.format_exc()))
    else:
        results.put(("ok", value))


class RankGroup:
    """Running rank processes; :meth:`collect` waits for them (killing them at the deadline)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.processes: dict[int, Any] = {}
        self.queues: dict[int, Any] = {}

    def start(self, fn: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
        results = self.ctx.Queue()
        process = self.ctx.Process(target=_child, args=(fn, rank, world, results, args),
                                   daemon=True, name=f"rank-{rank}")
        process.start()
        self.processes[rank], self.queues[rank] = process, results
        return process

    def collect(self, timeout: float, ranks: list[int] | None = None) -> list[RankOutcome]:
        deadline = time.monotonic() + timeout
        outcomes = []
        for rank in sorted(self.processes) if ranks is None else ranks:
            process, results = self.processes[rank], self.queues[rank]
            outcome = RankOutcome(rank)
            while True:
                try:
                    item = results.get(timeout=0.1)
                except queue.Empty:
                    if not process.is_alive():  # died without a word (a second look first)
                        try:
                            item = results.get(timeout=0.5)
                        except queue.Empty:
                            outcome.exitcode = process.exitcode
                            break
                    elif time.monotonic() > deadline:
                        outcome.timed_out = True
                        break
                    else:
                        continue
                outcome.finished = True
                if item[0] == "ok":
                    outcome.value = item[1]
                else:
                    _, outcome.error_type, outcome.error, outcome.error_rank, outcome.traceback = item
                break
            outcomes.append(outcome)
        for rank in sorted(self.processes) if ranks is None else ranks:
            self.stop(rank)
        return outcomes

    def stop(self, rank: int) -> None:
        process = self.processes[rank]
        process.join(timeout=2)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
            process.join(timeout=5)


def run_ranks(fn: Callable[..., Any], world: int, timeout: float, *args: Any) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; every rank's outcome,
    in rank order, within ``timeout`` seconds (ranks still running then are killed)."""
    group = RankGroup()
    try:
        for rank in range(world):
            group.start(fn, rank, world, *args)
        return group.collect(timeout)
    finally:
        group.kill_all()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_gloo(rank: int, world: int, port: int) -> None:
    """A gloo process group over TCP on localhost (the user's group in these tests)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
