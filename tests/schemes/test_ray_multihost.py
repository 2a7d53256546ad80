"""RayWeightSyncScheme on a real two-host Ray cluster (two network namespaces, see
``tests/multihost.py``): the trainer on host A, actors on both hosts."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from multihost import TwoHostCluster, cluster_for_module  # noqa: E402
from slot_damage import KINDS  # noqa: E402
from workers import checksum, fill_all, make_model  # noqa: E402

import weightsync as ws  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.multihost]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_for_module(TESTS_DIR)


@pytest.fixture
def actors(cluster: TwoHostCluster):
    from ray_actors import Collector

    made = []

    def make(scheme, hosts, width=16, **options):
        """One Collector per entry of ``hosts`` ("a"/"b"), worker index = position."""
        group = [Collector.options(**cluster.on(host), **options).remote(scheme, i, width)
                 for i, host in enumerate(hosts)]
        ray.get([a.state.remote() for a in group], timeout=60)
        made.extend(group)
        return group

    yield make
    for actor in made:
        ray.kill(actor)


def states(group):
    return ray.get([a.state.remote() for a in group], timeout=30)


def paths(group):
    return ray.get([a.weightsync_path.remote() for a in group], timeout=30)


def fill_random(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))


def world_size(scheme):
    info, _layout = ray.get(ray.get_actor(scheme.connection_info_name).group_info.remote())
    return info["world_size"]


def test_hosts_take_their_paths_versions_snapshot_isolation(cluster, actors):
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30)
    group = actors(scheme, ["a", "b", "b"])
    assert ray.get([a.node_id.remote() for a in group]) == [cluster.node_a] + [cluster.node_b] * 2
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        assert sender.connect(timeout=60) == 0
        # host B's first actor takes the broadcast and relays it to the other one
        assert paths(group) == ["node-local", "broadcast", "relayed"]
        assert world_size(scheme) == 2  # the trainer and host B's relay: one broadcast
        assert states(group) == [(0, checksum(model))] * 3
        fill_all(model, 1.0)
        sender.send_async()
        fill_all(model, 99.0)  # the optimizer writes while the send is in flight
        assert sender.wait_async(timeout=30) == 1
        expected = float(sum(t.numel() for t in model.state_dict().values()))
        assert states(group) == [(1, expected)] * 3
        assert sender.send(worker_ids=[0, 1], timeout=30) == 2
        assert states(group) == [(2, checksum(model))] * 2 + [(1, expected)]
        ray.get(group[1].scribble.remote())  # a worker's writes stay its own
        assert states([group[0], group[2]]) == [(2, checksum(model)), (1, expected)]
        assert sender.stats()["worker_lag"] == {0: 0, 1: 0, 2: 1}


def test_tear_free_hammer_across_hosts(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    group = actors(scheme, ["a", "b"], width=64, max_concurrency=2)
    model = make_model(64)
    fill_all(model, 0.0)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        runs = [a.hammer.remote(5.0) for a in group]
        for version in range(1, 61):
            fill_all(model, float(version))
            assert sender.send(timeout=30) == version
        for reads, violations, applied, final, _ in ray.get(runs, timeout=60):
            assert violations == 0, f"{violations} torn reads of {reads}"
            assert reads >= 100 and applied >= 2 and final == 60


def test_actor_on_b_killed_before_and_during_a_send(cluster, actors):
    from ray_actors import Collector

    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=20)
    group = actors(scheme, ["a", "b", "b"], width=256)
    model = make_model(256)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.kill(group[1])  # before the send
        fill_all(model, 2.0)
        t0 = time.monotonic()
        with pytest.raises(ws.WorkerLostError) as info:
            sender.send(timeout=20)
        assert info.value.worker_ids == (1,) and "worker 1" in str(info.value)
        assert time.monotonic() - t0 < 20
        fill_all(model, 3.0)
        assert sender.send(timeout=20) == 2  # the survivors, on both hosts
        assert states([group[0], group[2]]) == [(2, checksum(model))] * 2
        replacement = Collector.options(**cluster.on("b")).remote(scheme, 1, 256)
        ray.get(replacement.state.remote(), timeout=60)  # it announced itself
        fill_all(model, 4.0)
        assert sender.send(timeout=20) == 3
        group[1] = replacement
        assert states(group) == [(3, checksum(model))] * 3
        # the replacement (the lowest index on host B) is B's relay again
        assert paths(group) == ["node-local", "broadcast", "relayed"]

        killer = threading.Timer(0.3, ray.kill, args=(group[2],))  # during a send
        killer.start()
        lost_at = None
        for version in range(4, 400):
            try:
                sender.send(timeout=20)
            except ws.WorkerLostError as exc:
                assert exc.worker_ids == (2,)
                lost_at = version
                break
        killer.join()
        assert lost_at is not None
        assert sender.send(timeout=20) == lost_at + 1
        assert [s[0] for s in states(group[:2])] == [lost_at + 1] * 2
        ray.kill(replacement)


def test_trainer_in_an_actor_on_host_b(cluster, actors):
    from ray_actors import Trainer

    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    group = actors(scheme, ["a", "b"])
    trainer = Trainer.options(**cluster.on("b")).remote(scheme, group)
    assert ray.get(trainer.node_id.remote()) == cluster.node_b
    version, total = ray.get(trainer.run.remote(3), timeout=120)
    assert version == 3
    assert states(group) == [(3, total)] * 2
    # seen from host B: the actor on A is the remote one
    assert paths(group) == ["broadcast", "node-local"]
    ray.kill(trainer)


def test_corrupted_bucket_across_hosts(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    group = actors(scheme, ["a", "b"])
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        assert states(group) == [(0, checksum(model))] * 2
        before = checksum(model)
        ray.get(group[1].corrupt_wire.remote(True))
        fill_all(model, 7.0)
        assert sender.send(timeout=20) == 1  # delivered; checked before it is applied
        assert ray.get(group[1].poll_error.remote()) == "IntegrityError"
        assert states(group) == [(1, checksum(model)), (0, before)]  # kept its version
        ray.get(group[1].corrupt_wire.remote(False))
        assert sender.send(timeout=20) == 2
        assert states(group) == [(2, checksum(model))] * 2


def test_corrupted_bucket_at_a_relay_reaches_no_follower(actors):
    """Host B's relay verifies what crossed the network before it writes the version for
    the other actor of its node: a corrupted bucket is applied by neither."""
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30)
    group = actors(scheme, ["a", "b", "b"])
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        before = checksum(model)
        assert states(group) == [(0, before)] * 3
        assert paths(group) == ["node-local", "broadcast", "relayed"]
        ray.get(group[1].corrupt_wire.remote(True))
        fill_all(model, 7.0)
        assert sender.send(timeout=20) == 1
        assert ray.get(group[1].poll_error.remote()) == "IntegrityError"
        assert states(group) == [(1, checksum(model)), (0, before), (0, before)]
        # the relay took version 1 (it finds the corruption at poll); its follower did not
        assert sender.stats()["worker_lag"][2] == 1
        ray.get(group[1].corrupt_wire.remote(False))
        fill_all(model, 8.0)
        assert sender.send(timeout=20) == 2
        assert states(group) == [(2, checksum(model))] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_or_compensating_bytes_across_hosts_are_refused(actors, kind):
    """Damage a sum of 64-bit words misses (pages, rows or words swapped, a +x/-x pair, two
    top bits flipped) in the chunks host B's relay receives: applied by neither actor of
    host B, which takes the next version whole."""
    scheme = ws.RayWeightSyncScheme(num_workers=3, timeout=30)
    group = actors(scheme, ["a", "b", "b"], width=1024)
    model = make_model(1024)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        before = checksum(model)
        assert states(group) == [(0, before)] * 3
        ray.get(group[1].damage_wire.remote(kind))
        fill_random(model, 1)  # pages and rows that differ, so that swapping them matters
        assert sender.send(timeout=20) == 1
        assert ray.get(group[1].poll_error.remote()) == "IntegrityError"
        assert states(group) == [(1, checksum(model)), (0, before), (0, before)]
        ray.get(group[1].damage_wire.remote(None))
        fill_random(model, 2)
        assert sender.send(timeout=20) == 2
        assert states(group) == [(2, checksum(model))] * 3


def test_link_cut_during_a_send_then_restored(cluster, actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30)
    group = actors(scheme, ["a", "b"], width=1024, max_concurrency=2)
    model = make_model(1024)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        assert [s[0] for s in states(group)] == [0, 0]
        outcome = group[1].receive_outcome.remote(20.0)  # the far actor blocks in receive()
        time.sleep(1.0)
        cluster.cut_link()
        try:
            fill_all(model, 5.0)
            t0 = time.monotonic()
            with pytest.raises((ws.WeightSyncTimeoutError, ws.WorkerLostError)) as info:
                sender.send(timeout=8)
            took = time.monotonic() - t0
            assert took < 8 + 2, took
            assert info.value.worker_ids == (1,), info.value
            assert states([group[0]]) == [(1, checksum(model))]  # host A still served
            time.sleep(max(0.0, 8.0 - took))  # the far actor's liveness check runs out
        finally:
            cluster.restore_link()
        error, seconds, held = ray.get(outcome, timeout=60)
        # the far actor learns either way: its delivery failed, or its sender went silent
        assert error in ("WeightSyncError", "SenderLostError"), error
        assert seconds < 20 and held == 0, (error, seconds)
        fill_all(model, 6.0)
        version = sender.send(timeout=30)  # the group is rebuilt with host B back in it
        assert states(group) == [(version, checksum(model))] * 2
        assert world_size(scheme) == 2


ATTACK = """
import datetime, json, sys
import torch.distributed as dist
from weightsync.transports.ray.group import GroupInfo, WeightGroup
address, port, generation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
peer = dist.TCPStore(address, port, None, False, timeout=datetime.timedelta(seconds=10))
keys = peer.list_keys()  # the store hands its key names to anyone who reaches it
for key in keys:
    peer.set(key, b"forged")  # and lets anyone overwrite their values
