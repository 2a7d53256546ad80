"""Two staging buffers for versions that crossed the network, each checked before use.

A broadcast lands in a buffer nobody is applying, with the checksums the sender computed
as it sent; ``apply`` verifies the buffer against them before one byte reaches the model,
so a corrupted version is dropped (IntegrityError) and the model keeps the one it holds.
Verifying at apply rather than on arrival keeps the check off the sender's acknowledgement
path and skips versions overwritten before the actor ever applied them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.transports.ray_group import bucket_buffers, chunk_checksums

Buffers = dict[str, torch.Tensor]


class CheckedStaging:
    """Double-buffered landing zone for one layout; each staged version carries the
    sender's per-chunk checksums (None: unchecked, e.g. ``checksums=False``)."""

    def __init__(self, layout: Layout, worker_idx: int) -> None:
        self.layout = layout
        self.worker_idx = worker_idx
        self.buffers: list[Buffers] = [layout.allocate(), layout.allocate()]
        self.staged: tuple[int, int, list[int] | None] | None = None  # version, index, sums
        self.applying: int | None = None
        self.lock = threading.Lock()

    def fill(self, version: int, write: Callable[[Buffers], list[int] | None],
             keep: bool = True) -> None:
        """Let ``write`` fill a buffer nobody is applying and return the sender's checksums;
        stage it as ``version`` if ``keep`` (else the bytes only took part in the group)."""
        with self.lock:
            staged_idx = None if self.staged is None else self.staged[1]
            free = [i for i in (0, 1) if i != self.applying and i != staged_idx]
            idx = free[0] if free else staged_idx
            assert idx is not None
            if idx == staged_idx and keep:
                self.staged = None  # about to be overwritten by a newer version
        sums = write(self.buffers[idx])
        if keep:
            with self.lock:
                self.staged = (version, idx, sums)

    def apply(self, dest: Mapping[str, torch.Tensor], held_version: int) -> int | None:
        """Verify the newest staged version and copy it into ``dest`` if newer than
        ``held_version``; a mismatch drops it and raises IntegrityError."""
        with self.lock:
            if self.staged is None or self.staged[0] <= held_version:
                return None
            version, idx, sums = self.staged
            self.staged = None
            self.applying = idx
        try:
            if sums is not None:
                self._verify(version, self.buffers[idx], sums)
            self.layout.unpack(self.buffers[idx], dest)
        finally:
            with self.lock:
                self.applying = None
        return version

    def _verify(self, version: int, buffers: Buffers, sums: Sequence[int]) -> None:
        got = chunk_checksums(bucket_buffers(self.layout, buffers))
        bad = [i for i, (a, b) in enumerate(zip(got, sums, strict=True)) if a != b]
        if bad or len(got) != len(sums):
            raise IntegrityError(
                f"worker {self.worker_idx}: version {version} arrived corrupted ({len(bad)} "
                f"chunk(s) differ from the sender's checksums, first: {bad[:1]}); it is "
                "dropped and the worker keeps the version it holds"
            )
