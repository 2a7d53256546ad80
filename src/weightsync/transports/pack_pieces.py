"""Packing weights into one flat buffer piece by piece, and copying packed pieces back out,
so a reader (a worker copying a slot, a thread writing a socket) can follow the writer a
few megabytes behind instead of waiting for the whole copy.

A :class:`PiecePlan` cuts a single-device layout into pieces of at most ``PIECE_BYTES``
in buffer order. The writer reports a watermark after each piece (every byte below it is
final); a reader copies each piece that lies wholly below the watermark it last read.
Layouts on a GPU or spread over several devices, and small ones, are packed in one go.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from weightsync.core.layout import Layout

#: the largest piece: small enough that a reader starts after ~1 ms, large enough that the
#: per-piece Python overhead (~10 us) stays under 1% of the copy
PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of tensor ``name``, at bytes ``[byte_lo, byte_hi)`` of the buffer."""

    name: str
    lo: int
    hi: int
    byte_lo: int
    byte_hi: int


class PiecePlan:
    """How one layout is packed piece by piece into its (single) device buffer."""

    def __init__(self, layout: Layout, piece_bytes: int = PIECE_BYTES) -> None:
        self.layout = layout
        self.total = sum(layout.nbytes_by_device.values())
        devices = list(layout.nbytes_by_device)
        #: False (one piece, no watermarks): several devices, a GPU (its copies are
        #: asynchronous: a watermark raised after a launch would announce unwritten bytes),
        #: or small enough for one copy
        self.in_pieces = devices == ["cpu"] and self.total > piece_bytes
        self.device = devices[0] if len(devices) == 1 else None
        self.pieces: list[Piece] = []
        if self.in_pieces:
            offsets = layout.offsets()
            for spec in sorted(layout.specs, key=lambda s: offsets[s.name][0]):
                start = offsets[spec.name][0]
                step = max(1, piece_bytes // spec.dtype.itemsize)
                for lo in range(0, spec.numel, step):
                    hi = min(spec.numel, lo + step)
                    self.pieces.append(Piece(spec.name, lo, hi, start + lo * spec.dtype.itemsize,
                                             start + hi * spec.dtype.itemsize))

    def buffer_views(self, buffers: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The typed views ``pack`` writes through: each piece's, or each tensor's for a
        layout packed in one go (made once per buffer and kept: making them costs about
        as much as copying a small model)."""
        if not self.in_pieces:
            return list(self.layout.tensor_views(buffers).values())
        assert self.device is not None
        raw = buffers[self.device]
        views = []
        for piece in self.pieces:
            dtype = self.layout[piece.name].dtype
            views.append(raw[piece.byte_lo:piece.byte_hi].view(dtype))
        return views

    def pack(self, weights: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
             advance: Callable[[int], None], views: list[torch.Tensor] | None = None) -> None:
        """Copy ``weights`` into ``buffers``; ``advance(watermark)`` after each piece, the
        last call with ``self.total``. ``views``: this buffer's ``buffer_views``, if kept."""
        views = self.buffer_views(buffers) if views is None else views
        if not self.in_pieces:
            self.layout.pack(weights, buffers, views)
            advance(self.total)
            return
        flat: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for piece, view in zip(self.pieces, views, strict=True):
                source = flat.get(piece.name)
                if source is None:
                    source = flat[piece.name] = weights[piece.name].reshape(-1)
                view.copy_(source[piece.lo:piece.hi])
                # the copy released and retook the GIL (atomic instructions, a full fence on
                # x86): the bytes are visible before the watermark that announces them
                advance(piece.byte_hi)
        advance(self.total)

    def reader_ok(self, dest: Mapping[str, torch.Tensor]) -> bool:
        """Whether pieces can be copied straight into ``dest`` (contiguous, same dtypes)."""
        return self.in_pieces and all(
            dest[s.name].is_contiguous() and dest[s.name].dtype == s.dtype
            for s in self.layout.specs
        )

    def dest_views(self, dest: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's view into the matching tensor of ``dest`` (see ``reader_ok``)."""
        flat = {name: tensor.data.view(-1) for name, tensor in dest.items()}
        return [flat[piece.name][piece.lo:piece.hi] for piece in self.pieces]

    def copy_out(self, sources: list[torch.Tensor], targets: list[torch.Tensor], start: int,
                 watermark: int) -> int:
        """Copy pieces ``start, start+1, ...`` that lie wholly below ``watermark`` from
        ``sources`` (``buffer_views``) to ``targets`` (``dest_views``); returns the index of
        the first piece not copied."""
        index = start
        with torch.no_grad():
            while index < len(self.pieces) and self.pieces[index].byte_hi <= watermark:
                targets[index].copy_(sources[index])
                index += 1
        return index
