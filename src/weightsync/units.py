"""Sizes and durations as people write and read them: ``"400MB"`` in, ``"0.42 ms"`` out.

No torch here: the command line parses its arguments with these before any heavy import."""

from __future__ import annotations

import math
import re

#: decimal units as disks and networks count them, binary units as memory does
_UNITS = {
    "": 1, "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``"400MB"`` (decimal), ``"1GiB"`` (binary), ``"512KB"``, ``"2.5GB"``
    or a plain number of bytes. Raises ``ValueError`` naming what is accepted."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"not a size: {text!r}; write a number and a unit, e.g. 512KB, 100MB, 2GB, 1GiB"
        )
    nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return nbytes


def format_size(nbytes: float) -> str:
    """``nbytes`` in the largest decimal unit that keeps it at least 1: ``"400 MB"``."""
    for unit, factor in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if nbytes >= factor:
            return f"{_digits(nbytes / factor)} {unit}"
    return f"{int(nbytes)} B"


def format_duration(seconds: float) -> str:
    """``seconds`` with three significant digits in the unit that reads best:
    ``"3.0 s"``, ``"42.1 ms"``, ``"0.42 ms"``, ``"35 µs"``, ``"2 min 5 s"``."""
    if math.isnan(seconds):
        return "n/a"
    if seconds >= 120:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    if seconds >= 1e-4:
        return f"{_digits(seconds * 1e3)} ms"
    return f"{_digits(seconds * 1e6)} µs"


def _digits(value: float) -> str:
    """Three significant digits without an exponent: 412, 41.2, 4.12, 0.412."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}".rstrip("0").rstrip(".") if value >= 0.001 else f"{value:.2g}"
