"""Lifecycle helpers for the real vLLM engines of the tests: skip without vLLM, fresh
directories in /dev/shm, and a shutdown that leaves no process behind."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest


def vllm_or_skip() -> Any:
    try:
        import vllm
    except ImportError as exc:
        pytest.skip(f"vLLM is not installed ({exc}); bash scripts/env.sh installs the CPU build")
    return vllm


def mapped_shm() -> set[str]:
    """The names of the /dev/shm files that some live process maps."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                names.add(line[at + len("/dev/shm/"):].split(" ", 1)[0])
    return names


def shm_dir(prefix: str) -> Path:
    """A fresh directory in /dev/shm (or the temp dir where there is none)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def descendants() -> set[Any]:
    """This process's child processes, minus Python's multiprocessing helpers (the
    resource tracker lives as long as the test session)."""
    import psutil

    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" in " ".join(proc.cmdline()):
                continue
        except psutil.Error:
            continue
        found.add(proc)
    return found


def shutdown_engine(llm: Any, engine_procs: set[Any], timeout: float = 60.0) -> None:
    """Stop ``llm``'s engine process and workers (``engine_procs``); fail if any is still
    alive after ``timeout``."""
    import psutil

    before = list(engine_procs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    # our own children (vLLM's engine core) are reaped through multiprocessing, so that it
    # records their exit: reaped behind its back, they would look alive to it forever
    pids = {proc.pid for proc in before}
    for child in multiprocessing.active_children():
        if child.pid in pids:
            child.join(timeout)
    _, alive = psutil.wait_procs(before, timeout=timeout)
    for proc in alive:  # never leave a process behind, even when the test fails
        proc.kill()
    # vLLM's CPU build shares tensor-parallel buffers through /dev/shm segments that its
    # killed workers never unlink: remove them, so nothing outlives the run (those a live
    # process maps are another engine's, running in the other test worker)
    mapped = mapped_shm()
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        if name.startswith("vllm_dist_") and name not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
    assert not alive, f"vLLM processes outlived the engine: {[p.pid for p in alive]}"


