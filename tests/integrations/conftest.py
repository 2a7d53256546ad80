"""One real vLLM engine (CPU build) shared by every vLLM test: it takes 15-60 s to start.

The engine serves a tiny random Llama saved at test time, carries weightsync's worker
extension and selects weightsync as its weight-transfer backend, so both ways in are
tested on the same engine. It is shut down at the end, and no process may outlive it."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import vllm_model as vm
from vllm_engine import descendants, shm_dir, shutdown_engine, vllm_or_skip


@pytest.fixture
def directory() -> Iterator[Path]:
    path = shm_dir("ws-vllm-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Served:
    """The shared engine and what the tests need to compare against it."""

    def __init__(self, llm: Any, model_dir: str, backend_dir: Path) -> None:
        self.llm = llm
        self.model_dir = model_dir
        self.backend_dir = backend_dir
        self.procs: set[Any] = set()


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    """The session's engine: float32, eager, prefix caching on, 32-token blocks."""
    vllm_or_skip()
    os.environ.update(vm.ENGINE_ENV)
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    work = Path(tempfile.mkdtemp(prefix="ws-vllm-model-"))
    model_dir = vm.save_model(vm.build_model(), work / "model")
    backend_dir = shm_dir("ws-vllm-backend-")
    started = time.perf_counter()
    existing = descendants()
    llm = LLM(**vm.engine_kwargs(
        model_dir, weight_transfer_config=WeightTransferConfig(backend="weightsync"),
    ))
    print(f"vLLM engine started in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    engine = Served(llm, model_dir, backend_dir)
    engine.procs = descendants() - existing
    try:
        yield engine
    finally:
        shutdown_engine(llm, engine.procs)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(backend_dir, ignore_errors=True)
