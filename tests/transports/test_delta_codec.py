"""The Ray transport's delta codec on its own: every kind round-trips exactly, and a
corrupted delta is refused rather than decoded into wrong bytes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("zstandard")

from weightsync.transports.delta import sparse as delta_sparse
from weightsync.transports.delta.codec import (
    DELTA,
    SAME,
    SPARSE,
    WHOLE,
    DeltaDecoder,
    DeltaEncoder,
    unchanged_fraction,
)


def bf16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.uint8).clone()


@pytest.mark.parametrize("extra", [0, 3])  # a chunk that does not end on a word
def test_kinds_round_trip(extra):
    torch.manual_seed(0)
    weights = torch.randn(100_000) * 0.02
    base = torch.cat([bf16_bytes(weights), torch.arange(extra, dtype=torch.uint8)])
    small = torch.cat([bf16_bytes(weights + 1e-6 * torch.randn_like(weights).sign()),
                       torch.arange(extra, dtype=torch.uint8)])
    large = torch.cat([bf16_bytes(weights * 1.7 + 0.01), torch.arange(extra, dtype=torch.uint8)])
    encoder, decoder = DeltaEncoder(sparse=False), DeltaDecoder()
    for new, kind in ((base.clone(), SAME), (small, DELTA), (large, WHOLE)):
        got, payload = encoder.encode(new, base)
        assert got == kind
        out = torch.empty_like(new)
        if kind == WHOLE:
            assert payload.data_ptr() == new.data_ptr()
            continue
        decoder.decode(kind, payload.clone(), base, out)
        assert torch.equal(out, new)
    kind, payload = encoder.encode(small, base)
    assert payload.numel() < 0.2 * small.numel()


def test_corrupted_delta_is_refused():
    torch.manual_seed(1)
    weights = torch.randn(50_000) * 0.02
    base = bf16_bytes(weights)
    new = bf16_bytes(weights + 1e-6 * torch.randn_like(weights).sign())
    kind, payload = DeltaEncoder(sparse=False).encode(new, base)
    assert kind == DELTA
    broken = payload[: payload.numel() // 2].clone()
    with pytest.raises(ValueError):
        DeltaDecoder().decode(DELTA, broken, base, torch.empty_like(new))


def test_unchanged_fraction():
    a = torch.zeros(10, dtype=torch.bfloat16)
    b = a.clone()
    b[:3] = 1.0
    assert unchanged_fraction(b, a) == pytest.approx(0.7)


needs_numba = pytest.mark.skipif(not delta_sparse.available(), reason="numba not installed")


def small_step(n: int, seed: int, scale: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new): bf16 chunks of ``n`` weights before and after a small step."""
    torch.manual_seed(seed)
    weights = torch.randn(n) * 0.02
    return bf16_bytes(weights), bf16_bytes(weights + scale * torch.randn_like(weights).sign())


@needs_numba
def test_sparse_round_trips_with_numba_and_numpy():
    base, new = small_step(100_000, 2)
    new[-2:] = base[-2:] ^ 0xFF  # the last word changes in both bytes (a 3-byte varint)
    new[:2] = base[:2] ^ 0x01  # and the first
    kind, payload = DeltaEncoder().encode(new, base)
    assert kind == SPARSE and payload.numel() < 0.2 * new.numel()
    out = torch.empty_like(new)
    DeltaDecoder().decode(SPARSE, payload, base, out)
    assert torch.equal(out, new)
    out16 = base.clone()
    delta_sparse.decode_numpy(payload.numpy(), out16.view(torch.int16).numpy().view("uint16"))
    assert torch.equal(out16, new)  # a receiver without numba rebuilds the same bytes


@needs_numba
def test_sparse_gives_way_to_zstd_and_whole():
    torch.manual_seed(3)
    base = bf16_bytes(torch.randn(40_000) * 0.02)
    assert DeltaEncoder().encode(base.clone(), base)[0] == SAME
    many = base.clone()
    many.view(torch.int16)[::4] ^= 0x100  # 3 bytes for each 4th word: over SPARSE_MAX_RATIO
    kind, payload = DeltaEncoder().encode(many, base)
    assert kind == DELTA
    out = torch.empty_like(many)
    DeltaDecoder().decode(kind, payload, base, out)
    assert torch.equal(out, many)
    old, new = small_step(20_002, 5)  # 40004 bytes, not a multiple of 8: zstd
    assert DeltaEncoder().encode(new, old)[0] == DELTA


@needs_numba
@pytest.mark.parametrize("cut", ["truncated", "past the end", "zero xor"])
def test_malformed_sparse_is_refused(cut):
    base, new = small_step(20_000, 4)
    kind, payload = DeltaEncoder().encode(new, base)
    assert kind == SPARSE
    if cut == "truncated":
        broken = torch.cat([payload, torch.tensor([0x85], dtype=torch.uint8)])
    elif cut == "past the end":
        broken = torch.cat([payload, torch.tensor([0xFF, 0xFF, 0x7F, 1], dtype=torch.uint8)])
    else:
        broken = torch.cat([payload, torch.tensor([0, 0], dtype=torch.uint8)])
    with pytest.raises(ValueError):
        DeltaDecoder().decode(SPARSE, broken, base, torch.empty_like(new))
    with pytest.raises(ValueError):
        delta_sparse.decode_numpy(broken.numpy(), base.clone().view(torch.int16).numpy()
                                  .view("uint16"))
