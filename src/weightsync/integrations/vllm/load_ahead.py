"""Each rank of an in-flight server loads the version its host stages ahead of the take,
into a shadow of the served model (``prepared_load``), while the engine keeps generating;
the take then only swaps it in.

The host's receiver (local rank 0) reports a version staged to the trainer only once every
rank has loaded it ahead, or failed to (``wait_loaded``): the trainer calls the take after
that report, so the load is off the engine's path. A rank that could not load ahead loads
at the take, as before. Each rank says how its load ended in a marker file beside the
staged slots."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.integrations.vllm.prepared_load import PreparedLoad, SparePool
from weightsync.integrations.vllm.spare_cores import run_on
from weightsync.serving.host_receiver import wait_staged
from weightsync.transports.directory.files import read_json_object, write_json_atomic

logger = logging.getLogger(__name__)

_POLL = 0.005
_MARKER = "ahead.{rank}.json"


def _marker(directory: Path, rank: int) -> Path:
    return directory / _MARKER.format(rank=rank)


def _one_thread() -> None:
    """Run this thread's tensor work on one thread: the engine's own OpenMP threads are
    bound to the cores, and a second team of as many threads beside them would slow every
    engine step (a parallel region waits for its slowest thread). Per thread in OpenMP;
    vLLM's CPU worker replaces ``torch.set_num_threads``, so torch's own is called."""
    torch._C.set_num_threads(1)


class LoadAhead:
    """One rank's loads ahead of the take. ``start(key)`` when the host starts staging a
    version; :meth:`target` tells the engine's reload to load into a shadow (inside the
    background load); :meth:`take` swaps it in if it holds the version asked for."""

    def __init__(self, model: Any, directory: Path, rank: int, where: str,
                 cores: frozenset[int] = frozenset()) -> None:
        """``cores``: where the loads run (``spare_cores``; empty: where the caller runs)."""
        self.model = model
        self.directory, self.rank, self.where = directory, rank, where
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="weightsync-load-ahead",
                                          initializer=run_on(cores, _one_thread))
        self._here = threading.local()  # the shadow the background load fills
        self._lock = threading.Lock()
        self._generation = 0
        self._job: tuple[str, Future[None]] | None = None  # (request key, its load)
        self._prepared: PreparedLoad | None = None
        #: what the last swap retired: the next shadow's copies are written there
        self._spares = SparePool()

    # ------------------------------------------------------------------ background
    def start(self, key: str, timeout: float, load: Callable[[int], bool]) -> None:
        """Once the host stages ``key``, ``load(local)`` it (the engine's receiver applies
        it, its reload filling :meth:`target`) and keep the shadow; ``load`` returns False
        if it could not load ahead."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._release_prepared()
            self._job = (key, self._worker.submit(self._load, generation, key, timeout, load))

    def _load(self, generation: int, key: str, timeout: float,
              load: Callable[[int], bool]) -> None:
        loaded = False
        try:
            local = wait_staged(self.directory, key, timeout, self.where)
            if generation != self._generation:
                return
            with self._lock:
                spares, self._spares = self._spares, SparePool()
            shadow = PreparedLoad(self.model, local, spares)
            self._here.shadow = shadow
            started = time.perf_counter()
            try:
                if not load(local) or shadow.root is None:
                    shadow.release()
                    return
            finally:
                self._here.shadow = None
            with self._lock:
                if generation == self._generation:
                    self._prepared, loaded = shadow, True
            if not loaded:  # superseded while it loaded
                shadow.release()
                return
            logger.info("%s: loaded version %d ahead in %.3fs", self.where, local,
                        time.perf_counter() - started)
        except Exception as exc:  # the take loads it instead
            logger.warning("%s: could not load %s ahead (%s: %s); it loads at the take",
                           self.where, key, type(exc).__name__, exc)
        finally:
            write_json_atomic(_marker(self.directory, self.rank),
                              {"key": key, "loaded": loaded}, mode=0o600, durable=False)

    def target(self) -> PreparedLoad | None:
        """The shadow to load into, inside a background load (None elsewhere)."""
        return getattr(self._here, "shadow", None)

    # ------------------------------------------------------------------ the take
    def take(self, key: str, version: int, timeout: float) -> bool:
        """Swap in ``version`` if it was loaded ahead for ``key`` (waiting for a load of
        that key still running); False when the caller must load it itself."""
        with self._lock:
            job = self._job
        if job is None or job[0] != key:
            return False
        try:
            job[1].result(timeout=timeout)
        except Exception:  # timed out: the load goes on, unused
            logger.warning("%s: the load ahead of %s did not end within %gs", self.where,
                           key, timeout)
            self.drop()
            return False
        with self._lock:
            prepared, self._prepared, self._job = self._prepared, None, None
        if prepared is None or prepared.label != version:
            if prepared is not None:
                prepared.release()
            return False
        retired = prepared.swap_in()
        with self._lock:  # the old weights are the next shadow's; the rest is freed
            self._spares = SparePool(retired, served=self.model)
        self._worker.submit(retired.clear)  # off the engine's path: the old kernels
        return True

    def drop(self) -> None:
        """Forget what was loaded ahead (the session ends or its versions change hands)."""
        with self._lock:
            self._generation += 1
            self._release_prepared()
            self._job = None
            self._spares = SparePool()

    def _release_prepared(self) -> None:
        """Free a shadow no take will swap in (under the lock)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.release()

    def close(self) -> None:
        self.drop()
        self._worker.shutdown(wait=False, cancel_futures=True)


def wait_loaded(directory: Path, ranks: int, key: str, timeout: float, where: str) -> None:
    """Until every one of the host's ``ranks`` said how its load ahead of ``key`` ended
    (the host's receiver calls it before it reports the version staged); a rank silent
    past ``timeout`` is logged and left to load at the take."""
    deadline = Deadline(timeout)
    waiting = set(range(ranks))
    while waiting:
        waiting = {rank for rank in waiting
                   if (read_json_object(_marker(directory, rank)) or {}).get("key") != key}
        if waiting and deadline.expired():
            logger.warning("%s: ranks %s did not load %s ahead within %s; they load at the "
                           "take", where, sorted(waiting), key, deadline)
            return
        if waiting:
            time.sleep(deadline.slice(_POLL))
