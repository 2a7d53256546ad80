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
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def _parent_of(pid: str) -> int | None:
    """The parent of process ``pid`` (None if it is gone or unreadable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": the name may hold spaces and parentheses
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None


def _siblings() -> Iterator[int]:
    """This process's siblings: the other workers its parent started (and any other
    child of that parent)."""
    me, parent = os.getpid(), os.getppid()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != me and _parent_of(entry.name) == parent:
            yield int(entry.name)


def _affinity(pid: int) -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:  # gone, or not ours to read
        return frozenset()


def spare_cores() -> frozenset[int]:
    """The CPUs this engine's parent may use that neither this worker nor a sibling worker
    is bound to (empty when the workers are not bound, or every CPU is theirs). Call it on
    a worker's main thread, whose affinity is the worker's binding."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc"):
        return frozenset()
    allowed = _affinity(os.getppid())
    mine = frozenset(os.sched_getaffinity(0))
    if not allowed or mine >= allowed:
        return frozenset()  # not bound: the scheduler shares every core already
    bound = set(mine)
    for pid in _siblings():
        theirs = _affinity(pid)
        if theirs and theirs < allowed:  # a bound worker (an unbound helper has them all)
            bound |= theirs
    return frozenset(allowed - bound)


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
