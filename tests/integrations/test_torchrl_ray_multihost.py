"""weightsync's ``RayWeightSyncScheme`` for TorchRL inside a real ``RayCollector`` on a real
two-host Ray cluster (two network namespaces, see ``tests/multihost.py``): the trainer and
collector actor 0 on host A, collector actor 1 on host B."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torchrl", reason="torchrl is not installed (scripts/env-torchrl.sh installs it)")
pytest.importorskip("gymnasium", reason="gymnasium is not installed")
ray = pytest.importorskip("ray", reason="ray is not installed")

from multihost import TwoHostCluster, two_host_cluster, unavailable_reason  # noqa: E402
from ray_processes import workers_without_vllm  # noqa: E402
from torchrl_helpers import fill_, make_cartpole, make_probe_policy  # noqa: E402
from torchrl_ray_checks import (  # noqa: E402
    actors_dead,
    named_actor_gone,
    paths,
    python_path,
    row_version,
    weight_value,
)

import weightsync as ws  # noqa: E402
from weightsync.integrations.torchrl import RayWeightSyncScheme  # noqa: E402

pytestmark = [pytest.mark.torchrl, pytest.mark.ray, pytest.mark.slow, pytest.mark.multihost,
              pytest.mark.timeout(600)]
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoHostCluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-host cluster unavailable: {reason}")
    if ray.is_initialized():
        ray.shutdown()  # a Ray instance left by another module: this one needs its own
    with contextlib.ExitStack() as started:
        with workers_without_vllm():  # both hosts' Ray nodes: TorchRL, and no vLLM
            made = started.enter_context(two_host_cluster(python_path(TESTS_DIR, HERE)))
        yield made
    assert made.leftovers() == [], made.leftovers()


def node_of(actor: Any) -> str:
    """The Ray node an actor runs on (called inside it)."""
    return str(ray.get_runtime_context().get_node_id())


def collector_on_both_hosts(cluster: TwoHostCluster, policy: Any,
                            scheme: RayWeightSyncScheme, total_frames: int) -> Any:
    from torchrl.collectors.distributed import RayCollector

    return RayCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                        total_frames=total_frames, sync=True,
                        weight_sync_schemes={"policy": scheme},
                        remote_configs=[{"num_cpus": 0.5, **cluster.on(host)} for host in "ab"],
                        collector_kwargs={"track_policy_version": True})


def test_collector_actor_on_host_b_takes_the_broadcast(cluster: TwoHostCluster) -> None:
    """Actor 1, on host B, receives every version through the checksummed broadcast and
    tags its batches with it; actor 0, on the trainer's host, through shared memory;
    worker_ids=[1] reaches host B alone; shutdown leaves no actor behind."""
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=60)
    collector = collector_on_both_hosts(cluster, policy, scheme, total_frames=600)
    actors = list(collector.remote_collectors)
    assert ray.get([a.__ray_call__.remote(node_of) for a in actors], timeout=60) == [
        cluster.node_a, cluster.node_b]
    try:
        collector.update_policy_weights_()  # connects the actors: versions 0 and 1
        rendezvous = scheme.weightsync_scheme.connection_info_name
        assert paths(collector) == ["node-local", "broadcast"]
        info, _layout = ray.get(ray.get_actor(rendezvous).group_info.remote(), timeout=30)
        assert info["world_size"] == 2  # the broadcast group: the trainer and host B's actor
        expected = [1, 1]
        for i, batch in enumerate(collector):
            assert [row_version(batch, row) for row in (0, 1)] == expected, i
            version = scheme.version + 1
            fill_(policy, weight_value(version))
            if i == 2:
                collector.update_policy_weights_(worker_ids=[1])  # host B only
                expected[1] = version
            else:
                collector.update_policy_weights_()
                expected = [version, version]
        assert i == 5 and expected == [7, 7], (i, expected)  # 6 batches, an update after each
    finally:
        collector.shutdown()
    assert actors_dead(ray, actors), "collector actors alive after shutdown()"
    assert named_actor_gone(ray, rendezvous), "the scheme's rendezvous actor outlived it"


def test_collector_actor_on_host_b_killed_is_named(cluster: TwoHostCluster) -> None:
    """The actor on host B dies: the next update names it, within the timeout, and the actor
    on the trainer's host still takes versions."""
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=20)
    collector = collector_on_both_hosts(cluster, policy, scheme, total_frames=100_000)
    try:
        collector.update_policy_weights_()
        ray.kill(collector.remote_collectors[1])
        fill_(policy, weight_value(2))
        t0 = time.monotonic()
        with pytest.raises(ws.WorkerLostError, match="worker 1") as info:
            collector.update_policy_weights_()
        assert info.value.worker_ids == (1,) and time.monotonic() - t0 < 20
        fill_(policy, weight_value(3))
        collector.update_policy_weights_(worker_ids=[0])
        batch = ray.get(collector.remote_collectors[0].next.remote(), timeout=60)
        assert set(batch["policy_version"].tolist()) == {3}
        assert set(batch["probe_min"].tolist()) == set(batch["probe_max"].tolist()) == {
            weight_value(3)}
    finally:
        collector.shutdown()
