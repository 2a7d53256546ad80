"""StagingBuffers: each staged version reaches the model whole and as it was staged."""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.staging import StagingBuffers


def _staging(held_in_verify: dict[int, threading.Event], entered: threading.Event,
             ) -> tuple[Layout, StagingBuffers]:
    layout = Layout.from_weights({"w": torch.zeros(64), "b": torch.zeros(8)})

    def verify(version: int, buffers: dict[str, torch.Tensor], proof: float) -> None:
        release = held_in_verify.get(version)
        if release is not None:  # an apply that lasts until the test lets it go
            entered.set()
            assert release.wait(10)
        dest = {"w": torch.empty(64), "b": torch.empty(8)}
        layout.unpack(buffers, dest)
        if not all(bool((t == proof).all()) for t in dest.values()):
            raise IntegrityError(f"version {version} does not hold what was staged")

    return layout, StagingBuffers(layout, verify)


def _write(layout: Layout, value: float):
    def write(buffers: dict[str, torch.Tensor]) -> float:
        layout.pack({"w": torch.full((64,), value), "b": torch.full((8,), value)}, buffers)
        return value
    return write


def test_a_fill_not_kept_leaves_the_staged_version_intact_while_another_is_applied():
    """A worker that only takes part in a broadcast (``keep=False``: a send to other
    workers) while it applies one version and has the next staged must not write over the
    staged one: its next apply takes that version, whole."""
    release, entered = threading.Event(), threading.Event()
    layout, staging = _staging({1: release}, entered)
    staging.fill(1, _write(layout, 1.0))
    first = {"w": torch.zeros(64), "b": torch.zeros(8)}
    applying = threading.Thread(target=staging.apply, args=(first, -1))
    applying.start()
    try:
        assert entered.wait(10)  # version 1 is being applied
        staging.fill(2, _write(layout, 2.0))  # staged in the other buffer
        staging.fill(3, _write(layout, 3.0), keep=False)  # taken only, for the others
    finally:
        release.set()
        applying.join(10)
    assert all(bool((t == 1.0).all()) for t in first.values())
    second = {"w": torch.zeros(64), "b": torch.zeros(8)}
    assert staging.apply(second, 1) == 2
    assert all(bool((t == 2.0).all()) for t in second.values())
    # and the buffers keep working as before: newest kept version wins, whole
    staging.fill(4, _write(layout, 4.0), keep=False)
    staging.fill(5, _write(layout, 5.0))
    staging.fill(6, _write(layout, 6.0), keep=False)
    assert staging.apply(second, 2) == 5
    assert all(bool((t == 5.0).all()) for t in second.values())
    assert staging.apply(second, 5) is None


def test_a_corrupted_staged_version_is_dropped_and_the_model_left_alone():
    layout, staging = _staging({}, threading.Event())
    staging.fill(1, lambda buffers: (_write(layout, 1.0)(buffers), 9.0)[1])  # wrong proof
    dest = {"w": torch.zeros(64), "b": torch.zeros(8)}
    with pytest.raises(IntegrityError):
        staging.apply(dest, -1)
    assert all(bool((t == 0.0).all()) for t in dest.values())
    assert staging.staged_version is None
