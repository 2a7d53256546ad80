"""The Ray transport's delta codec on its own: every kind round-trips exactly, and a
corrupted delta is refused rather than decoded into wrong bytes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("zstandard")

from weightsync.transports.ray.delta import (
    DELTA,
    SAME,
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
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
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
    kind, payload = DeltaEncoder().encode(new, base)
    assert kind == DELTA
    broken = payload[: payload.numel() // 2].clone()
    with pytest.raises(ValueError):
        DeltaDecoder().decode(DELTA, broken, base, torch.empty_like(new))


def test_unchanged_fraction():
    a = torch.zeros(10, dtype=torch.bfloat16)
    b = a.clone()
    b[:3] = 1.0
    assert unchanged_fraction(b, a) == pytest.approx(0.7)