out = {"keys": len(keys)}
for gen in (generation, generation + 1):  # the current group and the next one
    info = GroupInfo(address, port, 2, gen, "gloo", {0: 1}, 4.0, secret="00" * 32, nonce="x")
    try:
        WeightGroup(info, 1, host="10.213.0.2")
        out[f"joined_{gen}"] = True
    except Exception as exc:
        out[f"joined_{gen}"] = False
print(json.dumps(out))
"""


def test_a_peer_on_host_b_without_the_token_cannot_join(cluster, actors):
    """A third process on host B, outside Ray, reaches the trainer's store: it can list and
    overwrite keys, but joins no group and plants nothing a member accepts."""
    import json
    import subprocess
    import sys

    scheme = ws.RayWeightSyncScheme(num_workers=1, timeout=30)
    group = actors(scheme, ["b"])
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        info, _layout = ray.get(ray.get_actor(scheme.connection_info_name).group_info.remote())
        assert info["secret"] == ""  # the rendezvous actor never holds the token
        attack = subprocess.run(
            ["ip", "netns", "exec", cluster.ns_b, sys.executable, "-c", ATTACK,
             info["address"], str(info["port"]), str(info["generation"])],
            capture_output=True, text=True, timeout=90)
        result = json.loads(attack.stdout.strip().splitlines()[-1])
        generation = info["generation"]
        assert result == {"keys": result["keys"], f"joined_{generation}": False,
                          f"joined_{generation + 1}": False}, result
        assert result["keys"] >= 2
        fill_all(model, 3.0)
        assert sender.send(timeout=30) == 1  # the group the attacker tampered with
        assert sender.add_worker(0, group[0], timeout=30) == 1  # a new generation
        fill_all(model, 4.0)
        assert sender.send(timeout=30) == 2
        assert states(group) == [(2, checksum(model))]
