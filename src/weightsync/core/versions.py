"""Versions and what the sender knows of each worker: who holds which version, and lag."""

from __future__ import annotations

from dataclasses import dataclass, field

from weightsync.core.checks import checked_int

#: The version a worker holds before it has received anything.
NO_VERSION = -1


@dataclass
class WorkerState:
    """The sender's view of one worker."""

    worker_idx: int
    connected: bool = False
    lost: bool = False
    version: int = NO_VERSION  # last version the worker confirmed
    pid: int | None = None
    error: str | None = None  # why it was lost or refused, for error messages


@dataclass
class VersionTable:
    """Per-worker state of one sender, and the version it last published."""

    num_workers: int
    published: int = NO_VERSION
    workers: dict[int, WorkerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for idx in range(self.num_workers):
            self.workers.setdefault(idx, WorkerState(idx))

    def next_version(self) -> int:
        return self.published + 1

    def lag(self) -> dict[int, int]:
        """How many versions each connected worker is behind the newest published one."""
        return {
            idx: self.published - w.version
            for idx, w in self.workers.items()
            if w.connected and w.version > NO_VERSION
        }

    def check_worker_ids(self, worker_ids: object) -> list[int]:
        """Normalise ``worker_ids`` (None: all) to a sorted list; refuse unknown indices."""
        if worker_ids is None:
            return list(range(self.num_workers))
        if isinstance(worker_ids, (str, bytes)) or not hasattr(worker_ids, "__iter__"):
            worker_ids = [worker_ids]  # one index (an int, numpy.int64, ...)
        ids = [checked_int(idx, "worker_ids: each worker index", 0, self.num_workers - 1)
               for idx in worker_ids]
        if not ids:
            raise ValueError("worker_ids is empty: a version sent to no worker is refused "
                             "(pass None for every worker)")
        return sorted(set(ids))
