"""A deadline: one absolute point in time that every step of a blocking call shares."""

from __future__ import annotations

import math
import numbers
import time

from weightsync.units import format_duration as human_duration


def _refused(timeout: object, what: str, optional: bool) -> ValueError:
    return ValueError(f"{what} must be a finite number of seconds >= 0 (0: do not wait)"
                      f"{' or None' if optional else ''}, got {type(timeout).__name__} "
                      f"{timeout!r}")


def checked_timeout(timeout: object, what: str = "timeout") -> float | None:
    """The one rule for every timeout weightsync takes: a finite real number of seconds
    >= 0, where 0 means do not wait (one non-blocking attempt), or ``None`` (the call's
    default, or no deadline). Anything else (NaN, infinity, a negative number, a string, a
    bool) is a ValueError, the same words for every argument, naming ``what`` and the value."""
    if timeout is None:
        return None
    return required_timeout(timeout, what, optional=True)


def required_timeout(timeout: object, what: str = "timeout", *, optional: bool = False) -> float:
    """:func:`checked_timeout` for a timeout that must be a number (a scheme's default
    deadline, an engine's): ``None`` is refused too."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise _refused(timeout, what, optional)
    seconds = float(timeout)
    if not math.isfinite(seconds) or seconds < 0:
        raise _refused(timeout, what, optional)
    return seconds


class _Cut:
    """Whether a deadline (and every deadline derived from it) was cut short."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class Deadline:
    """Turns a ``timeout`` in seconds (``None``: never) into the time left for each wait.

    :meth:`cancel` (from any thread) cuts it short: every wait that shares it, and every
    deadline derived from it (:meth:`ahead`, :meth:`at_least`), ends at its next slice."""

    __slots__ = ("_cut", "_end", "timeout")

    def __init__(self, timeout: float | None, *, _cut: _Cut | None = None) -> None:
        timeout = checked_timeout(timeout)
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout
        self._cut = _Cut() if _cut is None else _cut

    def cancel(self) -> None:
        """End it now: ``expired()`` is True, ``remaining()`` and ``slice()`` are 0 from
        here on (a ``close()`` from another thread ends the call that waits on it)."""
        self._cut.done = True

    @property
    def cancelled(self) -> bool:
        return self._cut.done

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline (0 once cancelled)."""
        if self._cut.done:
            return 0.0
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self._cut.done or (self._end is not None and time.monotonic() >= self._end)

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
        on the whole deadline still hear why before theirs runs out. Cancelled with this one."""
        left = self.remaining()
        return Deadline(None if left is None else max(0.0, left - min(at_most, fraction * left)),
                        _cut=self._cut)

    def at_least(self, seconds: float) -> Deadline:
        """A deadline that leaves at least ``seconds`` (or the time left, if longer): for a
        short exchange that must not be given up half-way. Cancelled with this one."""
        left = self.remaining()
        return Deadline(None if left is None else max(left, seconds), _cut=self._cut)

    def idle_limited(self, idle: float) -> Deadline:
        """This deadline, each wait on it lasting at most ``idle`` seconds: a read that hears
        nothing for that long ends (a stalled peer is given up on long before the deadline,
        and the caller may ask another). Cancelled with this one."""
        return _IdleLimited(self, idle)


class _IdleLimited(Deadline):
    """A deadline whose every wait is capped (:meth:`Deadline.idle_limited`)."""

    __slots__ = ("idle",)

    def __init__(self, outer: Deadline, idle: float) -> None:
        super().__init__(outer.remaining(), _cut=outer._cut)
        self.idle = idle

    def remaining(self) -> float | None:
        left = super().remaining()
        return self.idle if left is None else min(self.idle, left)
