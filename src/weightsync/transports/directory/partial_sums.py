"""Each trainer rank's share of a slot's bucket checksums, so that nobody reads the slot
again to commit a version written by several ranks.

A bucket's checksum (:func:`~weightsync.transports.directory.slots.bucket_checksums`) is
the wrapping sum of its 64-bit little-endian words, plus its last ``n % 8`` bytes weighted
``1, 2, ...``. Both parts are linear in the bytes: byte ``i`` of a bucket of ``n`` bytes
counts ``b_i << 8 * (i % 8)`` when it lies in a whole word, ``b_i * (i - full + 1)`` in the
tail (``full = n // 8 * 8``). So the checksum of a bucket is the sum, modulo 2**64, of
what each rank computes over the bytes it wrote, wherever its ranges start and end: a word
split between two ranks is summed by each as its own bytes shifted to their position.

A rank writes a block of a global tensor: for a row-major tensor that is a set of equal
byte ranges at a constant stride (one range for ``Shard(0)``, one per row for
``Shard(1)``). Aligned ranges are summed as words (one pass over memory the rank has just
written, still in cache); ranges that start or end inside a word add their edge bytes one by
one; many short misaligned rows are summed column-wise, grouped by their position modulo 8.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from weightsync.core.layout import Layout
from weightsync.core.shards import Region

_MASK = (1 << 64) - 1
#: rows of a strided block summed one by one below this count (column sums above it)
_FEW_ROWS = 32


def word_sum(raw: torch.Tensor) -> int:
    """Wrapping sum of the int64 words of ``raw`` (uint8, length a multiple of 8), copied
    first if it does not start on an 8-byte boundary of its storage."""
    if not raw.numel():
        return 0
    if raw.storage_offset() % 8:
        raw = raw.clone()
    return int(raw.view(torch.int64).sum()) & _MASK


class BucketGeometry:
    """Where each tensor of a file layout lies inside its bucket, for summing byte ranges."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        offsets = layout.offsets()
        self.bucket_of: dict[str, int] = {}
        self.start_in_bucket: dict[str, int] = {}
        for index, bucket in enumerate(layout.buckets):
            for name in bucket.names:
                self.bucket_of[name] = index
                self.start_in_bucket[name] = offsets[name][0] - bucket.byte_offset

    def blocks(self, name: str, region: Region) -> list[tuple[int, int, int, int]]:
        """``region`` of tensor ``name`` as ``(first byte, rows, stride, row bytes)`` blocks,
        bucket-relative: trailing dimensions the region covers whole merge into each row."""
        spec = self.layout[name]
        shape, size = spec.shape, spec.dtype.itemsize
        strides = [math.prod(shape[d + 1:]) * size for d in range(len(shape))]
        base = self.start_in_bucket[name]
        if not shape:
            return [(base, 1, size, size)]
        inner = len(shape)  # first dimension of the suffix the region covers whole
        while inner > 0 and region[inner - 1] == (0, shape[inner - 1]):
            inner -= 1
        if inner == 0:
            return [(base, 1, spec.nbytes, spec.nbytes)]
        row_dim = inner - 1
        lo, hi = region[row_dim]
        row_bytes = (hi - lo) * strides[row_dim]
        base += lo * strides[row_dim]
        if row_dim == 0:
            return [(base, 1, row_bytes, row_bytes)]
        step_dim = row_dim - 1
        rows, stride = region[step_dim][1] - region[step_dim][0], strides[step_dim]
        base += region[step_dim][0] * stride
        outer = [range(lo_, hi_) for lo_, hi_ in region[:step_dim]]
        return [(base + sum(i * strides[d] for d, i in enumerate(index)), rows, stride, row_bytes)
                for index in itertools.product(*outer)]


def _edge_bytes(raw: torch.Tensor, start: int, stop: int) -> int:
    """Bytes ``start..stop`` of ``raw`` (inside whole words) shifted to their positions."""
    return sum(b << (8 * (i % 8)) for i, b in enumerate(raw[start:stop].tolist(), start))


