"""The position-weighted checksum (core.checksum): what it always catches, shares that add
up wherever ranges start and end, and the numba kernels giving the torch reference's numbers."""

from __future__ import annotations

import itertools
import random
import threading
import time

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


def test_a_thread_that_starts_late_leaves_its_stretches_to_the_others(monkeypatch):
    """Threads take stretches in turn: a helper held back (as by a core still busy with
    torch's workers after an op) does less, the caller more, and every item still gets its
    own total (with one stretch per thread, the caller waited for the helper's half)."""
    monkeypatch.setattr(ck, "STRETCH_BYTES", 64)
    sizes, caller = [100, 3, 797, 380], threading.get_ident()
    done: list[tuple[bool, int, int, int]] = []
    release = threading.Event()

    def part(item: int, lo: int, hi: int) -> int:
        if threading.get_ident() != caller:
            release.wait(10)  # the helper starts only once the caller took every stretch
        done.append((threading.get_ident() == caller, item, lo, hi))
        if len([d for d in done if d[0]]) >= 19:
            release.set()
        return (item + 1) * (hi - lo)

    assert ck._spread(sizes, part, 2) == [(item + 1) * size for item, size in enumerate(sizes)]
    by_caller = sum(hi - lo for mine, _, lo, hi in done if mine)
    assert by_caller >= sum(sizes) - 64, done  # the helper took one stretch at most
    covered = sorted((item, lo, hi) for _, item, lo, hi in done)
    for item, size in enumerate(sizes):  # each item's bytes once, none twice
        ranges = [(lo, hi) for i, lo, hi in covered if i == item]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_an_error_on_a_helper_stops_the_others_and_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(ck, "STRETCH_BYTES", 64)
    caller, calls, failed = threading.get_ident(), [], threading.Event()

    def part(item: int, lo: int, hi: int) -> int:
        calls.append(lo)
        if threading.get_ident() != caller:
            failed.set()
            raise IntegrityError("helper failed")
        failed.wait(10)  # the caller's stretches end once the helper has failed (and the
        time.sleep(0.05)  # helper had time to record it)
        return 0

    with pytest.raises(IntegrityError, match="helper failed"):
        ck._spread([64 * 200], part, 2)
    assert len(calls) < 10  # the caller stopped taking stretches (200 in all)


@pytest.mark.parametrize("threads", [2, 3])
def test_many_stretches_across_threads_give_the_same_numbers(monkeypatch, threads):
    """Stretches of 640 bytes (cut inside lanes, weights' blocks and pieces), taken by
    threads in turn: the sum and the fused copy give the reference's numbers."""
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(ck, "PARALLEL_BYTES", 4096)
    monkeypatch.setattr(ck, "STRETCH_BYTES", 640)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = _random(2 * ck.BLOCK_LANES + 4099, threads)
        for start, position in ((0, 0), (3, 4 * ck.BLOCK_LANES - 2)):
            assert ck.share(data[start:], position) == ck.torch_share(data[start:], position)
        pieces = [(_random(n, n), torch.zeros(n, dtype=torch.uint8), position)
                  for n, position in ((5001, 3), (77, 0), (ck.BLOCK_LANES + 13, 9))]
        expected = [ck.torch_share(source, position) for source, _, position in pieces]
        assert ck.copy_shares(pieces) == expected
        assert all(torch.equal(source, target) for source, target, _ in pieces)
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


def _pair(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        source = torch.randn(n, generator=generator).to(dtype)
    else:
        source = torch.randint(0, 100, (n,), dtype=dtype, generator=generator)
    return source, torch.zeros_like(source)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.uint8,
                                   torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 4099, 4 * ck.BLOCK_LANES + 3])
def test_fused_copy_gives_the_reference_numbers(backend, dtype, n):
    """copy_shares copies byte for byte and gives the reference share of what it wrote,
    at any position, for 1-byte and 2-byte tails and a range across a block boundary."""
    for offset, position in ((0, 0), (1, 5), (3, 4 * ck.BLOCK_LANES - 6), (2, 2)):
        source, target = _pair(dtype, n + offset, n + offset)
        (value,) = ck.copy_shares([(source[offset:], target[offset:], position)])
        assert torch.equal(target[offset:], source[offset:])
        assert not target[:offset].any()
        raw = target[offset:].view(torch.uint8)
        assert value == ck.torch_share(raw, position)
        if n <= 4099:
            assert value == _reference(raw.tolist(), position)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_fused_copy_across_threads_adds_up_per_piece(monkeypatch, threads):
    """Many pieces, their bytes cut into stretches that end inside pieces and lanes: each
    piece's share is the reference's, whatever thread summed which part of it."""
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(ck, "PARALLEL_BYTES", 1000)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(threads)
        pieces, expected = [], []
        for k in range(9):
            dtype = rng.choice([torch.bfloat16, torch.float32, torch.int8])
            source, target = _pair(dtype, rng.choice([1, 3, 999, 5000, ck.BLOCK_LANES + 1]), k)
            position = rng.randrange(4 * ck.BLOCK_LANES)
            pieces.append((source, target, position))
            expected.append(ck.torch_share(source.view(torch.uint8), position))
        assert ck.copy_shares(pieces) == expected
        assert all(torch.equal(source, target) for source, target, _ in pieces)
        assert ck.shares([(target, position) for _, target, position in pieces]) == expected
    finally:
        torch.set_num_threads(before)


