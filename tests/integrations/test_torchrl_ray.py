"""weightsync's ``RayWeightSyncScheme`` for TorchRL inside a real ``RayCollector`` (real Ray
actors, real CartPole) on one node: both data paths (the node-local shared memory, and the
broadcast every actor on another node takes, forced here with ``node_local=False``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl", reason="torchrl is not installed (scripts/env-torchrl.sh installs it)")
pytest.importorskip("gymnasium", reason="gymnasium is not installed")
ray = pytest.importorskip("ray", reason="ray is not installed")

from ray_processes import workers_without_vllm  # noqa: E402
from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme  # noqa: E402
from torchrl_helpers import fill_, make_cartpole, make_probe_policy  # noqa: E402
from torchrl_ray_checks import (  # noqa: E402
    actors_dead,
    corrupt_wire,
    named_actor_gone,
    paths,
    python_path,
    row_version,
    weight_value,
)

import weightsync as ws  # noqa: E402
from weightsync.integrations.torchrl import RAY_BACKEND, RayWeightSyncScheme  # noqa: E402

pytestmark = [pytest.mark.torchrl, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]
HERE = os.path.dirname(os.path.abspath(__file__))
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()  # a Ray instance left by another module: this one needs its own
    with workers_without_vllm():  # they import TorchRL, and use no vLLM
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024,
                 runtime_env={"env_vars": {"PYTHONPATH": python_path(HERE)}})
    try:
        yield
    finally:
        ray.shutdown()


def ray_collector(policy: Any, scheme: RayWeightSyncScheme, **kwargs: Any) -> Any:
    from torchrl.collectors.distributed import RayCollector

    return RayCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                        weight_sync_schemes={"policy": scheme},
                        remote_configs={"num_cpus": 0.5},
                        collector_kwargs={"track_policy_version": True}, **kwargs)


def weightsync_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("weightsync")]


def test_one_import_line_gives_torchrls_ray_scheme() -> None:
    scheme = RayWeightSyncScheme()
    assert isinstance(scheme, TorchRLWeightSyncScheme)
    assert (scheme.backend, scheme.sync, scheme.node_local, scheme.checksums) == (
        "gloo", True, True, True)
    made = TorchRLWeightSyncScheme.from_backend(RAY_BACKEND, timeout=5)
    assert isinstance(made, RayWeightSyncScheme) and made.timeout == 5
    with pytest.raises(ValueError, match="backend"):
        RayWeightSyncScheme(backend="mpi")


def test_the_clusters_workers_run_without_vllm(ray_cluster: None) -> None:
    """``workers_without_vllm``: a Ray worker of this module's instance, and a process it
    starts, find no vLLM (where it is installed, TorchRL would import it in each)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: nothing to hide")

    @ray.remote(num_cpus=0)
    def finds_vllm() -> tuple[bool, bool]:
        import subprocess
        import sys

        child = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                                "print(u.find_spec('vllm') is not None)"],
                               capture_output=True, text=True, timeout=60, check=True)
        return importlib.util.find_spec("vllm") is not None, child.stdout.strip() == "True"

    assert ray.get(finds_vllm.remote(), timeout=60) == (False, False)
    assert importlib.util.find_spec("vllm") is not None  # the driver keeps it


@pytest.mark.parametrize("node_local", [True, False], ids=["node-local", "broadcast"])
def test_ray_collector_versions_worker_ids_and_shutdown(ray_cluster: None,
                                                        node_local: bool) -> None:
    """Each update reaches every actor's next batch whole, tagged with its version;
    worker_ids=[1] updates only actor 1; shutdown removes the actors and the rendezvous."""
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=60, node_local=node_local)
    collector = ray_collector(policy, scheme, total_frames=700, sync=True)
    actors = list(collector.remote_collectors)
    try:
        collector.update_policy_weights_()  # connects the actors: versions 0 and 1
        assert scheme.version == 1
        rendezvous = scheme.weightsync_scheme.connection_info_name
        expected = [1, 1]
        split = False
        for i, batch in enumerate(collector):
            assert [row_version(batch, row) for row in (0, 1)] == expected, i
            if i == 0:
                want = "node-local" if node_local else "broadcast"
                assert paths(collector) == [want, want]
            split = split or expected[0] != expected[1]
            version = scheme.version + 1
            fill_(policy, weight_value(version))
            if i == 2:
                collector.update_policy_weights_(worker_ids=[1])
                expected[1] = version
            else:
                collector.update_policy_weights_()
                expected = [version, version]
            assert scheme.version == version
        assert split and i == 6, (split, i)  # 7 batches of 100 frames
    finally:
        collector.shutdown()
    assert actors_dead(ray, actors), "collector actors alive after shutdown()"
    assert named_actor_gone(ray, rendezvous), "the scheme's rendezvous actor outlived it"
    assert weightsync_threads() == []


