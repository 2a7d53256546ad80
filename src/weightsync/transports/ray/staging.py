"""Two staging buffers for versions that crossed the network, each checked before use.

A broadcast lands in a buffer nobody is applying, with the checksums the sender computed
as it sent; ``apply`` verifies the buffer against them before one byte reaches the model,
so a corrupted version is dropped (IntegrityError) and the model keeps the one it holds.
Verifying at apply rather than on arrival keeps the check off the sender's acknowledgement
path and skips versions overwritten before the actor ever applied them.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.staging import Buffers, StagingBuffers
from weightsync.transports.ray.group import bucket_buffers, chunk_checksums


def checked_staging(layout: Layout, worker_idx: int) -> StagingBuffers:
    """Staging buffers whose versions are verified against the sender's per-chunk checksums
    (the value the broadcast's ``write`` returns; None: unchecked, ``checksums=False``)."""

    def verify(version: int, buffers: Buffers, sums: Sequence[int]) -> None:
        got = chunk_checksums(bucket_buffers(layout, buffers))
        bad = [i for i, (a, b) in enumerate(zip(got, sums, strict=False)) if a != b]
        if bad or len(got) != len(sums):
            raise IntegrityError(
                f"worker {worker_idx}: version {version} arrived corrupted ({len(bad)} "
                f"chunk(s) differ from the sender's checksums, first: {bad[:1]}); it is "
                "dropped and the worker keeps the version it holds"
            )

    return StagingBuffers(layout, verify)
