"""Shared fixtures: process contexts, worker start/stop that never hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import weightsync as ws  # noqa: E402

SCHEMES = {
    "shm": ws.SharedMemWeightSyncScheme,
    "mp": ws.MultiProcessWeightSyncScheme,
}


@pytest.fixture(params=sorted(SCHEMES))
def scheme_cls(request: pytest.FixtureRequest) -> Any:
    return SCHEMES[request.param]


class Workers:
    """Starts worker processes and makes sure none outlives the test."""

    def __init__(self, method: str = "fork") -> None:
        self.ctx = mp.get_context(method)
        shared = mp.get_context("spawn")  # usable by children of every start method
        self.out = shared.Queue()
        self.stop = shared.Event()
        self.procs: dict[int, Any] = {}

    def start(self, target: Any, scheme: Any, idx: int, *args: Any, method: str | None = None) -> Any:
        ctx = mp.get_context(method) if method else self.ctx
        proc = ctx.Process(target=target, args=(scheme, idx, self.out, self.stop, *args), daemon=True)
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
        self.out.join_thread()


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _single_thread_torch() -> None:
    torch.set_num_threads(1)
