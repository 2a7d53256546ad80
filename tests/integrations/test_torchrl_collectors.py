"""weightsync's TorchRL schemes inside real TorchRL collectors on a real CartPole env.

The policy is a probe: version v of the weights holds the value 100 + v everywhere, and each
step records the min and max of the weights that computed it, so a batch shows exactly
which version produced it (and a torn or never-filled policy shows up as min != max or a
value that no version had)."""

from __future__ import annotations

import functools
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
from torchrl_helpers import fill_, make_cartpole, make_filled_probe, make_probe_policy

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
    assert SharedMemWeightSyncScheme(per_worker_weights=True).per_worker_weights is True
    assert SharedMemWeightSyncScheme().per_worker_weights is False


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


def worker_weight_values(collector: Any) -> list[set[float]]:
    """The values each worker's policy holds now, asked of the workers themselves (their
    collectors' ``state_dict``), without starting a batch."""
    state = collector.state_dict()
    return [{v for t in state[f"worker{w}"]["policy_state_dict"].values()
             for v in torch.as_tensor(t).flatten().unique().tolist()}
            for w in range(collector.num_workers)]


@pytest.mark.parametrize("kind", sorted(SCHEMES))
def test_idle_sync_worker_takes_a_version_as_it_arrives(kind: str) -> None:
    """A MultiSyncCollector worker idle between batches holds the new version soon after
    update_policy_weights_() returns, before its next batch starts (as with TorchRL's own
    schemes: a user who updates, then inspects or evaluates, sees the new weights); its next
    batch is still that one version, whole and tagged."""
    policy = make_probe_policy()
    fill_(policy, BASE)
    scheme = SCHEMES[kind](timeout=60)
    collector = MultiSyncCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                                   total_frames=300, weight_sync_schemes={"policy": scheme},
                                   track_policy_version=True)
    try:
        for i, batch in enumerate(collector):
            versions = assert_tags_match_weights(batch)
            assert set(versions.flatten().tolist()) == {i}, i
            fill_(policy, BASE + i + 1)
            collector.update_policy_weights_()
            deadline = time.monotonic() + 10
            while (held := worker_weight_values(collector)) != [{BASE + i + 1}] * 2:
                assert time.monotonic() < deadline, (
                    f"after update {i + 1} the idle workers still hold {held}")
                time.sleep(0.05)
        assert i == 2, i
    finally:
        collector.shutdown()


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


# ---------------------------------------------------------------------- per-worker weights
def probe_values(batch: Any) -> torch.Tensor:
    """The value every weight held behind each frame (one per frame: a frame computed from
    a torn policy, min != max, fails)."""
    lo, hi = batch["probe_min"], batch["probe_max"]
    assert torch.equal(lo, hi), "a frame was computed from weights of mixed versions"
    return lo


def probe_weights(value: float, width: int = 256) -> Any:
    from tensordict import TensorDict

    return TensorDict.from_module(make_filled_probe(value, width)).data


def test_per_worker_weights_need_per_worker_streams() -> None:
    """Without per-worker weights, a {worker: weights} dict is refused by name; params_map
    comes alone, as with TorchRL; the Ray scheme refuses per-worker weights."""
    from weightsync.integrations.torchrl import RayWeightSyncScheme

    scheme = SharedMemWeightSyncScheme(timeout=10)
    with pytest.raises(ValueError, match="params_map comes alone"):
        scheme.init_on_sender(params_map={0: probe_weights(1.0)}, model=make_probe_policy())
    with pytest.raises(ValueError, match="every worker index"):
        SharedMemWeightSyncScheme().init_on_sender(params_map={1: probe_weights(1.0)})
    with pytest.raises(ValueError, match="per-worker weights"):
        RayWeightSyncScheme()._init_on_sender_impl(params_map={0: probe_weights(1.0)},
                                                   remote_collectors=[object()])

    policy = make_probe_policy()
    collector = MultiSyncCollector([make_cartpole], policy, frames_per_batch=20,
                                   total_frames=100,
                                   weight_sync_schemes={"policy": SharedMemWeightSyncScheme()})
    try:
        with pytest.raises(ValueError, match="per_worker_weights=True"):
            collector.update_policy_weights_({0: probe_weights(1.0)})
    finally:
        collector.shutdown()
    assert weightsync_threads() == []


