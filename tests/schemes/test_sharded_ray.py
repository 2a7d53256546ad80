"""A sharded trainer on the Ray scheme: every rank a real process connected to one local
Ray instance, sending its own shards point to point to the actors' relays (no gather);
the actors hold the gathered model after every send, keep their version when a rank dies
mid-send, and a layout disagreement is refused before any byte is sent."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from rank_harness import free_port, run_ranks
from ray_processes import local_ray_instance

ray = pytest.importorskip("ray")

import weightsync as ws  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_cluster():
    yield from local_ray_instance(TESTS_DIR)


@pytest.fixture
def named_actors(ray_cluster):
    """``make(scheme, n, kind)``: n actors named in the tests' namespace, up and ready."""
    from rank_harness_ray import NAMESPACE, ShardedCollector

    made = []

    def make(scheme, n, kind):
        names = [f"sharded-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
        group = [ShardedCollector.options(name=name, namespace=NAMESPACE).remote(scheme, i, kind)
                 for i, name in enumerate(names)]
        ray.get([a.weights.remote() for a in group], timeout=60)
        made.extend(group)
        return names

    yield make
    for actor in made:
        ray.kill(actor)


def test_create_sender_checks_rank_and_options():
    with pytest.raises(ValueError, match="delta"):
        ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=2, delta=True)
    with pytest.raises(ValueError, match="trainer_ranks"):
        ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=0)
    with pytest.raises(ValueError, match="gloo"):
        ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=2, backend="nccl")
    scheme = ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=2)
    assert "trainer_ranks=2" in repr(scheme)
    with pytest.raises(ValueError, match="rank must be"):
        scheme.create_sender(rank=2)
    with pytest.raises(ValueError, match="only rank 0"):
        scheme.create_sender([object()], rank=1)
    assert "trainer_ranks" not in repr(ws.RayWeightSyncScheme(num_workers=1))


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_actors_hold_the_gathered_model_after_every_send(ray_cluster, named_actors, kind):
    """FSDP2 (uneven Shard(0) rows, trained with SGD) and tensor parallel (Shard(0) and
    Shard(1) Linears, a replicated LayerNorm, sent cast to bfloat16)."""
    import torch

    dtype = torch.bfloat16 if kind == "tp" else None
    scheme = ws.RayWeightSyncScheme(num_workers=2, trainer_ranks=2, timeout=60, dtype=dtype)
    names = named_actors(scheme, 2, kind)
    steps = 3
    outcomes = run_ranks(_rank_fn("trainer_rank"), 2, 180, ray_cluster, scheme, names,
                         free_port(), steps, kind)
    assert all(o.ok for o in outcomes), outcomes
    assert [o.value["versions"] for o in outcomes] == [list(range(steps + 1))] * 2
    for version, states in enumerate(outcomes[0].value["states"]):
        assert states == [(version, 0.0), (version, 0.0)], (version, states)


def test_a_rank_killed_mid_send_fails_the_version_for_everyone(ray_cluster, named_actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, trainer_ranks=2, timeout=60)
    names = named_actors(scheme, 2, "fsdp")
    t0 = time.monotonic()
    outcomes = run_ranks(_rank_fn("killed_rank"), 2, 120, ray_cluster, scheme, names,
                         free_port())
    rank0, rank1 = outcomes
    assert rank1.exitcode is not None and rank1.exitcode < 0, rank1  # SIGKILLed
    assert rank0.ok, rank0
    assert rank0.value["error"] == "TrainerRankLostError", rank0.value
    assert rank0.value["rank"] == 1 and "trainer rank 1" in rank0.value["message"]
    # no actor took version 2, even partly: both hold version 1 exactly
    assert rank0.value["states"] == [(1, 0.0), (1, 0.0)], rank0.value
    assert time.monotonic() - t0 < 110


@pytest.mark.parametrize(("case", "match"), [("shape", "trainer rank 1"),
                                              ("overlap", "trainer ranks 0 and 1")])
