"""The checksum every checksummed path uses (directory slots, Ray chunks, delta rebuilds):
a weighted sum of 32-bit lanes that sees where each lane is.

The bytes are read as unsigned 32-bit little-endian lanes ``u`` (a last partial lane is
zero-padded), cut into blocks of :data:`BLOCK_LANES` lanes at absolute positions::

    H = sum_q m_q * (sum_j u[q, j] * r_j)   mod 2**64

``r_j = fmix32(WEIGHT_SEED + j)`` are fixed, distinct, nonzero 32-bit weights (murmur3's
finaliser, a bijection), ``m_q = splitmix64(BLOCK_SEED + q) | 1``. Since a lane difference
and a weight difference are both below 2**32 in magnitude, their product is nonzero modulo
2**64: a swap of two lanes of one block, a pair ``+x``/``-x`` on two lanes, a flip of one
bit in each of two lanes (the top ones included) always changes ``H``; across blocks the
multipliers catch a swap with high probability. It is linear in the bytes, so the share of
any byte range (:func:`share`) adds up with the others': sharded ranks each sum what they
wrote. It guards against corruption and misplaced writes, not against someone who can
write the bytes and their checksum (that is the token's job).

With numba (``core.checksum_kernels``) the sum runs as a vectorised kernel, a large range
split across torch's thread count, and a copy can be fused with it (:func:`copy_shares`:
each lane summed as it is copied, the directory's commit pack); without numba, or for
tensors outside the CPU (NCCL chunks), the same numbers come from torch (slower).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync.core.errors import IntegrityError

logger = logging.getLogger(__name__)

#: the name a manifest or header records for this function
CHECKSUM_ID = "lane32-weighted-v1"
#: the functions a reader of this version can verify
SUPPORTED = (CHECKSUM_ID,)
#: lanes (4 bytes each) per block: swaps inside a block (256 KiB) are always caught. Its
#: weights (256 KiB) stay in a core's L2 cache: a 4 MiB piece just written is summed at
#: ~20 GB/s, against ~13 GB/s with 2**20 lanes, whose weights spill to L3
BLOCK_LANES = 1 << 16
#: bytes below which a sum stays on the calling thread (above it, split across threads)
PARALLEL_BYTES = 1 << 20
WEIGHT_SEED = 0x57534E43  # "WSNC"; WEIGHT_SEED + j never wraps to 0 for j < BLOCK_LANES
BLOCK_SEED = 0x4E43424C4F434B53  # "NCBLOCKS"

_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def check_function(found: Any, where: str) -> None:
    """IntegrityError naming ``where`` unless ``found`` names a checksum this reader knows
    (a manifest or header written by a newer, or an older, weightsync)."""
    if found not in SUPPORTED:
        what = "no checksum function" if found is None else f"checksum function {found!r}"
        raise IntegrityError(
            f"{where} records {what}; this weightsync verifies {', '.join(SUPPORTED)}: the writer "
            "runs another weightsync version (upgrade both ends to the same one)"
        )


def splitmix64(value: int) -> int:
    """One step of splitmix64 (the generator the weights and multipliers come from)."""
    z = (value + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


def block_multiplier(block: int) -> int:
    """The odd multiplier ``m_q`` of block ``block``."""
    return splitmix64((BLOCK_SEED + block) & _MASK) | 1


def fmix32(value: int) -> int:
    """murmur3's 32-bit finaliser: a bijection of 32-bit values (each step is invertible)."""
    value ^= value >> 16
    value = (value * 0x85EBCA6B) & 0xFFFFFFFF
    value ^= value >> 13
    value = (value * 0xC2B2AE35) & 0xFFFFFFFF
    return value ^ (value >> 16)


@functools.cache
def weights() -> torch.Tensor:
    """The :data:`BLOCK_LANES` weights ``r_j = fmix32(WEIGHT_SEED + j)`` as int64: distinct
    (fmix32 is a bijection) and nonzero (only fmix32(0) is 0, and the seed skips it)."""
    z = torch.arange(WEIGHT_SEED, WEIGHT_SEED + BLOCK_LANES, dtype=torch.int64)
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & 0xFFFFFFFF  # products stay below 2**63
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & 0xFFFFFFFF
    return (z ^ (z >> 16)).contiguous()


