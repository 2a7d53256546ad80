"""The numba kernels of the position-weighted checksum (``core.checksum``), compiled where
numba is installed: this module imports numba, so only ``core.checksum._kernels`` imports it.

The inner loop multiplies each 32-bit lane by its 32-bit weight into a 64-bit product and
adds it, wrapping: LLVM vectorises it (32x32->64 multiplies), so a block of lanes read
from cache costs about what summing it did.
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np

_U64 = np.uint64


def _compile(function: Any) -> Any:
    try:
        return numba.njit(nogil=True, cache=True)(function)  # compiled once per machine
    except RuntimeError:  # pragma: no cover - no writable cache directory: per process
        return numba.njit(nogil=True)(function)


@numba.njit(inline="always")  # type: ignore[misc, unused-ignore]
def _multiplier(block: Any, seed: Any) -> Any:
    """splitmix64(seed + block) | 1: the odd multiplier of block ``block``."""
    z = _U64(block) + _U64(seed)
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return (z ^ (z >> _U64(31))) | _U64(1)


@numba.njit(inline="always")  # type: ignore[misc, unused-ignore]
def _byte_term(byte: Any, position: Any, weights: Any, block_lanes: Any, seed: Any) -> Any:
    """What one byte at absolute byte ``position`` adds: its value shifted to its place in
    its lane, times the lane's weight and the block's multiplier."""
    lane = position // 4
    shifted = _U64(byte) << _U64(8 * (position % 4))
    return shifted * _U64(weights[lane % block_lanes]) * _multiplier(lane // block_lanes, seed)


@numba.njit(inline="always")  # type: ignore[misc, unused-ignore]
def _lanes_share(lanes: Any, first_lane: Any, weights: Any, block_lanes: Any, seed: Any) -> Any:
    """What ``lanes`` (uint32) at absolute lane ``first_lane`` add, block by block."""
    total = _U64(0)
    done = 0
    count = lanes.shape[0]
    while done < count:
        lane = first_lane + done
        block, j = lane // block_lanes, lane % block_lanes
        run = min(block_lanes - j, count - done)
        acc = _U64(0)
        values, factors = lanes[done:done + run], weights[j:j + run]
        for k in range(run):  # vectorised: 32x32->64 multiplies
            acc += _U64(values[k]) * _U64(factors[k])
        total += acc * _multiplier(block, seed)
        done += run
    return total


def _range_share(raw: Any, start: Any, stop: Any, position: Any, weights: Any, block_lanes: Any,
                 seed: Any) -> Any:
    """What bytes ``raw[start:stop]`` add when they lie at absolute byte ``position``."""
    total = _U64(0)
    i, p = start, position
    while i < stop and p % 4 != 0:
        total += _byte_term(raw[i], p, weights, block_lanes, seed)
        i += 1
        p += 1
    whole = (stop - i) // 4 * 4
    if whole > 0:
        total += _lanes_share(raw[i:i + whole].view(np.uint32), p // 4, weights, block_lanes, seed)
        i += whole
        p += whole
    while i < stop:
        total += _byte_term(raw[i], p, weights, block_lanes, seed)
        i += 1
        p += 1
    return total


range_share = _compile(_range_share)


def _strided_share(raw: Any, start: Any, rows: Any, stride: Any, width: Any, weights: Any,
                   block_lanes: Any, seed: Any) -> Any:
    """What ``rows`` ranges of ``width`` bytes every ``stride`` bytes from ``start`` of
    ``raw`` add, each at its own position in ``raw``."""
    total = _U64(0)
    for row in range(rows):
        first = start + row * stride
        total += range_share(raw, first, first + width, first, weights, block_lanes, seed)
    return total


strided_share = _compile(_strided_share)


@numba.njit(inline="always")  # type: ignore[misc, unused-ignore]
def _copy_lanes_share(source: Any, target: Any, first_lane: Any, weights: Any, block_lanes: Any,
                      seed: Any) -> Any:
    """Copy ``source`` (uint32 lanes) into ``target`` and return what they add at absolute
    lane ``first_lane``: each lane is summed as it is copied, read once."""
    total = _U64(0)
    done = 0
    count = source.shape[0]
    while done < count:
        lane = first_lane + done
        block, j = lane // block_lanes, lane % block_lanes
        run = min(block_lanes - j, count - done)
        acc = _U64(0)
        values, out, factors = source[done:done + run], target[done:done + run], weights[j:j + run]
        for k in range(run):  # vectorised: a load, a store, 32x32->64 multiplies
            value = values[k]
            out[k] = value
            acc += _U64(value) * _U64(factors[k])
        total += acc * _multiplier(block, seed)
        done += run
    return total


def _copy_share(source: Any, target: Any, position: Any, weights: Any, block_lanes: Any,
                seed: Any) -> Any:
    """Copy the bytes ``source`` into ``target`` (as long) and return what they add when
    they lie at absolute byte ``position``."""
    total = _U64(0)
    stop = source.shape[0]
    i, p = 0, position
    while i < stop and p % 4 != 0:
        target[i] = source[i]
        total += _byte_term(source[i], p, weights, block_lanes, seed)
        i += 1
        p += 1
    whole = (stop - i) // 4 * 4
    if whole > 0:
        total += _copy_lanes_share(source[i:i + whole].view(np.uint32),
                                   target[i:i + whole].view(np.uint32), p // 4, weights,
                                   block_lanes, seed)
        i += whole
        p += whole
    while i < stop:
        target[i] = source[i]
        total += _byte_term(source[i], p, weights, block_lanes, seed)
        i += 1
        p += 1
    return total


copy_share = _compile(_copy_share)
