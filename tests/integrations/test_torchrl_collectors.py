"""weightsync's TorchRL schemes inside real TorchRL collectors on a real CartPole env.

The policy is a probe: version v of the weights holds the value 100 + v everywhere, and each
step records the min and max of the weights that computed it, so a batch shows exactly
which version produced it (and a torn or never-filled policy shows up as min != max or a
value that no version had)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl", reason="torchrl is not installed (scripts/env-torchrl.sh installs it)")
pytest.importorskip("gymnasium", reason="gymnasium is not installed")

from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme
from torchrl_helpers import fill_, make_cartpole, make_probe_policy

import weightsync as ws
from weightsync.integrations.torchrl import (
    MultiProcessWeightSyncScheme,
    SharedMemWeightSyncScheme,
    materialize_meta_module,
)

pytestmark = [pytest.mark.torchrl, pytest.mark.timeout(420)]

SCHEMES = {"shm": SharedMemWeightSyncScheme, "mp": MultiProcessWeightSyncScheme}
BASE = 100.0  # version v of the probe's weights holds BASE + v


def probe_versions(batch: Any) -> torch.Tensor:
    """The version of the weights behind each frame, read from the policy's own output."""
    lo, hi = batch["probe_min"], batch["probe_max"]
    assert torch.equal(lo, hi), "a frame was computed from weights of mixed versions"
    return (lo - BASE).round().long()


def assert_tags_match_weights(batch: Any) -> torch.Tensor:
    versions = probe_versions(batch)
    assert torch.equal(batch["policy_version"], versions), "policy_version != the weights used"
    assert torch.equal(batch["next", "policy_version"], versions)
    return versions


def weightsync_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("weightsync")]


def wait_dead(procs: list[Any], timeout: float = 30.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.1)
    return [p for p in procs if p.is_alive()]


# ---------------------------------------------------------------------- no processes
def test_one_import_line_gives_torchrl_schemes() -> None:
    for cls in SCHEMES.values():
        scheme = cls()
        assert isinstance(scheme, TorchRLWeightSyncScheme)
        assert scheme.sync is True
    assert isinstance(TorchRLWeightSyncScheme.from_backend("weightsync-shared"),
                      SharedMemWeightSyncScheme)
    assert isinstance(TorchRLWeightSyncScheme.from_backend("weightsync-process", sync=False),
                      MultiProcessWeightSyncScheme)
    with pytest.raises(ValueError, match="per_worker_weights"):
        SharedMemWeightSyncScheme(per_worker_weights=True)


def test_weightsync_imports_without_torchrl() -> None:
    code = "import sys, weightsync; assert 'torchrl' not in sys.modules, 'torchrl was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_meta_module_is_materialised_or_refused() -> None:
    with torch.device("meta"):
        module = torch.nn.Linear(3, 2)
    assert materialize_meta_module(module, "cpu", synced_names={"weight", "bias"})
    assert not any(t.is_meta for t in module.state_dict().values())
    assert not materialize_meta_module(module, "cpu")  # nothing left to do

    with torch.device("meta"):
        hidden = torch.nn.Linear(3, 2)
    hidden.register_buffer("scratch", torch.empty(2, device="meta"), persistent=False)
    with pytest.raises(ValueError, match="scratch"):
        materialize_meta_module(hidden, "cpu", synced_names={"weight", "bias"}, where="worker 3")


def test_single_process_collector() -> None:
    policy = make_probe_policy()
    fill_(policy, BASE)
    collector = Collector(make_cartpole(), policy, frames_per_batch=50, total_frames=150,
                          weight_sync_schemes={"policy": SharedMemWeightSyncScheme()},
                          track_policy_version=True)
    try:
        for expected, batch in enumerate(collector):
            assert set(assert_tags_match_weights(batch).tolist()) == {expected}
            fill_(policy, BASE + expected + 1)
            collector.update_policy_weights_()
    finally:
        collector.shutdown()


