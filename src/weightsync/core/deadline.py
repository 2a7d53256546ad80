"""A deadline: one absolute point in time that every step of a blocking call shares."""

from __future__ import annotations

import time

from weightsync.units import format_duration as human_duration


class Deadline:
    """Turns a ``timeout`` in seconds (``None``: never) into the time left for each wait."""

    __slots__ = ("_end", "timeout")

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def __str__(self) -> str:
        """The timeout in human units, for error messages ("2.5 s", "no deadline")."""
        return "no deadline" if self.timeout is None else human_duration(self.timeout)

    def slice(self, at_most: float) -> float:
        """Seconds to wait next: the time left, capped at ``at_most`` (for polling loops)."""
        left = self.remaining()
        return at_most if left is None else min(at_most, left)
