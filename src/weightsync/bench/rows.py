"""One row of ``weightsync bench``: a phase's median and p90 beside the floor measured in the
same run, and the table, JSON and text forms of a list of rows."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from weightsync.units import format_duration


@dataclass
class BenchRow:
    """A phase (``"shm applied everywhere"``) of one configuration, times in milliseconds."""

    transport: str
    size: str
    nbytes: int
    workers: int
    median_ms: float
    p90_ms: float
    gbps: float
    memcpy_ms: float  # the floor: one memcpy of the same bytes (Ray: one gloo p2p transfer)
    ratio: float  # median / floor
    samples: int = 0
    floor: str = "memcpy"

    @property
    def ratio_per_worker(self) -> float:
        return self.ratio / self.workers


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_row(label: str, size: str, nbytes: int, workers: int, times: Sequence[float],
             floor: float, floor_name: str = "memcpy") -> BenchRow:
    """One table row: median and p90 of ``times`` (seconds) against ``floor`` (seconds)."""
    median = statistics.median(times)
    return BenchRow(label, size, nbytes, workers, median * 1e3, percentile(times, 0.9) * 1e3,
                    nbytes / median / 1e9, floor * 1e3, median / floor, len(times), floor_name)


def format_table(rows: Sequence[BenchRow]) -> str:
    """A Markdown table, durations in human units."""
    head = ("| transport | size | workers | median | p90 | GB/s | floor | x floor | "
            "x floor per worker |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.transport} | {r.size} | {r.workers} | {format_duration(r.median_ms / 1e3)} | "
            f"{format_duration(r.p90_ms / 1e3)} | {r.gbps:.2f} | "
            f"{format_duration(r.memcpy_ms / 1e3)} {r.floor} | {r.ratio:.2f} | "
            f"{r.ratio_per_worker:.2f} |"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[BenchRow], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) | {"ratio_per_worker": r.ratio_per_worker} for r in rows], fh, indent=2)