# ---------------------------------------------------------------------- collectors
@pytest.mark.parametrize("kind", sorted(SCHEMES))
def test_multisync_versions_worker_ids_and_clean_shutdown(kind: str) -> None:
    """MultiSyncCollector ships the policy to its workers on the meta device: the first
    batch already holds version 0 (100.0), so the workers' policies were materialised and
    filled. Each update reaches the next batch whole; worker_ids updates only those."""
    policy = make_probe_policy()
    fill_(policy, BASE)
    scheme = SCHEMES[kind](timeout=60)
    collector = MultiSyncCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                                   total_frames=700, weight_sync_schemes={"policy": scheme},
                                   track_policy_version=True)
    procs = list(collector.procs)
    try:
        expected = [0, 0]  # per worker
        split = False
        for i, batch in enumerate(collector):
            versions = assert_tags_match_weights(batch)  # shape (workers, frames)
            for worker in (0, 1):
                assert set(versions[worker].tolist()) == {expected[worker]}, (i, expected)
            split = split or expected[0] != expected[1]
            version = scheme.version + 1
            fill_(policy, BASE + version)
            if i == 3:
                collector.update_policy_weights_(worker_ids=[1])
                expected[1] = version
            else:
                collector.update_policy_weights_()
                expected = [version, version]
            assert scheme.version == version
        assert split and expected == [7, 7], expected  # 7 batches, an update after each
    finally:
        collector.shutdown()
    assert not wait_dead(procs), "collector workers still alive after shutdown()"
    assert weightsync_threads() == []


def test_multiasync_every_batch_is_one_version() -> None:
    policy = make_probe_policy()
    fill_(policy, BASE)
    scheme = SharedMemWeightSyncScheme(timeout=60)
    collector = MultiAsyncCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                                    total_frames=1200, weight_sync_schemes={"policy": scheme},
                                    track_policy_version=True)
    procs = list(collector.procs)
    seen = []
    try:
        for batch in collector:
            versions = set(assert_tags_match_weights(batch).tolist())
            assert len(versions) == 1, f"one batch came from versions {versions}"
            (version,) = versions
            assert version <= scheme.version
            seen.append(version)
            fill_(policy, BASE + scheme.version + 1)
            collector.update_policy_weights_()
    finally:
        collector.shutdown()
    assert max(seen) >= 3, f"versions did not advance: {seen}"
    assert not wait_dead(procs)
    assert weightsync_threads() == []


def test_killed_worker_is_named_not_a_hang() -> None:
    policy = make_probe_policy()
    fill_(policy, BASE)
    scheme = SharedMemWeightSyncScheme(timeout=30)
    collector = MultiSyncCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                                   total_frames=10_000, weight_sync_schemes={"policy": scheme})
    procs = list(collector.procs)
    try:
        next(iter(collector))
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(30)
        t0 = time.monotonic()
        with pytest.raises(ws.WorkerLostError, match="worker") as info:
            collector.update_policy_weights_()
        assert info.value.worker_ids == (1,)
        assert time.monotonic() - t0 < 30
        # the survivor still takes versions
        fill_(policy, BASE + 5)
        collector.update_policy_weights_(worker_ids=[0])
    finally:
        collector.shutdown()
    assert not wait_dead(procs)
    assert weightsync_threads() == []


def test_policy_factory_without_a_policy_instance() -> None:
    """MultiSyncCollector given only a policy_factory (what TorchRL's Evaluator builds in
    process mode): version 0 is a factory-made policy's weights, as with TorchRL's own
    schemes; the trainer's update_policy_weights_(weights) reaches the next batch."""
    from tensordict import TensorDict

    scheme = MultiProcessWeightSyncScheme(timeout=60)
    collector = MultiSyncCollector([make_cartpole], policy_factory=make_probe_policy,
                                   frames_per_batch=50, total_frames=150,
                                   weight_sync_schemes={"policy": scheme})
    procs = list(collector.procs)
    trainer = make_probe_policy()
    try:
        batches = iter(collector)
        assert set(next(batches)["probe_min"].reshape(-1).tolist()) == {0.0}  # factory's
        for version in (1, 2):
            fill_(trainer, BASE + version)
            collector.update_policy_weights_(TensorDict.from_module(trainer).data)
            assert scheme.version == version
            assert set(probe_versions(next(batches)).reshape(-1).tolist()) == {version}
    finally:
        collector.shutdown()
    assert not wait_dead(procs)
    assert weightsync_threads() == []