def test_async_ray_collector_every_batch_is_one_version(ray_cluster: None) -> None:
    """RayCollector(sync=False, update_after_each_batch=True) updates the actor whose batch
    just arrived (worker_ids=its index) while the other one collects; the scheme's
    sync=False returns once the snapshot is taken, before that actor's next batch starts."""
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=60, sync=False)
    collector = ray_collector(policy, scheme, total_frames=1000, sync=False,
                              update_after_each_batch=True)
    seen: list[int] = []
    try:
        collector.update_policy_weights_()
        for batch in collector:
            assert batch["policy_version"].ndim == 1  # one actor's batch
            lo = batch["probe_min"]
            assert (lo == batch["probe_max"]).all(), "a frame from weights of mixed versions"
            (tag,) = set(batch["policy_version"].tolist())
            assert set(lo.tolist()) == {weight_value(tag)}, tag
            seen.append(tag)
            fill_(policy, weight_value(scheme.version + 1))  # sent after this batch
    finally:
        collector.shutdown()
    assert len(seen) == 10 and max(seen) >= 4, seen


def test_corrupted_version_is_skipped_not_applied(ray_cluster: None) -> None:
    """A version whose bytes fail their checksums in actor 1 is not applied: that actor keeps
    collecting with the version it holds (and says so), and the next version applies."""
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=30, node_local=False)
    collector = ray_collector(policy, scheme, total_frames=300, sync=True)
    corrupted = collector.remote_collectors[1]
    expected = [[1, 1], [2, 1], [3, 3]]
    try:
        collector.update_policy_weights_()
        for i, batch in enumerate(collector):
            assert [row_version(batch, row) for row in (0, 1)] == expected[i], i
            ray.get(corrupted.__ray_call__.remote(corrupt_wire, i == 0), timeout=30)
            fill_(policy, weight_value(scheme.version + 1))
            collector.update_policy_weights_()  # delivered: checked before it is applied
    finally:
        collector.shutdown()
    assert i == 2, i


def test_killed_collector_actor_is_named(ray_cluster: None) -> None:
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=20)
    collector = ray_collector(policy, scheme, total_frames=100_000, sync=True)
    try:
        collector.update_policy_weights_()
        ray.kill(collector.remote_collectors[1])
        t0 = time.monotonic()
        with pytest.raises(ws.WorkerLostError, match="worker") as info:
            collector.update_policy_weights_()
        assert info.value.worker_ids == (1,)
        assert time.monotonic() - t0 < 20
        fill_(policy, weight_value(3))
        collector.update_policy_weights_(worker_ids=[0])  # the survivor still takes them
        assert scheme.version == 3
        batch = ray.get(collector.remote_collectors[0].next.remote(), timeout=60)
        assert set(batch["policy_version"].tolist()) == {3}
        assert set(batch["probe_min"].tolist()) == set(batch["probe_max"].tolist()) == {
            weight_value(3)}
    finally:
        collector.shutdown()


