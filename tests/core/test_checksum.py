"""The position-weighted checksum (core.checksum): what it always catches, shares that add
up wherever ranges start and end, and the numba kernels giving the torch reference's numbers."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from slot_damage import KINDS, NEEDS, damage_tensor

from weightsync.core import checksum as ck
from weightsync.core.errors import IntegrityError

_MASK = (1 << 64) - 1


def _reference(data: bytes, position: int = 0) -> int:
    """The definition, byte by byte in Python."""
    table = ck.weights().tolist()
    total = 0
    for offset, byte in enumerate(data):
        lane = (position + offset) // 4
        total += (byte << 8 * ((position + offset) % 4)) * table[lane % ck.BLOCK_LANES] \
            * ck.block_multiplier(lane // ck.BLOCK_LANES)
    return total & _MASK


def _random(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["numba", "torch"])
def backend(request, monkeypatch):
    """Run a test with the numba kernels, and again with the torch fallback only."""
    if request.param == "numba":
        if not ck.accelerated():
            pytest.skip("numba is not installed")
    else:
        monkeypatch.setattr(ck, "_kernels", lambda: None)
    return request.param


def test_weights_are_distinct_nonzero_32_bit_and_fixed():
    table = ck.weights()
    assert table.numel() == ck.BLOCK_LANES
    assert int(table.min()) > 0 and int(table.max()) < 1 << 32
    assert table.unique().numel() == ck.BLOCK_LANES
    # the function is named in manifests: its numbers never change under the same name
    assert ck.CHECKSUM_ID == "lane32-weighted-v1"
    assert table[:3].tolist() == [763030490, 3956048596, 2860626181]
    assert table[-1] == ck.fmix32(ck.WEIGHT_SEED + ck.BLOCK_LANES - 1)
    assert ck.checksum(torch.arange(256, dtype=torch.uint8)) == 5922382701733650060
    three_blocks = torch.arange(ck.BLOCK_LANES + 3, dtype=torch.int64)
    assert ck.checksum(three_blocks) == 13187116910489401357


@pytest.mark.parametrize(("n", "position"), [(0, 0), (1, 0), (3, 5), (17, 3), (1001, 2),
                                             (4099, 4 * ck.BLOCK_LANES - 7)])
def test_matches_its_definition(backend, n, position):
    data = _random(n, n)
    assert ck.share(data, position) == _reference(data.tolist(), position)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 4096, 10_001, 4 * ck.BLOCK_LANES + 13])
def test_numba_gives_the_torch_numbers(n):
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    data = _random(n, n)
    for start in (0, 1, 2, 3):
        piece = data[start:]
        for position in (0, start, 4 * ck.BLOCK_LANES - 5):
            assert ck.share(piece, position) == ck.torch_share(piece, position)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_sum_split_across_threads_gives_the_same_number(monkeypatch, threads):
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(ck, "PARALLEL_BYTES", 4096)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = _random(5 * ck.BLOCK_LANES + 4099, threads)
        for start, position in ((0, 0), (1, 1), (3, 4 * ck.BLOCK_LANES - 2), (2, 7)):
            assert ck.share(data[start:], position) == ck.torch_share(data[start:], position)
    finally:
        torch.set_num_threads(before)


def test_strided_shares_match_the_torch_numbers(monkeypatch):
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    data = _random(50_000, 7)
    cases = [(1, 37, 101, 29), (0, 200, 240, 240), (3, 64, 96, 17), (5, 1, 9, 9)]
    fast = [ck.strided_share(data, *case) for case in cases]
    monkeypatch.setattr(ck, "_kernels", lambda: None)
    assert fast == [ck.strided_share(data, *case) for case in cases]


@pytest.mark.parametrize("seed", range(6))
def test_shares_of_any_ranges_add_up(backend, seed):
    rng = random.Random(seed)
    n = rng.choice([7, 4096 + 3, 70_001, 4 * ck.BLOCK_LANES + 999])
    data = _random(n, seed)
    cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randint(1, 9)))})
    shares = [ck.range_share(data, lo, hi) for lo, hi in itertools.pairwise(cuts)]
    assert ck.combine(shares) == ck.checksum(data)


@pytest.mark.parametrize("kind", KINDS)
def test_damage_a_word_sum_misses_is_caught(backend, kind):
    for start in (0, 1, 4 * ck.BLOCK_LANES - 6000):
        data = _random(start + NEEDS + 5, 11)
        before = ck.checksum(data)
        damage_tensor(data, kind, start)
        assert ck.checksum(data) != before, (kind, start)


def test_any_swap_of_two_lanes_of_a_block_is_caught():
    data = _random(4 * 4096, 3)
    before = ck.checksum(data)
    lanes = data.view(torch.int32)
    rng = random.Random(0)
    for _ in range(300):
        i, j = rng.sample(range(lanes.numel()), 2)
        if lanes[i] == lanes[j]:
            continue
        swapped = lanes.clone()
        swapped[i], swapped[j] = lanes[j], lanes[i]
        assert ck.checksum(swapped) != before


def test_compensating_lane_pairs_and_top_bit_pairs_are_caught():
    zeros = torch.zeros(4096, dtype=torch.int64)
    base = ck.checksum(zeros)
    rng = random.Random(1)
    for _ in range(200):
        i, j = rng.sample(range(zeros.numel() * 2), 2)
        lanes = zeros.clone().view(torch.int32)
        x = rng.randrange(1, 1 << 31)
        lanes[i], lanes[j] = x, -x  # +x and -x mod 2**32
        assert ck.checksum(lanes) != base
        lanes = zeros.clone().view(torch.int32)
        lanes[i], lanes[j] = -(1 << 31), -(1 << 31)  # the top bit of each
        assert ck.checksum(lanes) != base


def test_swaps_across_blocks_and_rotations_are_caught():
    data = _random(3 * 4 * ck.BLOCK_LANES, 5)
    before = ck.checksum(data)
    lanes = data.view(torch.int32)
    swapped = lanes.clone()
    far = 2 * ck.BLOCK_LANES + 17
    swapped[17], swapped[far] = lanes[far], lanes[17]
    assert ck.checksum(swapped) != before
    blocks = lanes.clone().view(3, -1)
    assert ck.checksum(blocks[[1, 0, 2]].contiguous()) != before  # two whole blocks swapped
    assert ck.checksum(torch.roll(lanes, 1)) != before  # every lane one place on
    words = data.view(torch.int64)
    rotated = (words << 8) | ((words >> 56) & 0xFF)  # every word rotated by a byte
    assert ck.checksum(rotated) != before


def test_unknown_or_missing_function_names_are_refused():
    ck.check_function(ck.CHECKSUM_ID, "here")
    with pytest.raises(IntegrityError, match="records checksum function 'lane32-weighted-v9'.*"
                                             "verifies lane32-weighted-v1"):
        ck.check_function("lane32-weighted-v9", "manifest.json")
    with pytest.raises(IntegrityError, match="records no checksum function"):
        ck.check_function(None, "manifest.json")
