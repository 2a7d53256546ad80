"""A snapshot packed straight into the broadcast (or the delta streams): each chunk of the
wire buffers is filled from the model's tensors just before it goes out, so the copy (and
its checksum, taken while the chunk is still in cache) overlaps the transfer of the chunks
before it instead of preceding the whole broadcast. A floating-point tensor packed as
another dtype (the scheme's ``dtype``) is cast chunk by chunk on the way."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping

import torch

from weightsync.core.layout import Layout
from weightsync.transports.ray.group import FillChunk


def can_stream(layout: Layout, flat: Mapping[str, torch.Tensor]) -> bool:
    """True if ``flat`` can be packed chunk by chunk: CPU tensors only, each of the layout's
    dtype or, both floating point, cast on the way."""
    return set(layout.nbytes_by_device) == {"cpu"} and all(
        flat[s.name].device.type == "cpu" and (
            flat[s.name].dtype == s.dtype
            or (flat[s.name].dtype.is_floating_point and s.dtype.is_floating_point))
        for s in layout.specs)


def streamed_pack(layout: Layout, flat: Mapping[str, torch.Tensor],
                  buffers: Mapping[str, torch.Tensor]) -> FillChunk:
    """A ``fill`` for :meth:`WeightGroup.broadcast` / ``send_checked``: writes into each
    chunk of ``buffers["cpu"]`` the bytes of ``flat`` that the layout places there. Once
    every chunk went out, ``buffers`` hold the snapshot ``layout.pack`` would have made."""
    spans = sorted((begin, end, name) for name, (begin, end) in layout.offsets().items()
                   if end > begin)
    ends = [end for _, end, _ in spans]
    dtypes = {spec.name: spec.dtype for spec in layout.specs}
    base = buffers["cpu"].data_ptr()
    sources: dict[str, torch.Tensor] = {}
    made = threading.Lock()  # chunks may be filled on several threads

    def source(name: str) -> torch.Tensor:
        """The tensor's elements, flat (its bytes when no cast is needed)."""
        with made:
            if name not in sources:
                tensor = flat[name].detach().contiguous().reshape(-1)
                sources[name] = (tensor.view(torch.uint8) if tensor.dtype == dtypes[name]
                                 else tensor)
            return sources[name]

    def fill(index: int, chunk: torch.Tensor) -> None:
        start = chunk.data_ptr() - base
        stop = start + chunk.numel()
        i = bisect.bisect_right(ends, start)
        while i < len(spans) and spans[i][0] < stop:
            begin, end, name = spans[i]
            lo, hi = max(start, begin), min(stop, end)
            elements = source(name)
            target = chunk[lo - start:hi - start]
            if elements.dtype == torch.uint8:  # raw bytes
                target.copy_(elements[lo - begin:hi - begin])
            else:  # cast: chunks and tensors start on whole elements of the packed dtype
                size = dtypes[name].itemsize
                target.view(dtypes[name]).copy_(elements[(lo - begin) // size:(hi - begin) // size])
            i += 1

    return fill
