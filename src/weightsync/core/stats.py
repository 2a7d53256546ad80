"""Per-send figures a sender keeps: bytes moved, seconds per phase, per-worker lag."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SendRecord:
    """What one send did and how long each phase took (seconds)."""

    version: int
    worker_ids: tuple[int, ...]
    nbytes: int
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())


class SendStats:
    """A bounded history of :class:`SendRecord` with a summary for ``sender.stats()``."""

    def __init__(self, history: int = 256) -> None:
        self.records: deque[SendRecord] = deque(maxlen=history)
        self.sends = 0
        self.bytes_sent = 0

    def add(self, record: SendRecord) -> None:
        self.records.append(record)
        self.sends += 1
        self.bytes_sent += record.nbytes * max(1, len(record.worker_ids))

    def summary(self, lag: dict[int, int]) -> dict[str, Any]:
        last = self.records[-1] if self.records else None
        totals = sorted(r.total_s for r in self.records)
        return {
            "sends": self.sends,
            "bytes_sent": self.bytes_sent,
            "last": asdict(last) | {"total_s": last.total_s} if last else None,
            "median_s": totals[len(totals) // 2] if totals else None,
            "worker_lag": lag,
        }
