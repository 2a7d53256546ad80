"""Where a vLLM CPU worker's weightsync threads run (``spare_cores``): real processes laid
out as vLLM's CPU build lays them out (an engine process whose worker processes bind
themselves to their OpenMP cores), each worker asking for the CPUs no worker is bound to,
and a thread moved there by ``run_on`` (the threads it starts with it)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from weightsync.integrations.vllm.spare_cores import run_on, spare_cores

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to bind workers apart")


def _worker(bind: list[int] | None, ready: Any, go: Any, results: Any) -> None:
    """One worker: binds itself to ``bind`` (None: stays unbound), waits until every
    sibling did, then reports its spare cores and where a thread moved there runs."""
    if bind is not None:
        os.sched_setaffinity(0, bind)
    ready.release()
    if not go.wait(30):
        return
    spare = spare_cores()
    found: dict[str, Any] = {"spare": sorted(spare)}
    with ThreadPoolExecutor(1, initializer=run_on(spare)) as pool:

        def where() -> tuple[list[int], list[int]]:
            inner: list[int] = []
            child = threading.Thread(target=lambda: inner.extend(os.sched_getaffinity(0)))
            child.start()
            child.join(10)
            return sorted(os.sched_getaffinity(0)), sorted(inner)

        found["thread"], found["its_child"] = pool.submit(where).result(timeout=30)
    found["caller"] = sorted(os.sched_getaffinity(0))
    results.put(json.dumps(found))


def _engine(binds: list[list[int] | None], out: Any) -> None:
    """The engine process: starts one worker per entry of ``binds`` and collects what
    each reports, in order (each worker has its own result queue)."""
    ctx = mp.get_context("fork")
    ready, go = ctx.Semaphore(0), ctx.Event()
    queues = [ctx.Queue() for _ in binds]
    workers = [ctx.Process(target=_worker, args=(bind, ready, go, q), daemon=True)
               for bind, q in zip(binds, queues, strict=True)]
    for w in workers:
        w.start()
    for _ in workers:
        if not ready.acquire(timeout=30):
            break
    go.set()
    reports = [json.loads(q.get(timeout=30)) for q in queues]
    for w in workers:
        w.join(10)
    out.put(json.dumps(reports))


def _run(binds: list[list[int] | None]) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    engine = ctx.Process(target=_engine, args=(binds, out))  # its workers: its children
    engine.start()
    try:
        return list(json.loads(out.get(timeout=60)))
    finally:
        engine.join(10)
        if engine.is_alive():
            engine.kill()


@needs_two_cpus
def test_a_bound_worker_stages_on_the_cores_no_worker_is_bound_to():
    first = CPUS[0]
    report = _run([[first]])[0]
    spare = [c for c in CPUS if c != first]
    assert report["spare"] == spare  # what vLLM leaves to its scheduler and API server
    assert report["thread"] == spare
    assert report["its_child"] == spare  # what the stager starts follows it
    assert report["caller"] == [first]  # the engine's own thread stays where vLLM bound it


@needs_two_cpus
def test_a_sibling_workers_cores_are_not_spare():
    first, second = CPUS[:2]
    reports = _run([[first], [second]])
    rest = [c for c in CPUS if c not in (first, second)]
    assert reports[0]["spare"] == rest
    assert reports[1]["spare"] == rest
    if not rest:  # every core computes: the threads stay with their worker
        assert reports[0]["thread"] == [first]
        assert reports[1]["thread"] == [second]


def test_an_unbound_worker_moves_nothing():
    report = _run([None])[0]
    assert report["spare"] == []
    assert report["thread"] == CPUS