@functools.cache
def _weights_on(device: torch.device) -> torch.Tensor:
    return weights().to(device)


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any] | None:
    """The numba kernels (range, strided), the weights as a uint32 array and the fused
    copy kernel, or None
    without numba (then torch computes the same numbers)."""
    try:
        import numpy as np

        from weightsync.core import checksum_kernels
    except ImportError:
        return None
    try:
        lanes = weights().to(torch.int32).numpy().view(np.uint32)
        raw = np.zeros(16, dtype=np.uint8)  # compile now, not inside the first timed sum
        checksum_kernels.range_share(raw, 1, 15, 3, lanes, BLOCK_LANES, BLOCK_SEED)
        checksum_kernels.strided_share(raw, 1, 2, 7, 3, lanes, BLOCK_LANES, BLOCK_SEED)
        checksum_kernels.copy_share(raw[:7], raw[8:15], 3, lanes, BLOCK_LANES, BLOCK_SEED)
        return (checksum_kernels.range_share, checksum_kernels.strided_share, lanes,
                checksum_kernels.copy_share)
    except Exception as exc:  # pragma: no cover - a numba that cannot compile here
        logger.warning("numba cannot compile the checksum kernels (%s): using torch", exc)
        return None


def accelerated() -> bool:
    """True if CPU checksums run as numba kernels here."""
    return _kernels() is not None


def warm_up_in_background() -> None:
    """Load the kernels (compiled once per machine, loaded once per process: 0.5-2 s) on a
    thread now, so that a receiver's first verified version does not wait for them."""
    if _kernels.cache_info().currsize == 0:
        threading.Thread(target=_kernels, daemon=True, name="weightsync-warm-checksums").start()


