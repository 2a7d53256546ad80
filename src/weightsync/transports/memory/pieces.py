"""Packing weights into one flat buffer piece by piece, and copying packed pieces back out,
so a reader (a worker copying a slot, a thread writing a socket) can follow the writer a
few megabytes behind instead of waiting for the whole copy.

A :class:`PiecePlan` cuts a single-device layout into pieces of at most ``PIECE_BYTES``
in buffer order (small tensors grouped, large ones cut). The writer reports a watermark
after each piece (every byte below it is final); a reader copies each piece that lies
wholly below the watermark it last read.
Layouts on a GPU or spread over several devices, and small ones, are packed in one go.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from weightsync.core.layout import Layout, copy_all

#: the largest piece: small enough that a reader starts after ~1 ms, large enough that the
#: per-piece Python overhead (~10 us) stays under 1% of the copy
PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class Span:
    """Elements ``[lo, hi)`` of tensor ``name``, at bytes ``[byte_lo, byte_hi)`` of the buffer;
    ``shape`` is the tensor's own when the span is all of it (copied as is: no reshape and
    no slice per send, which add up for a model of hundreds of tensors)."""

    name: str
    lo: int
    hi: int
    byte_lo: int
    byte_hi: int
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Piece:
    """Consecutive spans, at most ``PIECE_BYTES`` together, copied in one fused call and
    announced by one watermark: small tensors share a piece (a model of hundreds of small
    tensors costs a few pieces, not hundreds), a large one is cut into several."""

    spans: tuple[Span, ...]

    @property
    def byte_hi(self) -> int:
        return self.spans[-1].byte_hi


def _cut(layout: Layout, piece_bytes: int) -> list[Piece]:
    """The layout's tensors in buffer order, cut into spans and grouped into pieces."""
    offsets = layout.offsets()
    pieces: list[Piece] = []
    spans: list[Span] = []
    size = 0
    for spec in sorted(layout.specs, key=lambda s: offsets[s.name][0]):
        start, itemsize = offsets[spec.name][0], spec.dtype.itemsize
        step = max(1, piece_bytes // itemsize)
        for lo in range(0, spec.numel, step):
            hi = min(spec.numel, lo + step)
            if spans and size + (hi - lo) * itemsize > piece_bytes:
                pieces.append(Piece(tuple(spans)))
                spans, size = [], 0
            whole = spec.shape if hi - lo == spec.numel else None
            spans.append(Span(spec.name, lo, hi, start + lo * itemsize, start + hi * itemsize,
                              whole))
            size += (hi - lo) * itemsize
    if spans:
        pieces.append(Piece(tuple(spans)))
    return pieces


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
        self.pieces: list[Piece] = _cut(layout, piece_bytes) if self.in_pieces else []

    def buffer_views(self, buffers: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
        """The typed views ``pack`` writes through, per piece (a layout packed in one go is
        one piece of every tensor). Made once per buffer and kept: making them costs about
        as much as copying a small model."""
        if not self.in_pieces:
            return [list(self.layout.tensor_views(buffers).values())]
        assert self.device is not None
        raw = buffers[self.device]
        views = []
        for piece in self.pieces:
            typed = [raw[s.byte_lo:s.byte_hi].view(self.layout[s.name].dtype) for s in piece.spans]
            views.append([v if s.shape is None else v.view(s.shape)
                          for v, s in zip(typed, piece.spans, strict=True)])
        return views

    def pack(self, weights: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
             advance: Callable[[int], None], views: list[list[torch.Tensor]] | None = None,
             ) -> None:
        """Copy ``weights`` into ``buffers``; ``advance(watermark)`` after each piece, the
        last call with ``self.total``. ``views``: this buffer's ``buffer_views``, if kept."""
        views = self.buffer_views(buffers) if views is None else views
        if not self.in_pieces:
            self.layout.pack(weights, buffers, views[0])
            advance(self.total)
            return
        flat: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for piece, targets in zip(self.pieces, views, strict=True):
                sources = []
                for span in piece.spans:
                    if span.shape is not None:
                        sources.append(weights[span.name])
                        continue
                    source = flat.get(span.name)
                    if source is None:
                        source = flat[span.name] = weights[span.name].reshape(-1)
                    sources.append(source[span.lo:span.hi])
                copy_all(targets, sources)
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

    def dest_views(self, dest: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
        """Each piece's views into the matching tensors of ``dest`` (see ``reader_ok``)."""
        data = {name: tensor.data for name, tensor in dest.items()}
        return [[data[s.name] if s.shape is not None else data[s.name].view(-1)[s.lo:s.hi]
                 for s in piece.spans] for piece in self.pieces]

    def copy_out(self, sources: list[list[torch.Tensor]], targets: list[list[torch.Tensor]],
                 start: int, watermark: int) -> int:
        """Copy pieces ``start, start+1, ...`` that lie wholly below ``watermark`` from
        ``sources`` (``buffer_views``) to ``targets`` (``dest_views``); returns the index of
        the first piece not copied."""
        index = start
        while index < len(self.pieces) and self.pieces[index].byte_hi <= watermark:
            copy_all(targets[index], sources[index])
            index += 1
        return index
