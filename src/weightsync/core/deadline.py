"""A deadline: one absolute point in time that every step of a blocking call shares."""

from __future__ import annotations

import math
import numbers
import time

from weightsync.units import format_duration as human_duration


def checked_timeout(timeout: object, what: str = "timeout") -> float | None:
    """``timeout`` as seconds (a finite real number >= 0) or ``None`` (no deadline); anything
    else (NaN, infinity, a negative number, a string, a bool) is a ValueError that says what
    was given. The one check every blocking call's ``timeout`` goes through."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ValueError(f"{what} must be a number of seconds >= 0 or None, got "
                         f"{type(timeout).__name__} {timeout!r}")
    seconds = float(timeout)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0 or None, got {timeout!r}")
    return seconds


def positive_timeout(timeout: object, what: str = "timeout") -> float:
    """A default deadline (a scheme's, an engine's): a finite number of seconds > 0."""
    seconds = checked_timeout(timeout, what)
    if not seconds:
        raise ValueError(f"{what} must be a positive number of seconds, got {timeout!r}")
    return seconds


class Deadline:
    """Turns a ``timeout`` in seconds (``None``: never) into the time left for each wait."""

    __slots__ = ("_end", "timeout")

    def __init__(self, timeout: float | None) -> None:
        timeout = checked_timeout(timeout)
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

    def ahead(self, fraction: float = 0.1, at_most: float = 1.0) -> Deadline:
        """A deadline that ends earlier by ``fraction`` of the time left (at most
        ``at_most`` seconds): a coordinator gives up on it first, so the processes waiting
        on the whole deadline still hear why before theirs runs out."""
        left = self.remaining()
        return Deadline(None if left is None else max(0.0, left - min(at_most, fraction * left)))
