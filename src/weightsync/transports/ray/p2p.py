"""Point-to-point helpers shared by the per-node streams of the Ray scheme (the delta
streams and a sharded trainer's rank streams): a live process group, bounded waits, and
checksums as the int64 a header tensor carries."""

from __future__ import annotations

import datetime
from typing import Any

from weightsync.transports.ray.group import WeightGroup


def signed(value: int) -> int:
    """A uint64 checksum as the int64 with the same bits (what an int64 tensor holds)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def wait_work(work: Any, timeout: float | None) -> None:
    """Wait for a ``send``/``recv`` work, at most ``timeout`` seconds (None: the group's)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))


def live_pg(group: WeightGroup) -> Any:
    """The group generation's process group; RuntimeError once it is closed."""
    if group.pg is None:
        raise RuntimeError(f"group generation {group.info.generation} is closed")
    return group.pg