def test_fused_copy_shares_of_a_split_buffer_add_up_to_its_checksum():
    """A buffer copied in parts (the pieces sharded ranks write) sums to its checksum."""
    source = _random(3 * 4 * ck.BLOCK_LANES + 11, 4)
    target = torch.zeros_like(source)
    cuts = [0, 1, 7, 4 * ck.BLOCK_LANES - 2, 9 * ck.BLOCK_LANES + 1, source.numel()]
    parts = [(source[lo:hi], target[lo:hi], lo) for lo, hi in itertools.pairwise(cuts)]
    assert ck.combine(ck.copy_shares(parts)) == ck.checksum(source)
    assert torch.equal(source, target)


def test_a_cast_or_a_strided_source_is_copied_by_torch_with_the_same_numbers():
    source = torch.randn(3000, 7)
    target = torch.zeros(7, 3000, dtype=torch.bfloat16)
    transposed = torch.zeros(7, 3000)
    values = ck.copy_shares([(source.t(), target, 3), (source.t(), transposed, 1)])
    assert torch.equal(target, source.t().to(torch.bfloat16))
    assert torch.equal(transposed, source.t())
    assert values == [ck.torch_share(target.view(torch.uint8).reshape(-1), 3),
                      ck.torch_share(transposed.view(torch.uint8).reshape(-1), 1)]


def test_sums_and_the_fused_copy_take_tensors_that_require_grad():
    source = torch.randn(1000, requires_grad=True)
    target = torch.zeros(1000)
    assert ck.copy_shares([(source, target, 0)]) == [ck.checksum(source.detach())]
    assert torch.equal(target, source.detach())
    assert ck.share(source, 3) == ck.torch_share(source.detach(), 3)


@pytest.mark.parametrize("first_lane", [0, 1, 2, 3, ck.BLOCK_LANES - 3, ck.BLOCK_LANES - 2,
                                        ck.BLOCK_LANES - 1, 3 * ck.BLOCK_LANES + 1])
def test_kernels_pair_lanes_with_their_own_weights(first_lane):
    """The kernels read lanes and weights two at a time (uint64 words): a run starting at
    an odd weight index (its first lane alone), of odd length (its last alone), ending on
    or across a block boundary, from any byte address, gives the torch numbers, summed and
    fused with the copy alike."""
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    position = 4 * first_lane
    data = _random(4 * (2 * ck.BLOCK_LANES + 16) + 8, first_lane)
    for lanes in (1, 2, 3, 4, 5, 6, 7, ck.BLOCK_LANES - 1, ck.BLOCK_LANES, ck.BLOCK_LANES + 3):
        for address in (0, 4, 1, 2, 7):  # uint64 views of the data at every alignment
            piece = data[address:address + 4 * lanes]
            expected = ck.torch_share(piece, position)
            assert ck.share(piece, position, parallel=False) == expected, (lanes, address)
            target = torch.zeros(piece.numel() + 8, dtype=torch.uint8)[address:address + piece.numel()]
            assert ck.copy_shares([(piece, target, position)]) == [expected], (lanes, address)
            assert torch.equal(target, piece)
            if lanes <= 7:
                assert expected == _reference(piece.tolist(), position)


@pytest.mark.parametrize("position", [0, 1, 4 * ck.BLOCK_LANES - 4, 4 * 3 * ck.BLOCK_LANES,
                                      4 * 5 * ck.BLOCK_LANES + 6])
def test_sums_of_many_whole_blocks_give_the_torch_numbers(position):
    """The sum kernel takes several whole blocks at a time (weights chunk by chunk against
    each block): groups at any block number, after a partial block, from any byte address,
    with partial blocks after them, give the torch numbers."""
    if not ck.accelerated():
        pytest.skip("numba is not installed")
    data = _random(4 * 18 * ck.BLOCK_LANES + 16, position)
    for address, size in ((0, 4 * 8 * ck.BLOCK_LANES), (4, 4 * 9 * ck.BLOCK_LANES + 3),
                          (1, 4 * 17 * ck.BLOCK_LANES + 5)):
        piece = data[address:address + size]
        assert ck.share(piece, position, parallel=False) == ck.torch_share(piece, position), address


def test_the_kernels_load_on_a_thread_ahead_of_the_first_sum():
    """A receiver starts loading them when it learns its layout (a fresh process: the
    kernels are not loaded yet); the caller goes on at once."""
    import subprocess
    import sys

    pytest.importorskip("numba")
    code = (
        "import threading, time\n"
        "from weightsync.core import checksum as ck\n"
        "ck.warm_up_in_background()\n"
        "names = [t.name for t in threading.enumerate()]\n"
        "give_up = time.monotonic() + 60\n"
        "while ck._kernels.cache_info().currsize == 0 and time.monotonic() < give_up:\n"
        "    time.sleep(0.01)\n"
        "print('weightsync-warm-checksums' in names, ck.accelerated())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stdout