def test_per_worker_weights_with_distinct_factories() -> None:
    """TorchRL's test_per_worker_weight_sync_with_distinct_factories and
    ..._multiple_workers_update, on our scheme: each worker's policy comes from its own
    factory (worker 2's of another layout), version 0 is each factory's weights, and each
    worker has its own stream of versions. An update of one worker, of all at once, of a
    subset (worker_ids=), each reaches exactly the named workers' next batch, whole (every
    frame's min == max), as a snapshot of the weights at the call, with the worker's own
    version in its policy_version tags."""
    factories = [functools.partial(make_filled_probe, 0.0),
                 functools.partial(make_filled_probe, 10.0),
                 functools.partial(make_filled_probe, 20.0, width=128)]
    scheme = SharedMemWeightSyncScheme(per_worker_weights=True, timeout=60)
    collector = MultiSyncCollector([make_cartpole] * 3, policy_factory=factories,
                                   frames_per_batch=60, total_frames=60 * 50,
                                   weight_sync_schemes={"policy": scheme},
                                   track_policy_version=True, cat_results="stack")
    procs = list(collector.procs)
    try:
        batches = iter(collector)

        def expect(values: list[float], versions: list[int]) -> None:
            batch = next(batches)
            for worker in range(3):
                assert set(probe_values(batch)[worker].tolist()) == {values[worker]}, worker
                assert set(batch["policy_version"][worker].tolist()) == {versions[worker]}
                assert set(batch["next", "policy_version"][worker].tolist()) == {
                    versions[worker]}

        expect([0.0, 10.0, 20.0], [0, 0, 0])

        # one worker: the others keep their weights and their versions
        w0 = probe_weights(100.0)
        collector.update_policy_weights_({0: w0})
        w0.apply_(lambda t: t.fill_(999.0))  # after the call: a snapshot, never seen
        expect([100.0, 10.0, 20.0], [1, 0, 0])

        # every worker at once, each its own weights (worker 2 in its own layout)
        collector.update_policy_weights_({0: probe_weights(200.0), 1: probe_weights(300.0),
                                          2: probe_weights(400.0, width=128)})
        expect([200.0, 300.0, 400.0], [2, 1, 1])

        # a subset: the same weights to workers 0 and 1 only
        collector.update_policy_weights_(probe_weights(500.0), worker_ids=[0, 1])
        expect([500.0, 500.0, 400.0], [3, 2, 1])

        # a subset of a per-worker dict: only the worker named
        collector.update_policy_weights_({1: probe_weights(600.0), 2: probe_weights(
            700.0, width=128)}, worker_ids=[2])
        expect([500.0, 500.0, 700.0], [3, 2, 2])
        assert scheme.worker_versions == {0: 3, 1: 2, 2: 2}

        # weights of another layout for worker 2 are refused by name, nothing sent
        from weightsync import SchemaMismatchError

        with pytest.raises(SchemaMismatchError):
            collector.update_policy_weights_({0: probe_weights(1.0), 2: probe_weights(1.0)})
        assert scheme.worker_versions == {0: 3, 1: 2, 2: 2}
        expect([500.0, 500.0, 700.0], [3, 2, 2])
    finally:
        collector.shutdown()
    assert not wait_dead(procs), "collector workers still alive after shutdown()"
    assert weightsync_threads() == []


@pytest.mark.parametrize("kind", sorted(SCHEMES))
def test_params_map_before_the_collector(kind: str) -> None:
    """TorchRL's test_update_weights_shared_mem on our schemes: init_on_sender(params_map=)
    before the collector (which then skips its own init_on_sender). Each worker's weights
    are its params_map entry, read at every update (here the trainer policy's own
    tensors): each batch comes from one whole version, the newest at its start."""
    from tensordict import TensorDict

    policy = make_probe_policy()
    fill_(policy, BASE)
    weights = TensorDict.from_module(policy)  # the policy's own tensors
    scheme = SCHEMES[kind](timeout=60)
    scheme.init_on_sender(params_map={0: weights, 1: weights})
    collector = MultiAsyncCollector([make_cartpole] * 2, policy, frames_per_batch=50,
                                    total_frames=600, weight_sync_schemes={"policy": scheme},
                                    track_policy_version=True)
    procs = list(collector.procs)
    seen = []
    try:
        for batch in collector:
            (version,) = set(assert_tags_match_weights(batch).tolist())
            assert version <= scheme.version
            seen.append(version)
            fill_(policy, BASE + scheme.version + 1)
            collector.update_policy_weights_()
            assert scheme.worker_versions == {0: scheme.version, 1: scheme.version}
        assert torch.equal(weights["module", "weight"], policy.module.weight)
    finally:
        collector.shutdown()
        scheme.shutdown()  # made before the collector: the collector never closes it
    assert max(seen) >= 3, f"versions did not advance: {seen}"
    assert not wait_dead(procs)
    assert weightsync_threads() == []


