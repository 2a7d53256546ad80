"""RayWeightSyncScheme on a real local Ray instance (started and shut down here)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from workers import checksum, fill_all, make_model  # noqa: E402

import weightsync as ws  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "raylet" in line or "gcs_server" in line]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        _node_ip_address="127.0.0.1",  # test traffic stays on loopback
        object_store_memory=100 * 1024 * 1024,
        runtime_env={"env_vars": {"PYTHONPATH": TESTS_DIR}},
    )
    yield
    t0 = time.monotonic()
    ray.shutdown()
    assert time.monotonic() - t0 < 20, "ray.shutdown() must return promptly"
    deadline = time.monotonic() + 20
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_processes(), _ray_processes()


@pytest.fixture
def actors(ray_cluster):
    from ray_actors import Collector

    made = []

    def make(scheme, n, width=16, **options):
        group = [Collector.options(**options).remote(scheme, i, width) for i in range(n)]
        ray.get([a.state.remote() for a in group])
        made.extend(group)
        return group

    yield make
    for actor in made:
        ray.kill(actor)


@pytest.fixture(params=[True, False], ids=["node-local", "broadcast"])
def node_local(request):
    """Both data paths: co-located actors copying from shared memory, and the broadcast
    every actor on another node takes (forced here, on one node, with node_local=False)."""
    return request.param


def group_world_size(scheme):
    info, _layout = ray.get(ray.get_actor(scheme.connection_info_name).group_info.remote())
    return info["world_size"]


def states(group):
    return ray.get([a.state.remote() for a in group], timeout=30)


def test_versions_snapshot_and_isolation(actors, node_local):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, node_local=node_local)
    group = actors(scheme, 2)
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        assert sender.connect(timeout=60) == 0
        assert states(group) == [(0, checksum(model))] * 2
        # on one node, node-local actors take no part in the broadcast group
        assert group_world_size(scheme) == (1 if node_local else 3)
        fill_all(model, 1.0)
        sender.send_async()
        fill_all(model, 99.0)  # optimizer writes while the send is in flight
        assert sender.wait_async(timeout=30) == 1
        expected = float(sum(t.numel() for t in model.state_dict().values()))
        assert states(group) == [(1, expected)] * 2
        assert sender.send(worker_ids=[0], timeout=30) == 2
        assert states(group) == [(2, checksum(model)), (1, expected)]  # worker 1 keeps v1
        # a worker scribbling on its copy changes nothing elsewhere
        ray.get(group[1].scribble.remote())
        assert states(group)[0] == (2, checksum(model))
        assert sender.stats()["worker_lag"] == {0: 0, 1: 1}
    assert not torch.distributed.is_initialized()
    assert ray.get([a.default_group_initialised.remote() for a in group]) == [False, False]


def test_actors_created_after_the_sender_are_discovered(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    model = make_model()
    with scheme.create_sender() as sender:  # API.md's order: sender first, then the workers
        sender.register_model(model)
        group = actors(scheme, 2)
        assert sender.connect(timeout=60) == 0
        assert states(group) == [(0, checksum(model))] * 2


def test_connect_names_workers_that_never_appear(ray_cluster):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    with scheme.create_sender() as sender:
        sender.register_model(make_model())
        with pytest.raises(ws.WeightSyncTimeoutError) as info:
            sender.connect(timeout=1)
        assert info.value.worker_ids == (0, 1)


def test_receiver_learns_its_sender_is_gone(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=1, timeout=30)
    group = actors(scheme, 1)
    sender = scheme.create_sender(group)
    sender.register_model(make_model())
    sender.connect(timeout=60)
    assert states(group)[0][0] == 0
    sender.close()  # as when the trainer dies: its rendezvous actor goes with it
    t0 = time.monotonic()
    assert ray.get(group[0].receive_error.remote(5.0), timeout=30) == "SenderLostError"
    assert time.monotonic() - t0 < 10


def test_layout_mismatch_fails_at_connect(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=1, timeout=30)
    group = actors(scheme, 1, width=17)
    with scheme.create_sender(group) as sender:
        sender.register_model(make_model())
        with pytest.raises(ws.SchemaMismatchError, match="worker 0") as info:
            sender.connect(timeout=30)
        assert info.value.key is not None and info.value.key in str(info.value)


def test_tear_free_hammer_with_threaded_actors(actors, node_local):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, node_local=node_local)
    group = actors(scheme, 2, width=64, max_concurrency=2)
    model = make_model(64)
    fill_all(model, 0.0)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        runs = [a.hammer.remote(6.0) for a in group]
        for version in range(1, 101):
            fill_all(model, float(version))
            assert sender.send(timeout=30) == version
        for reads, violations, applied, final in ray.get(runs, timeout=60):
            assert violations == 0, f"{violations} torn reads of {reads}"
            assert reads >= 1000 and applied >= 2 and final == 100


def test_killed_actor_raises_then_survivors_and_replacement(actors, node_local):
    from ray_actors import Collector

    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=20, node_local=node_local)
    group = actors(scheme, 3)
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.kill(group[1])
        fill_all(model, 2.0)
        t0 = time.monotonic()
        with pytest.raises(ws.WorkerLostError) as info:
            sender.send(timeout=20)
        assert info.value.worker_ids == (1,) and "worker 1" in str(info.value)
        assert time.monotonic() - t0 < 20
        fill_all(model, 3.0)
        assert sender.send(timeout=20) == 2  # the group is rebuilt from the survivors
        assert [s[0] for s in states([group[0], group[2]])] == [2, 2]
        # a replacement announces itself and joins at the next send
        replacement = Collector.remote(scheme, 1)
        ray.get(replacement.state.remote())
        fill_all(model, 4.0)
        assert sender.send(timeout=20) == 3
        assert states([group[0], replacement, group[2]]) == [(3, checksum(model))] * 3
        # add_worker brings one in at once, with the current version under its number
        other = Collector.remote(scheme, 2)
        assert sender.add_worker(2, other, timeout=20) == 3
        assert states([other]) == [(3, checksum(model))]
        ray.kill(replacement)
        ray.kill(other)


def test_actor_killed_during_send(actors, node_local):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=20, node_local=node_local)
    group = actors(scheme, 2, width=1024)
    model = make_model(1024)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        import threading

        killer = threading.Timer(0.2, ray.kill, args=(group[1],))
        killer.start()
        lost_at = None
        for version in range(1, 500):
            try:
                sender.send(timeout=20)
            except ws.WorkerLostError as exc:
                assert exc.worker_ids == (1,)
                lost_at = version
                break
        killer.join()
        assert lost_at is not None
        assert sender.send(timeout=20) == lost_at + 1
        assert states([group[0]])[0][0] == lost_at + 1


def test_trainer_in_an_actor(actors, ray_cluster):
    from ray_actors import Trainer

    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    group = actors(scheme, 2)
    trainer = Trainer.remote(scheme, group)
    version, total = ray.get(trainer.run.remote(3), timeout=120)
    assert version == 3
    assert states(group) == [(3, total)] * 2
    ray.kill(trainer)


def test_node_local_probe_needs_its_node_its_process_and_its_token(ray_cluster):
    from weightsync.transports.ray import NodeLocalSender, probe_node_local

    local = NodeLocalSender(max_slots=2)
    try:
        assert probe_node_local(local.info)
        forged = dataclasses.replace(local.info, token="00" * 16)
        assert not probe_node_local(forged)  # another file behind that fd number
        assert not probe_node_local(dataclasses.replace(local.info, node_id="another-node"))
        assert not probe_node_local(dataclasses.replace(local.info, pid=2**22 + 7))
    finally:
        local.close()


def test_seed_ray_transport_contract():
    transport = ws.RayTransport(worker_idx=0, backend="gloo", connection_info_name="x")
    with pytest.raises(RuntimeError, match="pending"):
        transport.wait_ack()
    with pytest.raises(ValueError, match="backend"):
        ws.RayTransport(backend="mpi")
    assert isinstance(transport, ws.TransportBackend)


def test_demo_over_ray(ray_cluster):
    from weightsync.demo import run_demo

    result = run_demo("ray", workers=2, max_iterations=6, plot=None, live=False,
                      log=lambda line: None)
    assert result.final_version == 6 and len(result.batch_versions) == 48
    assert ray.is_initialized()  # the demo used our cluster and left it running
