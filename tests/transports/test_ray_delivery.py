"""The typed delivery a Ray take call carries: each kind survives its wire form, and a
delivery without a group generation is refused by name."""

from __future__ import annotations

import pickle

import pytest

from weightsync.transports.ray.delivery import (
    Broadcast,
    Delivery,
    DeltaStream,
    ShardedPieces,
)

KINDS = [
    Delivery(3, Broadcast(checked=True), 4.5),
    Delivery(3, Broadcast(checked=False), None, relay=(2, 5)),
    Delivery(4, DeltaStream("snap-7", "snap-6"), 1.0),
    Delivery(4, DeltaStream("snap-7", None), 1.0, relay=(1,)),
    Delivery(4, DeltaStream(skip=True), 1.0),
    Delivery(9, ShardedPieces({0: {"w": [0, 4]}, 1: {"w": [4, 8]}}, 1 << 20), 2.0, relay=(3,)),
]


@pytest.mark.parametrize("delivery", KINDS, ids=lambda d: type(d.plan).__name__)
def test_each_kind_survives_the_wire(delivery: Delivery) -> None:
    wire = pickle.loads(pickle.dumps(delivery.to_wire()))  # as a Ray call carries it
    assert Delivery.from_wire(wire, worker_idx=0, version=1) == delivery


def test_the_sharded_lead_wire_form_reads_back() -> None:
    """The sharded lead hands the dict form directly (rank keys as ints or strings)."""
    wire = {"generation": 2, "checked": True, "timeout_s": 3,
            "sharded": {"regions": {"0": {"a": [0, 2]}, 1: {"a": [2, 4]}}, "chunk_bytes": 64},
            "relay": [4]}
    delivery = Delivery.from_wire(wire, worker_idx=1, version=5)
    assert delivery == Delivery(2, ShardedPieces({0: {"a": [0, 2]}, 1: {"a": [2, 4]}}, 64),
                                3.0, relay=(4,))


def test_a_delivery_without_a_generation_is_refused() -> None:
    with pytest.raises(ValueError, match="worker 2: the delivery of version 7 names no group"):
        Delivery.from_wire({"checked": True}, worker_idx=2, version=7)


def test_a_delivery_is_frozen() -> None:
    delivery = KINDS[0]
    with pytest.raises(AttributeError):
        delivery.generation = 4  # type: ignore[misc]
