"""Shared fixtures: process contexts, worker start/stop that never hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import weightsync as ws


def _zero_copy_scheme(*args: Any, **kwargs: Any) -> ws.SharedMemWeightSyncScheme:
    """SharedMem whose receivers default to zero-copy (weights are views into the slot)."""
    return ws.SharedMemWeightSyncScheme(*args, zero_copy=True, **kwargs)


SCHEMES = {
    "shm": ws.SharedMemWeightSyncScheme,
    "shm-zero-copy": _zero_copy_scheme,
    "mp": ws.MultiProcessWeightSyncScheme,
}


@pytest.fixture(params=sorted(SCHEMES))
def scheme_cls(request: pytest.FixtureRequest) -> Any:
    return SCHEMES[request.param]


class MergedQueue:
    """One ``multiprocessing.Queue`` per worker, read as one: a worker SIGKILLed while
    holding its queue's write lock must not block the others' messages."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")  # usable by children of every start method
        self.queues: list[Any] = []

    def new(self) -> Any:
        q = self._ctx.Queue()
        self.queues.append(q)
        return q

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for q in self.queues:
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
            if time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(0.002)

    def empty(self) -> bool:
        return all(q.empty() for q in self.queues)

    def close(self) -> None:
        for q in self.queues:
            q.close()
            q.cancel_join_thread()


class Workers:
    """Starts worker processes and makes sure none outlives the test."""

    def __init__(self, method: str = "fork") -> None:
        self.ctx = mp.get_context(method)
        self.out = MergedQueue()
        self.stop = mp.get_context("spawn").Event()
        self.procs: dict[int, Any] = {}

    def start(self, target: Any, scheme: Any, idx: int, *args: Any, method: str | None = None) -> Any:
        ctx = mp.get_context(method) if method else self.ctx
        proc = ctx.Process(
            target=target, args=(scheme, idx, self.out.new(), self.stop, *args), daemon=True
        )
        proc.start()
        self.procs[idx] = proc
        return proc

    def kill(self, idx: int) -> None:
        proc = self.procs[idx]
        proc.kill()
        proc.join(10)

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.out.close()


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _single_thread_torch() -> None:
    torch.set_num_threads(1)


# ---------------------------------------------------------------------- test tiers
#: Tests that only the full run takes (`bash scripts/run.sh test-all`, what CI runs): the
#: peer suite (TorchRL's own tests on our schemes), the two-host clusters and `vllm serve`
#: in network namespaces, soaks, benches and demos. The README's default command
#: (`bash scripts/run.sh test`) leaves them out so that it ends within minutes.
FULL_TIER: tuple[str, ...] = (
    "tests/torchrl_compat/",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(FULL_TIER):
            item.add_marker(pytest.mark.full)
