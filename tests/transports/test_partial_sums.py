"""Per-rank checksum shares add up to the bucket checksums of the whole slot, wherever the
ranks' byte ranges start and end (rows, columns, odd sizes, bucket tails)."""

from __future__ import annotations

import random

import pytest
import torch

from weightsync.core.layout import Layout, TensorSpec
from weightsync.transports.directory.partial_sums import BucketGeometry, combine, region_sums
from weightsync.transports.directory.slots import bucket_checksums, file_layout, pack_with_checksums


def _split(size: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted(rng.randint(0, size) for _ in range(parts - 1))
    bounds = [0, *cuts, size]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _regions(shape: tuple[int, ...], ranks: int, rng: random.Random) -> list[tuple[tuple[int, int], ...]]:
    """A random tiling of a tensor of ``shape``: one dimension split into ``ranks`` blocks,
    possibly empty or uneven, each further split along another dimension."""
    if not shape:
        return [()]
    dim = rng.randrange(len(shape))
    out = []
    for lo, hi in _split(shape[dim], ranks, rng):
        region = [(0, s) for s in shape]
        region[dim] = (lo, hi)
        second = rng.randrange(len(shape))
        if second != dim and rng.random() < 0.5:
            for lo2, hi2 in _split(shape[second], 2, rng):
                sub = list(region)
                sub[second] = (lo2, hi2)
                out.append(tuple(sub))
        else:
            out.append(tuple(region))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_shares_add_up_to_the_bucket_checksums(seed: int) -> None:
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.float64, torch.uint8, torch.float16]
    specs = []
    for i in range(rng.randint(2, 7)):
        ndim = rng.randint(0, 3)
        shape = tuple(rng.choice([1, 3, 5, 7, 40, 67]) for _ in range(ndim))
        specs.append(TensorSpec(f"t{i}", shape, rng.choice(dtypes)))
    layout = file_layout(Layout(specs))
    data = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)
    geometry = BucketGeometry(layout)
    ranks = rng.randint(1, 4)
    per_rank: list[list] = [[] for _ in range(ranks + 1)]
    for spec in layout.specs:
        for region in _regions(spec.shape, ranks, rng):
            per_rank[rng.randrange(len(per_rank))].append((spec.name, region))
    shares = [region_sums(geometry, data, regions) for regions in per_rank]
    assert combine(shares) == bucket_checksums(layout, data)


def test_many_misaligned_rows_use_column_sums() -> None:
    layout = file_layout(Layout([TensorSpec("w", (301, 37), torch.float16),
                                 TensorSpec("b", (3,), torch.float16)]))
    data = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)
    geometry = BucketGeometry(layout)
    left = [("w", ((0, 301), (0, 11))), ("b", ((0, 3),))]
    right = [("w", ((0, 301), (11, 37)))]
    shares = [region_sums(geometry, data, left), region_sums(geometry, data, right)]
    assert combine(shares) == bucket_checksums(layout, data)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_pack_sums_what_a_second_read_would(dtype) -> None:
    """The commit pack sums each piece right after copying it (cast or not): the same
    checksums as reading the slot again."""
    generator = torch.Generator().manual_seed(3)
    weights = {"a": torch.randn(1_100_001, generator=generator), "b": torch.randn(3, 7, generator=generator),
               "c": torch.randint(0, 9, (13,), dtype=torch.int16, generator=generator)}
    layout = file_layout(Layout([TensorSpec(k, tuple(v.shape), v.dtype) for k, v in weights.items()]), dtype)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    sums = pack_with_checksums(layout, weights, data)
    assert sums == bucket_checksums(layout, data)
    views = layout.tensor_views({"cpu": data})
    assert all(torch.equal(views[k], v.to(views[k].dtype)) for k, v in weights.items())


def test_the_pack_split_across_threads_sums_what_a_second_read_would(monkeypatch) -> None:
    """Buckets of several dtypes, odd sizes, copied and summed on three threads whose
    stretches end inside tensors: the same checksums and bytes as a second read."""
    from weightsync.core import checksum as ck

    monkeypatch.setattr(ck, "PARALLEL_BYTES", 1000)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        generator = torch.Generator().manual_seed(5)
        weights = {"a": torch.randn(70_001, generator=generator).to(torch.bfloat16),
                   "b": torch.randn(3, 7, generator=generator),
                   "c": torch.randint(0, 9, (13,), dtype=torch.int8, generator=generator),
                   "d": torch.randn(5, 4001, generator=generator),
                   "e": torch.randn(3, generator=generator).to(torch.bfloat16)}
        layout = file_layout(Layout([TensorSpec(k, tuple(v.shape), v.dtype) for k, v in weights.items()]))
        data = torch.zeros(layout.nbytes, dtype=torch.uint8)
        sums = pack_with_checksums(layout, weights, data)
        assert len(sums) == len(layout.buckets) > 1
        assert sums == bucket_checksums(layout, data)
        monkeypatch.setattr(ck, "_kernels", lambda: None)
        assert sums == bucket_checksums(layout, data)  # the torch reference's numbers
        views = layout.tensor_views({"cpu": data})
        assert all(torch.equal(views[k], v) for k, v in weights.items())
    finally:
        torch.set_num_threads(before)
