"""A snapshot packed straight into the broadcast: each chunk of the wire buffers is filled
from the model's tensors just before it goes out, so the copy (and its checksum, taken while
the chunk is still in cache) overlaps the transfer of the chunks before it instead of
preceding the whole broadcast."""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import torch

from weightsync.core.layout import Layout
from weightsync.transports.ray.group import FillChunk


def can_stream(layout: Layout, flat: Mapping[str, torch.Tensor]) -> bool:
    """True if ``flat`` can be packed chunk by chunk as raw bytes: CPU tensors only, each
    of the layout's dtype (no cast on the way)."""
    return set(layout.nbytes_by_device) == {"cpu"} and all(
        flat[s.name].device.type == "cpu" and flat[s.name].dtype == s.dtype for s in layout.specs)


def streamed_pack(layout: Layout, flat: Mapping[str, torch.Tensor],
                  buffers: Mapping[str, torch.Tensor]) -> FillChunk:
    """A ``fill`` for :meth:`WeightGroup.broadcast` / ``send_checked``: writes into each
    chunk of ``buffers["cpu"]`` the bytes of ``flat`` that the layout places there. Once
    every chunk went out, ``buffers`` hold the snapshot ``layout.pack`` would have made."""
    spans = sorted((begin, end, name) for name, (begin, end) in layout.offsets().items()
                   if end > begin)
    ends = [end for _, end, _ in spans]
    base = buffers["cpu"].data_ptr()
    sources: dict[str, torch.Tensor] = {}

    def raw(name: str) -> torch.Tensor:
        if name not in sources:
            tensor = flat[name].detach()
            sources[name] = tensor.contiguous().reshape(-1).view(torch.uint8)
        return sources[name]

    def fill(index: int, chunk: torch.Tensor) -> None:
        start = chunk.data_ptr() - base
        stop = start + chunk.numel()
        i = bisect.bisect_right(ends, start)
        while i < len(spans) and spans[i][0] < stop:
            begin, end, name = spans[i]
            lo, hi = max(start, begin), min(stop, end)
            chunk[lo - start:hi - start].copy_(raw(name)[lo - begin:hi - begin])
            i += 1

    return fill