def test_a_layout_disagreement_is_refused_on_every_rank(ray_cluster, named_actors, case, match):
    scheme = ws.RayWeightSyncScheme(num_workers=2, trainer_ranks=2, timeout=30)
    names = named_actors(scheme, 2, "pair")
    outcomes = run_ranks(_rank_fn("local_shard_rank"), 2, 90, ray_cluster, scheme, names,
                         free_port(), case)
    assert all(o.ok for o in outcomes), outcomes
    for o in outcomes:
        assert o.value["error"] == "SchemaMismatchError", o.value
        assert o.value["key"] == "w", o.value
        assert match in o.value["message"], o.value


def test_local_shards_and_a_plain_tensor(ray_cluster, named_actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, trainer_ranks=2, timeout=30)
    names = named_actors(scheme, 2, "pair")
    outcomes = run_ranks(_rank_fn("local_shard_rank"), 2, 90, ray_cluster, scheme, names,
                         free_port(), "ok")
    assert all(o.ok for o in outcomes), outcomes
    assert [o.value["version"] for o in outcomes] == [0, 0]
    assert outcomes[0].value["states"] == [(0, 0.0), (0, 0.0)]


def _rank_fn(name):
    import rank_harness_ray

    return getattr(rank_harness_ray, name)


def test_the_next_send_rebuilds_the_group_with_a_restarted_rank(ray_cluster, named_actors):
    from rank_harness import RankGroup

    scheme = ws.RayWeightSyncScheme(num_workers=2, trainer_ranks=2, timeout=60)
    names = named_actors(scheme, 2, "pair")
    fn = _rank_fn("restarted_rank")
    group = RankGroup()
    try:
        group.start(fn, 0, 2, ray_cluster, scheme, names, 0)
        first = group.start(fn, 1, 2, ray_cluster, scheme, names, 0)
        first.join(90)
        assert first.exitcode is not None and first.exitcode < 0, first.exitcode  # SIGKILLed
        group.start(fn, 1, 2, ray_cluster, scheme, names, 1)  # a new rank 1
        rank0, rank1 = group.collect(120)
    finally:
        group.kill_all()
    assert rank0.ok and rank1.ok, (rank0, rank1)
    assert rank0.value["connect"] == 0
    assert (rank0.value["error"], rank0.value["rank"]) == ("TrainerRankLostError", 1)
    assert rank0.value["after_failure"] == [(0, 0.0), (0, 0.0)], rank0.value
    # the new rank 1 joins after version 0, the newest committed, and writes version 1:
    # the failed version was not counted (versions stay dense)
    assert rank1.value == {"connect": 1, "joined_at": 0}, rank1.value
    assert rank0.value["retry"] == 1
    assert rank0.value["after_retry"] == [(1, 0.0), (1, 0.0)], rank0.value


@pytest.mark.parametrize("fault", ["stop", "kill0"])
def test_a_stopped_rank_or_a_dead_rank_0_is_named_within_the_deadline(
        ray_cluster, named_actors, fault):
    """Rank 1 SIGSTOPped mid-send: rank 0's send (timeout 8 s) raises
    TrainerRankLostError(rank=1) within it. Rank 0 SIGKILLed mid-send: rank 1's raises
    TrainerRankLostError(rank=0). Either way the actors keep version 0 exactly."""
    import torch
    from rank_harness import RankGroup
    from rank_harness_ray import NAMESPACE

    scheme = ws.RayWeightSyncScheme(num_workers=2, trainer_ranks=2, timeout=60)
    names = named_actors(scheme, 2, "pair")
    survivor = 0 if fault == "stop" else 1
    group, port = RankGroup(), free_port()
    try:
        for rank in (0, 1):
            group.start(_rank_fn("faulty_rank"), rank, 2, ray_cluster, scheme, names, port,
                        fault)
        [outcome] = group.collect(90, ranks=[survivor])
    finally:
        group.kill_all()
    assert outcome.ok, (outcome, outcome.traceback)
    assert outcome.value["connect"] == 0
    assert (outcome.value["error"], outcome.value["rank"]) == ("TrainerRankLostError",
                                                               1 - survivor), outcome.value
    assert outcome.value["seconds"] < (8.5 if survivor == 0 else 20.5), outcome.value
    expected = {"w": torch.arange(32.0).reshape(8, 4), "b": torch.full((4,), 7.0)}
    for name in names:
        version, state = ray.get(ray.get_actor(name, namespace=NAMESPACE).weights.remote(),
                                 timeout=30)
        assert version == 0, (name, version)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
