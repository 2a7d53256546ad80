"""Checks of the plain values users hand in (indices, counts, versions): one place that
says what was expected, and accepts any integer type (``numpy.int64`` included), never a
bool, a float or a string."""

from __future__ import annotations

import contextlib
import operator


def checked_int(value: object, what: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``; ValueError naming ``what``."""
    number: int | None = None
    if not isinstance(value, bool):  # True is an int to Python, never an index here
        with contextlib.suppress(TypeError):
            number = operator.index(value)  # type: ignore[arg-type]
    if number is None or number < minimum or (maximum is not None and number > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{what} must be an int {bound}, got {type(value).__name__} {value!r}")
    return number
