"""What one ``take`` call tells an actor about how a version reaches it, typed.

The trainer builds a :class:`Delivery` per actor and sends its plain-data wire form
(:meth:`Delivery.to_wire`) with the Ray call; the actor reads it back once
(:meth:`Delivery.from_wire`) and takes the version by the path its ``plan`` names:

- :class:`Broadcast`: whole, in the group's broadcast (with the sender's checksums if
  ``checked``);
- :class:`DeltaStream`: this node's own point-to-point stream (``delta_stream``), encoded
  against the snapshot ``base`` it holds (None: whole), or nothing at all (``skip``);
- :class:`ShardedPieces`: every trainer rank's pieces (``shard_stream``).

Actors that copy a version out of shared memory on their node get no delivery: the segment
messages of the call are all they need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Regions = Mapping[int, Mapping[str, Sequence[int]]]  # trainer rank -> its regions


@dataclass(frozen=True)
class Broadcast:
    """The version comes whole in the group's broadcast."""

    checked: bool  # chunk checksums follow the bytes


@dataclass(frozen=True)
class DeltaStream:
    """Delta: this node's stream of snapshot ``id``, encoded against ``base`` (None:
    whole); ``skip``: nothing for this node this time (it keeps no copy of the version)."""

    id: str | None = None
    base: str | None = None
    skip: bool = False


@dataclass(frozen=True)
class ShardedPieces:
    """A sharded trainer: each rank streams its ``regions``, in chunks of ``chunk_bytes``."""

    regions: Regions
    chunk_bytes: int


Plan = Broadcast | DeltaStream | ShardedPieces


@dataclass(frozen=True)
class Delivery:
    """How ``take`` gets one version: for group ``generation``, within ``timeout_s``, by
    ``plan``; a relay also writes it into shared memory for its ``relay`` followers."""

    generation: int
    plan: Plan
    timeout_s: float | None = None
    relay: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """Plain data for the Ray call (what ``from_wire`` reads back)."""
        wire: dict[str, Any] = {"generation": self.generation, "timeout_s": self.timeout_s}
        plan = self.plan
        if isinstance(plan, Broadcast):
            wire["checked"] = plan.checked
        elif isinstance(plan, DeltaStream):
            wire["stream"] = ({"skip": True} if plan.skip
                              else {"id": plan.id, "base": plan.base})
        else:
            wire["checked"] = True
            wire["sharded"] = {"regions": plan.regions, "chunk_bytes": plan.chunk_bytes}
        if self.relay:
            wire["relay"] = list(self.relay)
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], *, worker_idx: int, version: int) -> Delivery:
        """The delivery a take call carries; ValueError naming what is missing."""
        generation = wire.get("generation")
        if not isinstance(generation, int):
            raise ValueError(f"worker {worker_idx}: the delivery of version {version} names "
                             f"no group generation: {dict(wire)!r}")
        stream, sharded = wire.get("stream"), wire.get("sharded")
        plan: Plan
        if sharded is not None:
            plan = ShardedPieces({int(r): regs for r, regs in sharded["regions"].items()},
                                 int(sharded["chunk_bytes"]))
        elif stream is not None:
            plan = DeltaStream(stream.get("id"), stream.get("base"), bool(stream.get("skip")))
        else:
            plan = Broadcast(bool(wire.get("checked")))
        timeout = wire.get("timeout_s")
        return cls(generation, plan, None if timeout is None else float(timeout),
                   tuple(int(f) for f in wire.get("relay") or ()))
