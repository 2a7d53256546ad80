"""Each trainer rank's share of a slot's bucket checksums, so that nobody reads the slot
again to commit a version written by several ranks.

A bucket's checksum (:mod:`weightsync.core.checksum`) is linear in the bytes: byte ``i`` of
a bucket counts ``b_i << 8 * (i % 4)`` times the weight of its lane and the multiplier of
its block, whatever else the bucket holds. So the checksum of a bucket is the sum, modulo
2**64, of what each rank computes over the bytes it wrote, wherever its ranges start and
end: a lane split between two ranks is summed by each as its own bytes shifted to their
place.

A rank writes a block of a global tensor: for a row-major tensor that is a set of equal
byte ranges at a constant stride (one range for ``Shard(0)``, one per row for
``Shard(1)``), summed in one kernel call (:func:`~weightsync.core.checksum.strided_share`)
over memory the rank has just written, still in cache.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from weightsync.core.checksum import range_share, strided_share
from weightsync.core.layout import Layout
from weightsync.core.shards import Region

_MASK = (1 << 64) - 1


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


def block_sum(raw: torch.Tensor, start: int, rows: int, stride: int, width: int) -> int:
    """The share of one block (see :meth:`BucketGeometry.blocks`) of the bucket ``raw``."""
    if rows == 1 or stride == width:
        return range_share(raw, start, start + (rows - 1) * stride + width)
    return strided_share(raw, start, rows, stride, width)


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