@pytest.mark.parametrize("collector_class", ["MultiSyncCollector", "MultiAsyncCollector"])
def test_multi_collector_actor_forwards_versions_to_its_processes(
        ray_cluster: None, collector_class: str) -> None:
    """An actor that is a multi-process collector applies each version on delivery and
    forwards it, through its own (weightsync) shared-memory scheme, to its worker processes:
    every frame comes from one whole version; with MultiSyncCollector (workers idle between
    batches) each batch from the newest (the async one's workers may have a batch in flight,
    so its batches only show the versions arriving)."""
    import torchrl.collectors
    from torchrl.collectors.distributed import RayCollector

    from weightsync.integrations.torchrl import SharedMemWeightSyncScheme

    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=60)
    collector = RayCollector(
        [make_cartpole], policy, frames_per_batch=100, total_frames=800, sync=True,
        collector_class=getattr(torchrl.collectors, collector_class),
        num_workers_per_collector=2, weight_sync_schemes={"policy": scheme},
        remote_configs={"num_cpus": 0.5},
        collector_kwargs={"weight_sync_schemes": {"policy": SharedMemWeightSyncScheme()}})
    try:
        collector.update_policy_weights_()  # connects the actor: versions 0 and 1
        sent: list[float] = [weight_value(1)]
        seen_all: set[float] = set()
        for i, batch in enumerate(collector):
            lo, hi = batch["probe_min"].reshape(-1), batch["probe_max"].reshape(-1)
            assert torch.equal(lo, hi), f"batch {i}: a frame computed from mixed versions"
            seen = set(lo.tolist())
            assert seen <= set(sent), (i, seen, sent)
            if collector_class == "MultiSyncCollector":  # idle workers: the newest, whole
                assert seen == {sent[-1]}, (i, seen, sent)
            seen_all |= seen
            fill_(policy, weight_value(scheme.version + 1))
            collector.update_policy_weights_()
            sent.append(weight_value(scheme.version))
        assert i == 7, i
        assert len(seen_all) >= 3, (seen_all, sent)  # the versions did reach the processes
    finally:
        collector.shutdown()


def test_batches_without_a_new_version_never_wait(ray_cluster: None) -> None:
    """Regression: on the node-local path, a batch start with no newer version used to
    block in receive(timeout) for the scheme's whole timeout (20 s here, per batch). Eight
    batches between updates must take far less than one timeout, and an update still
    reaches the next batch whole."""
    policy = make_probe_policy()
    fill_(policy, weight_value(1))
    scheme = RayWeightSyncScheme(timeout=20)
    between = 8
    collector = ray_collector(policy, scheme, total_frames=100 * 2 * between, sync=True)
    took: list[float] = []
    try:
        collector.update_policy_weights_()  # connects the actors: versions 0 and 1
        batches = iter(collector)
        for expected in (1, 2):
            t0 = time.monotonic()
            for i in range(between):
                batch = next(batches)
                assert [row_version(batch, row) for row in (0, 1)] == [expected] * 2, i
            took.append(time.monotonic() - t0)
            if expected == 1:
                assert paths(collector) == ["node-local", "node-local"]
                fill_(policy, weight_value(2))
                collector.update_policy_weights_()
                assert scheme.version == 2
    finally:
        collector.shutdown()
    logger.info("%d batches between updates took %s s", between, took)
    assert all(t < 10.0 for t in took), f"{between} batches between updates took {took} s"


def test_policy_without_weights_syncs_nothing(ray_cluster: None) -> None:
    """A policy with no tensors (RandomPolicy) has nothing to sync, as with TorchRL's own
    scheme: the collector builds and collects, and updates are no-ops."""
    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs.utils import RandomPolicy

    spec = make_cartpole().action_spec
    scheme = RayWeightSyncScheme(timeout=20)
    collector = RayCollector([make_cartpole] * 2, RandomPolicy(spec), frames_per_batch=100,
                             total_frames=300, weight_sync_schemes={"policy": scheme},
                             remote_configs={"num_cpus": 0.5})
    try:
        collector.update_policy_weights_()
        t0 = time.monotonic()
        frames = 0
        for batch in collector:
            frames += batch.numel()
            collector.update_policy_weights_()
        assert frames == 300 and time.monotonic() - t0 < 15
        assert scheme.weightsync_scheme is None  # no sender, no rendezvous: nothing to move
    finally:
        collector.shutdown()
