"""The numba kernels of the position-weighted checksum (``core.checksum``), compiled where
numba is installed: this module imports numba, so only ``core.checksum._kernels`` imports it.

The sum (``range_share``) reads two 32-bit lanes and their two 32-bit weights as one uint64
word each and adds both 64-bit products, wrapping: LLVM vectorises it as ``vpmuludq``
(32x32->64) on the words and on the words shifted right by 32, with no per-lane widening;
and it sums four whole blocks at a time, each 4 KiB of weights read from L1 against all
four, so the weights no longer stream from L2 beside the data (eight streams of data at
once were less steady than four on a slot of 4 KiB pages read by two threads). The fused copy
(``copy_share``) keeps one lane per step, widened: pairs and groups made it no faster
there (its eight write streams slower).
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np

_U64 = np.uint64
_LOW = np.uint64(0xFFFFFFFF)


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
def _pairs_sum(values: Any, factors: Any) -> Any:
    """sum_k u_k * r_k over lanes read two at a time: ``values`` and ``factors`` hold pairs
    of 32-bit lanes and weights as uint64 words (low lane first). A 64-bit multiply of
    32-bit-masked operands is one ``vpmuludq``, ``>> 32`` one ``vpsrlq``: no widening
    shuffles per lane, so the loop runs at about half the uops per byte."""
    acc = _U64(0)
    for k in range(values.shape[0]):
        v, w = values[k], factors[k]
        acc += (v & _LOW) * (w & _LOW) + (v >> _U64(32)) * (w >> _U64(32))
    return acc


#: Whole blocks summed together: each 4 KiB of weights (``_CHUNK_WORDS`` pairs) is read
#: from L1 for this many blocks' lanes in turn, instead of the 256 KiB table from L2 beside
#: every block (one load of data per load of weights). 4 KiB of each block's lanes at a
#: time, one page of a slot in /dev/shm: with 8 KiB the sum of 400 MB on two threads took
#: ~20 ms, with 4 KiB ~15.5 (torch's word sum ~17).
_GROUP_BLOCKS = 4
_CHUNK_WORDS = 512


@numba.njit(inline="always")  # type: ignore[misc, unused-ignore]
def _group_share(words: Any, pairs: Any, block: Any, block_lanes: Any, seed: Any) -> Any:
    """What ``_GROUP_BLOCKS`` whole blocks from block ``block`` add, ``words`` their lanes
    as uint64 pairs: weights chunk by chunk, each chunk against every block's lanes."""
    half = block_lanes // 2
    accs = np.zeros(_GROUP_BLOCKS, dtype=np.uint64)
    for c in range(0, half, _CHUNK_WORDS):
        factors = pairs[c:c + _CHUNK_WORDS]
        for g in range(_GROUP_BLOCKS):
            first = g * half + c
            accs[g] += _pairs_sum(words[first:first + _CHUNK_WORDS], factors)
    total = _U64(0)
    for g in range(_GROUP_BLOCKS):
        total += accs[g] * _multiplier(block + g, seed)
    return total


@numba.njit(inline="always")  # type: ignore[misc, unused-ignore]
def _lanes_share(lanes: Any, first_lane: Any, weights: Any, block_lanes: Any, seed: Any) -> Any:
    """What ``lanes`` (uint32) at absolute lane ``first_lane`` add, block by block. Lanes
    are paired with weights two at a time (``_pairs_sum``); a run that starts at an odd
    weight index takes its first lane alone, one of odd length its last."""
    pairs = weights.view(np.uint64)  # weights 2i, 2i+1 as one word (block_lanes is even)
    total = _U64(0)
    done = 0
    count = lanes.shape[0]
    whole_groups = block_lanes % (2 * _CHUNK_WORDS) == 0
    group_lanes = _GROUP_BLOCKS * block_lanes
    while done < count:
        lane = first_lane + done
        block, j = lane // block_lanes, lane % block_lanes
        if whole_groups and j == 0 and count - done >= group_lanes:
            total += _group_share(lanes[done:done + group_lanes].view(np.uint64), pairs, block,
                                  block_lanes, seed)
            done += group_lanes
            continue
        run = min(block_lanes - j, count - done)
        acc = _U64(0)
        head = j % 2  # 1: lane j pairs with no weight word of its own
        if head:
            acc += _U64(lanes[done]) * _U64(weights[j])
        twos = (run - head) // 2
        if twos > 0:
            first = done + head
            acc += _pairs_sum(lanes[first:first + 2 * twos].view(np.uint64),
                              pairs[(j + head) // 2:(j + head) // 2 + twos])
        if (run - head) % 2:
            acc += _U64(lanes[done + run - 1]) * _U64(weights[j + run - 1])
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