def _bytes_of(buffer: torch.Tensor) -> torch.Tensor:
    """The bytes of ``buffer`` as a flat uint8 tensor (outside autograd)."""
    flat = buffer.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _byte_terms(data: torch.Tensor, position: int) -> int:
    """What a few bytes at absolute byte ``position`` add (the edges of a range)."""
    total = 0
    table = weights()
    for offset, byte in enumerate(data.tolist()):
        lane = (position + offset) // 4
        shifted = byte << (8 * ((position + offset) % 4))
        total += shifted * int(table[lane % BLOCK_LANES]) * block_multiplier(lane // BLOCK_LANES)
    return total & _MASK


#: whole blocks summed at once by the torch form (a 32 MiB int64 temporary)
_TORCH_BLOCKS = 64


def _block_sum_torch(lanes: torch.Tensor, table: torch.Tensor, block: int) -> int:
    """One (partial) block: ``table`` holds the weights of its lanes."""
    inner = int(((lanes.to(torch.int64) & 0xFFFFFFFF) * table).sum()) & _MASK
    return inner * block_multiplier(block)


def _lanes_torch(data: torch.Tensor, first_lane: int) -> int:
    """What the whole lanes of ``data`` (uint8, a multiple of 4 bytes) add at absolute lane
    ``first_lane``, in torch (int64 products and sums wrap as uint64 would): a partial
    block at each end, whole blocks many at a time (one device sync per group)."""
    if data.storage_offset() % 4:
        data = data.clone()
    lanes = data.view(torch.int32)
    table = _weights_on(lanes.device)
    n, total = lanes.numel(), 0
    block, j = divmod(first_lane, BLOCK_LANES)
    done = min(n, (BLOCK_LANES - j) % BLOCK_LANES)
    if done:
        total += _block_sum_torch(lanes[:done], table[j:j + done], block)
        block += 1
    while n - done >= BLOCK_LANES:
        count = min(_TORCH_BLOCKS, (n - done) // BLOCK_LANES)
        group = lanes[done:done + count * BLOCK_LANES].view(count, BLOCK_LANES)
        inner = ((group.to(torch.int64) & 0xFFFFFFFF) * table).sum(dim=1)
        factors = torch.tensor([_signed(block_multiplier(block + q)) for q in range(count)],
                               dtype=torch.int64, device=lanes.device)
        total += int((inner * factors).sum())
        done += count * BLOCK_LANES
        block += count
    if done < n:
        total += _block_sum_torch(lanes[done:], table[:n - done], block)
    return total & _MASK


def _signed(value: int) -> int:
    """A uint64 as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def torch_share(data: torch.Tensor, position: int = 0) -> int:
    """:func:`share` computed in torch (any device; the reference without numba)."""
    raw = _bytes_of(data)
    n = raw.numel()
    head = min((-position) % 4, n)
    whole = (n - head) // 4 * 4
    total = _byte_terms(raw[:head], position) if head else 0
    if whole:
        total += _lanes_torch(raw[head:head + whole], (position + head) // 4)
    if head + whole < n:
        total += _byte_terms(raw[head + whole:], position + head + whole)
    return total & _MASK


def _threads(nbytes: int) -> int:
    """Threads for a sum of ``nbytes``: torch's thread count (the copies before it use as
    many), at most one per :data:`PARALLEL_BYTES`."""
    return max(1, min(torch.get_num_threads(), nbytes // PARALLEL_BYTES))


def share(data: torch.Tensor, position: int = 0, *, parallel: bool = True) -> int:
    """What the bytes of ``data`` add to the checksum of a buffer in which they lie at
    byte ``position``: shares of disjoint ranges add up (mod 2**64) to the whole's. A
    large range is summed on several threads (the kernel releases the GIL) unless
    ``parallel`` is False (a piece just written, still in this thread's cache)."""
    return shares([(data, position)], parallel=parallel)[0]


def shares(pieces: Sequence[tuple[torch.Tensor, int]], *, parallel: bool = True) -> list[int]:
    """:func:`share` of each ``(data, position)``, all the pieces' bytes cut into one
    stretch per thread (a reader's verify of many buckets, small or large, in one go)."""
    raws = [_bytes_of(data) for data, _ in pieces]
    kernels = _kernels()
    if kernels is None or any(raw.device.type != "cpu" for raw in raws):
        return [_share_here(raw, position) for raw, (_, position) in zip(raws, pieces, strict=True)]
    range_kernel, _, lanes, _ = kernels
    arrays = [raw.numpy() for raw in raws]
    positions = [position for _, position in pieces]

    def part(item: int, lo: int, hi: int) -> int:
        return int(range_kernel(arrays[item], lo, hi, positions[item] + lo, lanes, BLOCK_LANES,
                                BLOCK_SEED))

    sizes = [array.shape[0] for array in arrays]
    return _spread(sizes, part, _threads(sum(sizes)) if parallel else 1)


def _share_here(raw: torch.Tensor, position: int) -> int:
    """:func:`share` of one piece on the calling thread (torch outside the CPU or without
    numba)."""
    kernels = _kernels() if raw.device.type == "cpu" else None
    if kernels is None:
        return torch_share(raw, position)
    range_kernel, _, lanes, _ = kernels
    array = _bytes_of(raw).numpy()
    return int(range_kernel(array, 0, array.shape[0], position, lanes, BLOCK_LANES, BLOCK_SEED))


#: bytes a copy that cannot be fused (a cast, a GPU source) writes before it sums them,
#: while they are still in cache
COPY_PIECE_BYTES = 4 << 20


def copy_shares(pieces: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> list[int]:
    """Copy each ``source`` into ``target`` (``target.copy_(source)``: the same shape, a
    cast where the dtypes differ) and return the :func:`share` of ``target``'s bytes at
    byte ``position``, for each ``(source, target, position)``.

    Where numba is here and a source is a CPU tensor of its target's dtype, one kernel
    copies and sums each lane while it is in a register (one read of the source, one
    write of the target), all the pieces' bytes cut into one stretch per thread (torch's
    thread count). Anything else (a cast, a GPU tensor) is copied by torch in
    :data:`COPY_PIECE_BYTES` pieces, each summed right after it is written."""
    kernels = _kernels()
    results = [0] * len(pieces)
    fused: list[int] = []
    for index, (source, target, position) in enumerate(pieces):
        if kernels is not None and _fusable(source, target):
            fused.append(index)
        else:
            results[index] = _copy_then_share(source, target, position)
    if not fused or kernels is None:
        return results
    _, _, lanes, copy_kernel = kernels
    sources = [_bytes_of(pieces[i][0]).numpy() for i in fused]
    targets = [_bytes_of(pieces[i][1]).numpy() for i in fused]
    positions = [pieces[i][2] for i in fused]

    def part(item: int, lo: int, hi: int) -> int:
        return int(copy_kernel(sources[item][lo:hi], targets[item][lo:hi], positions[item] + lo,
                               lanes, BLOCK_LANES, BLOCK_SEED))

    sizes = [array.shape[0] for array in sources]
    for index, value in zip(fused, _spread(sizes, part, _threads(sum(sizes))), strict=True):
        results[index] = value
    return results


def _fusable(source: torch.Tensor, target: torch.Tensor) -> bool:
    """True if the fused kernel can copy ``source`` into ``target`` byte for byte."""
    return (source.device.type == "cpu" and target.device.type == "cpu"
            and source.dtype == target.dtype and source.shape == target.shape
            and source.layout == torch.strided and source.is_contiguous()
            and target.is_contiguous() and not source.is_conj() and not source.is_neg())


def _copy_then_share(source: torch.Tensor, target: torch.Tensor, position: int) -> int:
    """Copy ``source`` into ``target`` with torch, piece by piece, each piece summed right
    after it is written (still in cache)."""
    if not target.is_contiguous():
        raise ValueError("copy_shares writes into contiguous targets only")
    flat_target, flat_source = target.reshape(-1), source.reshape(-1)
    step = max(1, COPY_PIECE_BYTES // max(1, flat_target.element_size()))
    total, written = 0, 0
    for start in range(0, flat_target.numel(), step):
        piece = flat_target[start : start + step]
        piece.copy_(flat_source[start : start + step])
        size = piece.numel() * piece.element_size()
        total += _share_here(_bytes_of(piece), position + written)
        written += size
    return total & _MASK


#: the most bytes a thread takes at a time from a spread sum: small enough that a thread
#: which starts late or runs slow (its core busy, e.g. with torch's workers spinning after
#: an op) leaves the rest of its share to the others, large enough that a call's overhead
#: is nothing
STRETCH_BYTES = 4 << 20


def _spread(sizes: Sequence[int], part: Callable[[int, int, int], int], parts: int) -> list[int]:
    """``part(item, lo, hi)`` over bytes ``lo..hi`` of items of ``sizes`` on ``parts``
    threads (the caller's among them), each item's total (mod 2**64). All the items' bytes
    are cut into stretches (:data:`STRETCH_BYTES` at most, one per thread if smaller) that
    the threads take in turn until none is left, so a thread that starts late does less. A
    stretch may cover the end of one item and the start of the next: each gets its own
    range (positions are absolute, so any cut adds up)."""
    results = [0] * len(sizes)
    total = sum(sizes)
    if parts <= 1 or total == 0:
        for item, size in enumerate(sizes):
            if size:
                results[item] = int(part(item, 0, size)) & _MASK
        return results
    starts = list(itertools.accumulate(sizes, initial=0))
    stretch = max(64, min(STRETCH_BYTES, total // parts // 64 * 64))
    cuts = [*range(0, total, stretch), total]
    parts = min(parts, len(cuts) - 1)
    taken, lock = itertools.count(), threading.Lock()  # each stretch is taken once
    partial: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    errors: list[BaseException] = []

    def take() -> int:
        with lock:
            return next(taken)

    def run(k: int) -> None:
        try:
            while not errors and (index := take()) < len(cuts) - 1:
                lo, hi = cuts[index], cuts[index + 1]
                item = bisect.bisect_right(starts, lo) - 1
                while lo < hi and item < len(sizes):
                    end = min(hi, starts[item + 1])
                    if end > lo:
                        partial[k].append((item, int(part(item, lo - starts[item],
                                                          end - starts[item]))))
                    lo = end
                    item += 1
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    # threads of this call only, joined before it returns: nothing outlives a checksum
    # (a pool would leave threads behind every close(), and forks would inherit none)
    threads = [threading.Thread(target=run, args=(k,), name="weightsync-checksum", daemon=True)
               for k in range(1, parts)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    for found in partial:
        for item, value in found:
            results[item] += value
    return [value & _MASK for value in results]


def checksum(data: torch.Tensor) -> int:
    """The checksum of a buffer (a contiguous tensor, read as its bytes)."""
    return share(data, 0)


def range_share(raw: torch.Tensor, start: int, stop: int) -> int:
    """The share of bytes ``start..stop`` of the buffer ``raw`` (at their own positions)."""
    return share(_bytes_of(raw)[start:stop], start)


def strided_share(raw: torch.Tensor, start: int, rows: int, stride: int, width: int) -> int:
    """The share of ``rows`` ranges of ``width`` bytes every ``stride`` bytes from ``start``
    of the buffer ``raw``, each at its own position: the block a rank writes of a tensor."""
    data = _bytes_of(raw)
    kernels = _kernels() if data.device.type == "cpu" else None
    if kernels is None:
        return sum(range_share(data, start + k * stride, start + k * stride + width)
                   for k in range(rows)) & _MASK
    _, strided_kernel, lanes, _ = kernels
    return int(strided_kernel(data.numpy(), start, rows, stride, width, lanes, BLOCK_LANES,
                              BLOCK_SEED))


def combine(shares: Sequence[int]) -> int:
    """The checksum of a buffer from the shares of ranges that cover it once each."""
    return sum(shares) & _MASK