def test_device_map_fn_and_killed_worker_with_per_worker_weights() -> None:
    """init_on_sender(model=, device_map_fn=, num_workers=) before the collector: each worker
    gets device_map_fn(worker, weights) (here, worker 1 the weights + 1). A worker killed
    is named (WorkerLostError, worker_ids == (1,)); the survivor still takes versions."""
    policy = make_probe_policy()
    fill_(policy, BASE)

    def device_map_fn(worker: int, weights: Any) -> Any:
        return weights.apply(lambda t: t + worker)

    scheme = SharedMemWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=policy, device_map_fn=device_map_fn, num_workers=2)
    collector = MultiSyncCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                                   total_frames=10_000, weight_sync_schemes={"policy": scheme})
    procs = list(collector.procs)
    try:
        batches = iter(collector)
        values = probe_values(next(batches))
        assert [set(values[w].tolist()) for w in (0, 1)] == [{BASE}, {BASE + 1}]
        fill_(policy, BASE + 5)
        collector.update_policy_weights_()
        values = probe_values(next(batches))
        assert [set(values[w].tolist()) for w in (0, 1)] == [{BASE + 5}, {BASE + 6}]

        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(30)
        t0 = time.monotonic()
        with pytest.raises(ws.WorkerLostError, match="worker") as info:
            collector.update_policy_weights_()
        assert info.value.worker_ids == (1,)
        assert time.monotonic() - t0 < 30
        fill_(policy, BASE + 7)
        collector.update_policy_weights_(worker_ids=[0])
        assert scheme.worker_versions[0] == 3
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert not wait_dead(procs)
    assert weightsync_threads() == []


@pytest.mark.ray
@pytest.mark.slow
def test_ray_collector_on_the_trainers_node() -> None:
    """TorchRL's RayCollector takes weight_sync_schemes too: its collector actors on the
    trainer's node join a same-host scheme like process workers do (actors on any node:
    RayWeightSyncScheme, in test_torchrl_ray.py)."""
    ray = pytest.importorskip("ray", reason="ray is not installed")
    from ray_processes import workers_without_vllm
    from torchrl.collectors.distributed import RayCollector
    from torchrl_ray_checks import python_path

    started = not ray.is_initialized()
    if started:
        with workers_without_vllm():  # they import TorchRL, and use no vLLM
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024,
                     runtime_env={"env_vars": {"PYTHONPATH": python_path(
                         os.path.dirname(__file__))}})
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


# ---------------------------------------------------------------------- the network scheme
def test_multisync_collector_on_the_network_scheme_bf16_deltas() -> None:
    """A MultiSyncCollector whose workers take each version over weightsync's network
    scheme (loopback here; the two-host case is tests/transports/test_net_scheme_hosts.py):
    bf16 on the wire with deltas (the probe's values are exact in bf16), every batch one
    whole version, ``worker_ids`` updating only those, one fetch per host."""
    from weightsync.integrations.torchrl import NetWeightSyncScheme

    policy = make_probe_policy()
    fill_(policy, BASE)
    scheme = NetWeightSyncScheme(dtype=torch.bfloat16, delta=True, timeout=60)
    collector = MultiSyncCollector([make_cartpole] * 2, policy, frames_per_batch=100,
                                   total_frames=500, weight_sync_schemes={"policy": scheme},
                                   track_policy_version=True)
    procs = list(collector.procs)
    try:
        expected = [0, 0]
        for i, batch in enumerate(collector):
            versions = assert_tags_match_weights(batch)
            for worker in (0, 1):
                assert set(versions[worker].tolist()) == {expected[worker]}, (i, expected)
            version = scheme.version + 1
            fill_(policy, BASE + version)
            if i == 2:
                collector.update_policy_weights_(worker_ids=[0])
                expected[0] = version
            else:
                collector.update_policy_weights_()
                expected = [version, version]
            last = scheme._sender.stats()["last"]
            assert last["hosts"] == 1, last  # both workers share this host's one fetch
        assert expected == [5, 5], expected
    finally:
        collector.shutdown()
    assert not wait_dead(procs), "collector workers still alive after shutdown()"
    assert weightsync_threads() == []
