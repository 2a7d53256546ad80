"""What the RayCollector tests check, on one node or two: a probe policy whose weights of
version v hold ``weight_value(v)`` everywhere, and batches read back row by row (one row
per collector actor, as ``RayCollector(sync=True)`` stacks them)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

BASE = 100.0
MODEL = "policy"


def weight_value(version: int) -> float:
    """The value every weight holds at ``version``. RayCollector connects its actors at the
    first update (version 0) and sends that update as version 1: both hold the same weights."""
    return BASE + max(version, 1)


def row_version(batch: Any, row: int) -> int:
    """The one version behind row ``row`` of a stacked batch: its ``policy_version`` tags
    agree with each other and with the weights that computed every frame."""
    lo, hi = batch["probe_min"][row], batch["probe_max"][row]
    assert torch.equal(lo, hi), f"row {row}: a frame was computed from weights of mixed versions"
    tags = set(batch["policy_version"][row].tolist())
    assert len(tags) == 1, f"row {row}: one batch tagged with versions {tags}"
    (tag,) = tags
    assert set(batch["next", "policy_version"][row].tolist()) == {tag}
    assert set(lo.tolist()) == {weight_value(tag)}, (
        f"row {row}: tagged version {tag} but computed by weights {set(lo.tolist())}")
    return int(tag)


def python_path(*dirs: str) -> str:
    """PYTHONPATH for Ray workers: the test helpers' directories, then the caller's own."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*dirs, *inherited])


def paths(collector: Any) -> list[str | None]:
    """How versions reach each collector actor: "node-local" or "broadcast"."""
    return list(collector.get_distant_attr(f"_receiver_schemes['{MODEL}'].path"))


def named_actor_gone(ray: Any, name: str, timeout: float = 30.0) -> bool:
    """Whether the named Ray actor ``name`` is gone (waiting up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


def actors_dead(ray: Any, actors: list[Any], timeout: float = 30.0) -> bool:
    """Whether every one of ``actors`` is dead within ``timeout``: a call to it fails with
    RayActorError (a kill that has not landed yet still answers: look again)."""
    end = time.monotonic() + timeout
    for actor in actors:
        while True:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, end - time.monotonic()))
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                return False
            if time.monotonic() >= end:
                return False
            time.sleep(0.2)
    return True


def corrupt_wire(actor: Any, on: bool) -> None:
    """Inside a Ray actor (``actor.__ray_call__``): flip one byte of every bucket this
    process receives through the broadcast from now on (or stop)."""
    from weightsync.transports.ray.link import ActorLink

    def flip(buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            flat = buffer.view(torch.uint8).reshape(-1)
            flat[flat.numel() // 2] ^= 0x10

    ActorLink.wire_hook = flip if on else None
