"""RayWeightSyncScheme(dtype=torch.bfloat16, delta=True) on a real two-host Ray cluster (two
network namespaces, see ``tests/multihost.py``): the trainer (fp32 masters, AdamW) on host A,
actors holding bf16 models on both hosts; host B gets each version as deltas."""

from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("zstandard")

from multihost import TwoHostCluster, cluster_for_module  # noqa: E402
from ray_actors import digest, tiny_transformer  # noqa: E402
from slot_damage import KINDS  # noqa: E402

import weightsync as ws  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.multihost]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_for_module(TESTS_DIR)


@pytest.fixture
def actors(cluster: TwoHostCluster):
    from ray_actors import DeltaCollector

    made = []

    def make(scheme, hosts, dtype=BF16, first=0):
        """One DeltaCollector per entry of ``hosts`` ("a"/"b"), worker index from ``first``."""
        group = [DeltaCollector.options(**cluster.on(host)).remote(scheme, first + i, dtype)
                 for i, host in enumerate(hosts)]
        ray.get([a.path.remote() for a in group], timeout=60)
        made.extend(group)
        return group

    yield make
    for actor in made:
        ray.kill(actor)


def cast_digest(model, dtype=BF16):
    return digest({k: v.to(dtype) if v.is_floating_point() else v
                   for k, v in model.state_dict().items()})


def states(group):
    return ray.get([a.state.remote() for a in group], timeout=30)


def step(model, optimizer):
    tokens = torch.randint(0, 8192, (2, 8))
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def last(sender):
    return sender.stats()["last"]


def nbytes(model, dtype=BF16):
    return sum(v.numel() * (dtype.itemsize if v.is_floating_point() else v.element_size())
               for v in model.state_dict().values())


def test_adamw_steps_reach_the_other_host_as_deltas(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30, dtype=BF16, delta=True)
    group = actors(scheme, ["a", "b", "b"])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        assert sender.connect(timeout=60) == 0
        assert ray.get([a.path.remote() for a in group]) == ["node-local", "broadcast", "relayed"]
        assert states(group) == [(0, cast_digest(model))] * 3
        full = nbytes(model)
        assert full < last(sender)["wire_bytes"] < 1.01 * full  # host B once, whole
        for version in range(1, 5):
            step(model, optimizer)
            assert sender.send(timeout=30) == version
            assert states(group) == [(version, cast_digest(model))] * 3
            figures = last(sender)
            assert figures["delta_chunks"] == figures["chunks"] == 2  # host B's relay only
            assert figures["wire_bytes"] < 0.2 * full, figures


def test_corrupted_delta_at_the_relay_reaches_nobody_and_is_sent_whole(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30, dtype=BF16, delta=True)
    group = actors(scheme, ["a", "b", "b"])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.get(group[1].corrupt_next_delta.remote())  # host B's relay
        step(model, optimizer)
        assert sender.send(timeout=30) == 1
        figures = last(sender)
        assert figures["delta_refused"] == 1 and figures["chunks"] == 4, figures
        assert figures["wire_bytes"] > nbytes(model)  # the deltas, then the whole version
        assert states(group) == [(1, cast_digest(model))] * 3  # the follower too
        step(model, optimizer)
        assert sender.send(timeout=30) == 2
        assert last(sender)["delta_chunks"] == 2 and last(sender)["delta_refused"] == 0
        assert states(group) == [(2, cast_digest(model))] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_or_compensating_bytes_in_a_delta_base_are_refused_and_sent_whole(actors, kind):
    """Host B's base damaged in a way a sum of 64-bit words misses: the delta rebuilt on it
    fails its checksum, nobody applies it, the host gets the whole version in the same
    send, and the next version goes as a delta again on the repaired base."""
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30, dtype=BF16, delta=True)
    group = actors(scheme, ["a", "b", "b"])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.get(group[1].damage_next_base.remote(kind))  # host B's relay
        step(model, optimizer)
        assert sender.send(timeout=30) == 1
        figures = last(sender)
        assert figures["delta_refused"] == 1, figures
        assert figures["wire_bytes"] > nbytes(model)  # the deltas, then the whole version
        assert states(group) == [(1, cast_digest(model))] * 3
        step(model, optimizer)
        assert sender.send(timeout=30) == 2
        assert last(sender)["delta_chunks"] == 2 and last(sender)["delta_refused"] == 0
        assert states(group) == [(2, cast_digest(model))] * 3


@pytest.mark.parametrize(("field", "value"), [(1, 2**40), (1, -8)], ids=["2**40", "negative"])
def test_a_header_size_no_sender_writes_at_the_relay_is_refused_and_sent_whole(actors, field,
                                                                               value):
    """Host B's relay is told a chunk of 2**40 (or -8) payload bytes: it allocates nothing
    for it, takes the rest of the stream, refuses the version, and gets it whole."""
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30, dtype=BF16, delta=True)
    group = actors(scheme, ["a", "b", "b"])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.get(group[1].corrupt_next_header.remote(field, value))  # host B's relay
        step(model, optimizer)
        assert sender.send(timeout=30) == 1
        figures = last(sender)
        assert figures["delta_refused"] == 1 and figures["chunks"] == 4, figures
        assert states(group) == [(1, cast_digest(model))] * 3  # the follower too
        step(model, optimizer)
        assert sender.send(timeout=30) == 2
        assert last(sender)["delta_chunks"] == 2 and last(sender)["delta_refused"] == 0
        assert states(group) == [(2, cast_digest(model))] * 3


def test_skipped_and_late_actors_take_whole_chunks_then_deltas(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, delta=True)
    group = actors(scheme, ["a", "b"])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        step(model, optimizer)
        assert sender.send(worker_ids=[0], timeout=30) == 1  # host B skipped
        assert last(sender)["wire_bytes"] == 0
        step(model, optimizer)
        assert sender.send(timeout=30) == 2
        assert last(sender)["delta_chunks"] == 0 and last(sender)["chunks"] == 2
        step(model, optimizer)
        assert sender.send(timeout=30) == 3
        assert last(sender)["delta_chunks"] == 2
        assert states(group) == [(3, cast_digest(model))] * 2
        ray.kill(group[1])  # host B's actor restarts: the new one holds nothing
        late = actors(scheme, ["b"], first=1)[0]
        step(model, optimizer)
        assert sender.send(timeout=30) == 4
        assert last(sender)["delta_chunks"] == 0 and last(sender)["chunks"] == 2
        step(model, optimizer)
        assert sender.send(timeout=30) == 5
        assert last(sender)["delta_chunks"] == 2
        assert states([group[0], late]) == [(5, cast_digest(model))] * 2


def test_everything_changed_falls_back_to_whole_chunks(actors):
    """fp32 sent as fp32: an AdamW step changes nearly every word, so every chunk goes
    whole by itself and costs no more than the full version."""
    scheme = ws.RayWeightSyncScheme(num_workers=1, timeout=30, delta=True)
    group = actors(scheme, ["b"], dtype=torch.float32)
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        step(model, optimizer)
        assert sender.send(timeout=30) == 1
        figures = last(sender)
        assert figures["delta_chunks"] == 0 and figures["chunks"] == 3, figures
        assert figures["wire_bytes"] < 1.001 * nbytes(model, torch.float32)
        assert states(group) == [(1, cast_digest(model, torch.float32))]