def range_sum(raw: torch.Tensor, start: int, stop: int) -> int:
    """The share of bytes ``start..stop`` of the bucket ``raw`` in its checksum."""
    full = raw.numel() // 8 * 8
    total = 0
    if stop > full:  # the tail: weighted by position
        lo = max(start, full)
        total += sum(b * (i - full + 1) for i, b in enumerate(raw[lo:stop].tolist(), lo))
        stop = full
    if start >= stop:
        return total & _MASK
    first_word = min(-(-start // 8) * 8, stop)
    last_word = max(stop // 8 * 8, first_word)
    total += _edge_bytes(raw, start, first_word) + _edge_bytes(raw, last_word, stop)
    total += word_sum(raw[first_word:last_word])
    return total & _MASK


def _strided_sum(raw: torch.Tensor, start: int, rows: int, stride: int, width: int) -> int:
    """The share of ``rows`` ranges of ``width`` bytes every ``stride`` bytes from ``start``
    (all inside whole words), summed per column and grouped by position modulo 8."""
    if start % 8 == 0 and stride % 8 == 0 and width % 8 == 0 and raw.storage_offset() % 8 == 0:
        words = raw[: raw.numel() // 8 * 8].view(torch.int64)
        block = words.as_strided((rows, width // 8), (stride // 8, 1),
                                 words.storage_offset() + start // 8)
        return int(block.sum()) & _MASK
    block = raw.as_strided((rows, width), (stride, 1), raw.storage_offset() + start)
    period = 8 // math.gcd(stride, 8)
    residues = torch.arange(width, dtype=torch.int64)
    per_position = torch.zeros(8, dtype=torch.int64)
    for group in range(min(period, rows)):
        columns = block[group::period].sum(0, dtype=torch.int64)
        shift = (start + group * stride) % 8
        per_position.index_add_(0, (residues + shift) % 8, columns)
    return sum(int(s) << (8 * j) for j, s in enumerate(per_position.tolist())) & _MASK


def block_sum(raw: torch.Tensor, start: int, rows: int, stride: int, width: int) -> int:
    """The share of one block (see :meth:`BucketGeometry.blocks`) of the bucket ``raw``."""
    if rows == 1 or stride == width:
        return range_sum(raw, start, start + (rows - 1) * stride + width)
    full = raw.numel() // 8 * 8
    # rows reaching into the tail (the last < 8 bytes) are summed one by one
    whole = min(rows, max(0, (full - width - start) // stride + 1))
    total = sum(range_sum(raw, start + k * stride, start + k * stride + width)
                for k in range(whole, rows))
    if whole <= _FEW_ROWS:
        total += sum(range_sum(raw, start + k * stride, start + k * stride + width)
                     for k in range(whole))
    else:
        total += _strided_sum(raw, start, whole, stride, width)
    return total & _MASK


def region_sums(geometry: BucketGeometry, data: torch.Tensor,
                regions: Sequence[tuple[str, Region]]) -> list[int]:
    """Per bucket of ``geometry.layout``, the share of ``regions`` (``(name, region)``,
    already written into ``data``, the slot's bytes) in the bucket checksums."""
    layout = geometry.layout
    sums = [0] * len(layout.buckets)
    for name, region in regions:
        index = geometry.bucket_of[name]
        bucket = layout.buckets[index]
        raw = data[bucket.byte_offset: bucket.byte_offset + bucket.nbytes]
        for block in geometry.blocks(name, region):
            sums[index] = (sums[index] + block_sum(raw, *block)) & _MASK
    return sums


def combine(shares: Sequence[Sequence[int]]) -> list[int]:
    """The bucket checksums of a slot from every rank's shares (one list per rank)."""
    return [sum(column) & _MASK for column in zip(*shares, strict=True)]