def test_evaluator_in_process_mode_with_weights() -> None:
    """TorchRL's Evaluator(backend="process") builds a MultiSyncCollector from a
    policy_factory alone and sends evaluate(weights=...) through the scheme."""
    from tensordict import TensorDict
    from torchrl.collectors import Evaluator

    def probe_metrics(batch: Any) -> dict[str, float]:
        return {"probe": float(batch["probe_max"].max()), "low": float(batch["probe_min"].min())}

    evaluator = Evaluator(make_cartpole, policy_factory=make_probe_policy, backend="process",
                          weight_sync_schemes={"policy": MultiProcessWeightSyncScheme(timeout=60)},
                          num_trajectories=1, max_steps=20, metrics_fn=probe_metrics,
                          dump_video=False)
    trainer = make_probe_policy()
    try:
        for version in (1, 2):
            fill_(trainer, BASE + version)
            result = evaluator.evaluate(weights=TensorDict.from_module(trainer).data)
            probes = {v for k, v in result.items() if k.endswith(("probe", "low"))}
            assert probes == {BASE + version}, result
    finally:
        evaluator.shutdown()


def test_stateless_policy_factory_is_refused_as_torchrl_refuses_it() -> None:
    """A policy factory making a policy without weights (RandomPolicy) has nothing to
    sync: the process schemes refuse it at construction, as TorchRL's own do (TypeError),
    rather than failing to find the policy."""
    from torchrl.envs.utils import RandomPolicy
    from torchrl.weight_update import MultiProcessWeightSyncScheme as TorchRLProcessScheme

    def stateless() -> RandomPolicy:
        return RandomPolicy(make_cartpole().action_spec)

    for scheme in (TorchRLProcessScheme(), MultiProcessWeightSyncScheme(timeout=30)):
        with pytest.raises(TypeError, match="RandomPolicy"):
            MultiSyncCollector([make_cartpole], policy_factory=stateless, frames_per_batch=50,
                               total_frames=100, weight_sync_schemes={"policy": scheme})


@pytest.mark.ray
@pytest.mark.slow
def test_ray_collector_on_the_trainers_node() -> None:
    """TorchRL's RayCollector takes weight_sync_schemes too: its collector actors on the
    trainer's node join a same-host scheme like process workers do (actors on any node:
    RayWeightSyncScheme, in test_torchrl_ray.py)."""
    ray = pytest.importorskip("ray", reason="ray is not installed")
    from torchrl.collectors.distributed import RayCollector
    from torchrl_ray_checks import python_path

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024,
                 runtime_env={"env_vars": {"PYTHONPATH": python_path(os.path.dirname(__file__))}})
    policy = make_probe_policy()
    fill_(policy, BASE)
    scheme = SharedMemWeightSyncScheme(timeout=60)
    collector = RayCollector([make_cartpole] * 2, policy, frames_per_batch=100, total_frames=600,
                             weight_sync_schemes={"policy": scheme},
                             remote_configs={"num_cpus": 0.5},
                             collector_kwargs={"track_policy_version": True})
    try:
        # RayCollector connects its workers at the first update (TorchRL's lazy start):
        # versions 0 and 1 both hold BASE; from then on version v holds BASE + v
        collector.update_policy_weights_()
        assert scheme.version == 1
        seen = []
        for batch in collector:
            (tag,) = set(batch["policy_version"].tolist())
            assert set(probe_versions(batch).tolist()) == {tag if tag >= 2 else 0}, tag
            seen.append(tag)
            fill_(policy, BASE + scheme.version + 1)
            collector.update_policy_weights_()
        assert max(seen) >= 3, seen
    finally:
        collector.shutdown()
        if started:
            ray.shutdown()
    assert weightsync_threads() == []
