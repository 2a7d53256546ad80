"""The substitution itself (ours, not copied from TorchRL): the copied tests must run on the
schemes the mode names, or their passes say nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl")

import os  # noqa: E402

import torchrl.collectors._evaluator as evaluator_mod  # noqa: E402
import torchrl.collectors._multi_base as multi_base  # noqa: E402
import torchrl.collectors.distributed.ray as ray_collector_mod  # noqa: E402
import torchrl.weight_update as wu  # noqa: E402
from torchrl.weight_update import WeightSyncScheme  # noqa: E402

import weightsync.integrations.torchrl as ours  # noqa: E402


MODE = os.environ.get("WEIGHTSYNC_TORCHRL_COMPAT", "weightsync").strip().lower()
BACKENDS = {
    "shared": "SharedMemWeightSyncScheme",
    "process": "MultiProcessWeightSyncScheme",
    "ray": "RayWeightSyncScheme",
}


def _expected(name: str) -> type:
    if MODE == "weightsync":
        return getattr(ours, name)
    return getattr(__import__(f"torchrl.weight_update.{_DEFINED_IN[name]}", fromlist=[name]), name)


_DEFINED_IN = {
    "SharedMemWeightSyncScheme": "_shared",
    "MultiProcessWeightSyncScheme": "_mp",
    "RayWeightSyncScheme": "_ray",
}


@pytest.mark.parametrize("name", sorted(_DEFINED_IN))
def test_public_names(name: str) -> None:
    assert getattr(wu, name) is _expected(name)


def test_collector_defaults() -> None:
    assert multi_base.SharedMemWeightSyncScheme is _expected("SharedMemWeightSyncScheme")
    assert multi_base.MultiProcessWeightSyncScheme is _expected("MultiProcessWeightSyncScheme")
    assert evaluator_mod.MultiProcessWeightSyncScheme is _expected("MultiProcessWeightSyncScheme")
    assert ray_collector_mod.RayWeightSyncScheme is _expected("RayWeightSyncScheme")


@pytest.mark.parametrize(("backend", "name"), sorted(BACKENDS.items()))
def test_from_backend(backend: str, name: str) -> None:
    assert type(WeightSyncScheme.from_backend(backend)) is _expected(name)


def test_defining_modules_keep_torchrl() -> None:
    from torchrl.weight_update import _mp, _shared

    assert _shared.SharedMemWeightSyncScheme.__module__ == "torchrl.weight_update._shared"
    assert _mp.MultiProcessWeightSyncScheme.__module__ == "torchrl.weight_update._mp"
