"""PiecePlan: small tensors share a piece, large ones are cut; packing and copying out
piece by piece reproduce every tensor exactly, whatever the mix of shapes and dtypes."""

from __future__ import annotations

import torch

from weightsync.core.layout import Layout
from weightsync.transports.memory.pieces import PiecePlan


def mixed_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    weights = {f"small{i}.weight": torch.randn(8, 16) for i in range(200)}
    weights["big"] = torch.randn(3_000_000)  # 12 MB: several pieces
    weights["half"] = torch.randn(64, 64).to(torch.bfloat16)
    weights["count"] = torch.tensor(7, dtype=torch.int64)  # zero-dimensional
    weights["strided"] = torch.randn(32, 48).t()  # not contiguous
    return weights


def test_small_tensors_share_pieces_and_large_ones_are_cut():
    plan = PiecePlan(Layout.from_weights(mixed_weights()), piece_bytes=1 << 20)
    assert plan.in_pieces
    spans = [span for piece in plan.pieces for span in piece.spans]
    assert len(plan.pieces) < 30 < len(spans)  # 200 small tensors in a handful of pieces
    for piece in plan.pieces:
        size = sum(s.byte_hi - s.byte_lo for s in piece.spans)
        assert size <= 1 << 20
    assert [s.byte_lo for s in spans] == sorted(s.byte_lo for s in spans)
    big = [s for s in spans if s.name == "big"]
    assert len(big) == 12 and all(s.shape is None for s in big)
    assert all(s.shape is not None for s in spans if s.name.startswith("small"))


def test_pack_and_copy_out_piece_by_piece_reproduce_every_tensor():
    weights = mixed_weights()
    layout = Layout.from_weights(weights)
    plan = PiecePlan(layout, piece_bytes=1 << 20)
    buffers = {"cpu": torch.zeros(layout.nbytes_by_device["cpu"], dtype=torch.uint8)}
    marks: list[int] = []
    plan.pack(weights, buffers, marks.append)
    assert marks == [p.byte_hi for p in plan.pieces] + [plan.total]
    dest = {name: torch.zeros_like(t).contiguous() for name, t in weights.items()}
    assert plan.reader_ok(dest)
    sources, targets = plan.buffer_views(buffers), plan.dest_views(dest)
    index = 0
    for mark in marks:  # as a reader following the watermarks would
        index = plan.copy_out(sources, targets, index, mark)
    assert index == len(plan.pieces)
    for name, tensor in weights.items():
        assert torch.equal(dest[name], tensor), name
