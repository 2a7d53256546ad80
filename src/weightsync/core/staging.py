"""Two staging buffers on a receiver: one is filled from the transport while the other is
applied to the model, so a version reaches the model whole and only when asked.

A transport that checks what arrived (checksums sent beside the bytes) passes a
``verify`` callable: ``write`` returns the proof for the bytes it wrote, and ``apply``
verifies the buffer against it before any byte reaches the model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.core.layout import Layout

Buffers = dict[str, torch.Tensor]
#: ``verify(version, buffers, proof)`` raises if the buffers do not match the proof
Verify = Callable[[int, Buffers, Any], None]


class StagingBuffers:
    """Double-buffered landing zone for incoming versions of one layout (a third buffer
    only if a version not kept arrives while one is applied and another staged)."""

    def __init__(self, layout: Layout, verify: Verify | None = None) -> None:
        self.layout = layout
        self._verify = verify
        self.buffers: list[Buffers] = [layout.allocate(), layout.allocate()]
        self.staged: tuple[int, int, Any] | None = None  # (version, buffer index, proof)
        self.applying: int | None = None
        self.lock = threading.Lock()

    def fill(self, version: int, write: Callable[[Buffers], Any], keep: bool = True) -> int:
        """Let ``write`` fill a buffer nobody is applying (and return the proof to verify it
        by, or None); stage it as ``version`` if ``keep`` (else the bytes are only taken,
        e.g. to take part in a collective). A version that is kept may overwrite the one
        staged (it is newer); one that is not never does: with one buffer being applied
        and the other staged, its bytes land in a third buffer (allocated then, kept)."""
        with self.lock:
            staged_idx = None if self.staged is None else self.staged[1]
            free = [i for i in range(len(self.buffers))
                    if i != self.applying and i != staged_idx]
            idx = free[0] if free else staged_idx if keep else None
            if idx is not None and idx == staged_idx:
                self.staged = None  # about to be overwritten by a newer version
        if idx is None:  # allocated outside the lock: poll() never waits for it
            spare = self.layout.allocate()
            with self.lock:
                self.buffers.append(spare)
                idx = len(self.buffers) - 1
        proof = write(self.buffers[idx])
        if keep:
            with self.lock:
                self.staged = (version, idx, proof)
        return version

    def apply(self, dest: Mapping[str, torch.Tensor], held_version: int) -> int | None:
        """Verify the newest staged version (when it came with a proof) and copy it into
        ``dest`` if newer than ``held_version``; a failed check drops it, and ``verify``'s
        error is raised with ``dest`` untouched."""
        with self.lock:
            if self.staged is None or self.staged[0] <= held_version:
                return None
            version, idx, proof = self.staged
            self.staged = None
            self.applying = idx
        try:
            if self._verify is not None and proof is not None:
                self._verify(version, self.buffers[idx], proof)
            self.layout.unpack(self.buffers[idx], dest)
        finally:
            with self.lock:
                self.applying = None
        return version

    @property
    def staged_version(self) -> int | None:
        with self.lock:
            return None if self.staged is None else self.staged[0]
