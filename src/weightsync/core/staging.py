"""Two staging buffers on a receiver: one is filled from the transport while the other is
applied to the model, so a version reaches the model whole and only when asked."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from weightsync.core.layout import Layout

Buffers = dict[str, torch.Tensor]


class StagingBuffers:
    """Double-buffered landing zone for incoming versions of one layout."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.buffers: list[Buffers] = [layout.allocate(), layout.allocate()]
        self.staged: tuple[int, int] | None = None  # (version, buffer index)
        self.applying: int | None = None
        self.lock = threading.Lock()

    def fill(self, version: int, write: Callable[[Buffers], None], keep: bool = True) -> int:
        """Let ``write`` fill a buffer nobody is applying; stage it as ``version`` if
        ``keep`` (else the bytes are only taken, e.g. to take part in a collective)."""
        with self.lock:
            staged_idx = None if self.staged is None else self.staged[1]
            free = [i for i in (0, 1) if i != self.applying and i != staged_idx]
            idx = free[0] if free else staged_idx
            assert idx is not None
            if idx == staged_idx and keep:
                self.staged = None  # about to be overwritten by a newer version
        write(self.buffers[idx])
        if keep:
            with self.lock:
                self.staged = (version, idx)
        return version

    def apply(self, dest: Mapping[str, torch.Tensor], held_version: int) -> int | None:
        """Copy the newest staged version into ``dest`` if newer than ``held_version``."""
        with self.lock:
            if self.staged is None or self.staged[0] <= held_version:
                return None
            version, idx = self.staged
            self.staged = None
            self.applying = idx
        try:
            self.layout.unpack(self.buffers[idx], dest)
        finally:
            with self.lock:
                self.applying = None
        return version

    @property
    def staged_version(self) -> int | None:
        with self.lock:
            return None if self.staged is None else self.staged[0]
