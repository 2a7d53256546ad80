"""The CPUs where weightsync's background threads in a vLLM CPU worker do their work: those
that no worker of the engine is bound to.

vLLM's CPU build binds each worker process, every thread of it, to the cores of its OpenMP
team, and leaves others (by default one per worker) to its scheduler and API server. A
thread that stages a version or loads it ahead of the take inherits that binding: it then
runs on the engine's own cores, and each engine step waits for it (an OpenMP step waits for
its slowest thread). As vLLM's NIXL connector moves its KV transfers to a core the workers
leave free, weightsync moves those threads to the cores no worker is bound to.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator

from weightsync.core.liveness import process_stat

logger = logging.getLogger(__name__)


def _siblings() -> Iterator[int]:
    """This process's siblings: the other workers its parent started (and any other
    child of that parent)."""
    me, parent = os.getpid(), os.getppid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        stat = process_stat(int(entry.name))
        if stat is not None and len(stat) > 1 and int(stat[1]) == parent:
            yield int(entry.name)


def bound_cores(pids: Iterable[int], allowed: frozenset[int]) -> frozenset[int]:
    """The CPUs that those of ``pids`` bound to fewer CPUs than ``allowed`` are bound to
    (vLLM's workers; a helper process left every CPU is not bound)."""
    bound: set[int] = set()
    for pid in pids:
        try:
            theirs = frozenset(os.sched_getaffinity(pid))
        except OSError:  # gone, or not ours to read
            continue
        if theirs < allowed:
            bound |= theirs
    return frozenset(bound)


def spare_cores() -> frozenset[int]:
    """The CPUs this engine's parent may use that neither this worker nor a sibling worker
    is bound to (empty when the workers are not bound, or every CPU is theirs). Call it on
    a worker's main thread, whose affinity is the worker's binding."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc"):
        return frozenset()
    try:
        allowed = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset()
    mine = frozenset(os.sched_getaffinity(0))
    if mine >= allowed:
        return frozenset()  # not bound: the scheduler shares every core already
    return allowed - mine - bound_cores(_siblings(), allowed)


def run_on(cores: frozenset[int], then: Callable[[], None] | None = None
           ) -> Callable[[], None]:
    """A thread initializer (``ThreadPoolExecutor(initializer=...)``) that moves the thread
    to ``cores`` (nothing when empty), then runs ``then``. Threads it starts inherit them."""

    def initialize() -> None:
        if cores:
            try:
                os.sched_setaffinity(0, cores)
            except OSError as exc:  # e.g. a cpuset that since shrank: stay where it is
                logger.warning("could not move weightsync's thread to CPUs %s (%s); it "
                               "shares the engine's cores", sorted(cores), exc)
        if then is not None:
            then()

    return initialize
