"""Versions and what the sender knows of each worker: who holds which version, and lag."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def check_worker_ids(self, worker_ids: int | list[int] | tuple[int, ...] | None) -> list[int]:
        """Normalise ``worker_ids`` (None: all) to a sorted list; refuse unknown indices."""
        if worker_ids is None:
            return list(range(self.num_workers))
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        for idx in ids:
            if not isinstance(idx, int) or isinstance(idx, bool) or idx not in self.workers:
                raise ValueError(
                    f"worker_ids: {idx!r} is not a worker index; expected ints in "
                    f"[0, {self.num_workers})"
                )
        return sorted(set(ids))
