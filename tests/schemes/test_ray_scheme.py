"""RayWeightSyncScheme on a real local Ray instance (started and shut down here)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import pytest
import torch
from ray_processes import ray_processes

ray = pytest.importorskip("ray")

from stopped import stop_process  # noqa: E402
from workers import checksum, fill_all, make_model  # noqa: E402

import weightsync as ws  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        _node_ip_address="127.0.0.1",  # test traffic stays on loopback
        object_store_memory=100 * 1024 * 1024,
        # the caller's PYTHONPATH too: actors must import the weightsync under test
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
            [TESTS_DIR, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}},
    )
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    yield
    t0 = time.monotonic()
    ray.shutdown()
    assert time.monotonic() - t0 < 20, "ray.shutdown() must return promptly"
    deadline = time.monotonic() + 20
    while ray_processes(session_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(session_dir), ray_processes(session_dir)


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
    with scheme.create_sender() as sender:  # the contract's order: sender first, then the workers
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


def test_tied_weights_cross_once_and_stay_tied(ray_cluster, node_local):
    from ray_actors import TiedCollector, tied_model

    scheme = ws.RayWeightSyncScheme(num_workers=1, timeout=30, node_local=node_local)
    actor = TiedCollector.remote(scheme, 0, True)
    untied = ws.RayWeightSyncScheme(num_workers=1, timeout=30, node_local=node_local)
    refusing = TiedCollector.remote(untied, 0, False)
    try:
        model = tied_model(True)
        with torch.no_grad():
            model["embed"].weight.fill_(2.0)
        with scheme.create_sender([actor]) as sender:
            sender.register_model(model)
            assert sender.connect(timeout=60) == 0
            assert sender.layout.nbytes == 64 * 16 * 4  # one tensor, once
            assert ray.get(actor.state.remote(), timeout=30) == (0, 2.0, 2.0, True)
            with torch.no_grad():
                model["head"].weight.fill_(5.0)
            assert sender.send(timeout=30) == 1
            assert ray.get(actor.state.remote(), timeout=30) == (1, 5.0, 5.0, True)
        with untied.create_sender([refusing]) as sender:
            sender.register_model(tied_model(True))
            with pytest.raises(ws.SchemaMismatchError, match="'head.weight' and 'embed.weight'"):
                sender.connect(timeout=30)
    finally:
        ray.kill(actor)
        ray.kill(refusing)


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
        for reads, violations, applied, final, _ in ray.get(runs, timeout=60):
            assert violations == 0, f"{violations} torn reads of {reads}"
            assert reads >= 1000 and applied >= 2 and final == 100


def test_hammer_reads_before_the_first_apply_see_the_actors_own_weights(actors, node_local):
    """Until its first apply (version -1) an actor holds its own initial weights, not
    version 0: the sender's connect() delivers version 0 but applies nothing, and a poll()
    may return None while a version is on its way (on a loaded machine the hammer's first
    poll once met a node-local slot still being packed, and the check of version "0"
    counted the actor's initial weights as a torn read). Here the hammer polls from before
    the sender exists, so its first reads are made at version -1, and are checked."""
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, node_local=node_local)
    group = actors(scheme, 2, width=64, max_concurrency=2)
    runs = [a.hammer.remote(60.0, until=10) for a in group]
    deadline = time.monotonic() + 30
    while not all(ray.get([a.hammer_started.remote() for a in group], timeout=30)):
        assert time.monotonic() < deadline, "the hammers did not start"
        time.sleep(0.01)
    model = make_model(64)
    fill_all(model, 0.0)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        for version in range(1, 11):
            fill_all(model, float(version))
            assert sender.send(timeout=30) == version
        for reads, violations, applied, final, unversioned in ray.get(runs, timeout=60):
            assert unversioned > 0  # reads made before the first apply were checked
            assert violations == 0, f"{violations} torn reads of {reads}"
            assert applied >= 1 and final == 10


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
        # add_worker brings one in at once, with the current version under its number. The
        # actor is still starting (3-4 s alone; on a loaded 2-core CI runner it missed the
        # layout check, which gets half of a 20 s timeout): its start counts against
        # add_worker's timeout, so that timeout is the generous one
        other = Collector.remote(scheme, 2)
        assert sender.add_worker(2, other, timeout=60) == 3
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
    from weightsync.transports.ray.node_local import NodeLocalSender, probe_node_local

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


def test_ray_transport_names_what_to_use_instead():
    """The seed's per-actor class sends and receives nothing itself: each such call says
    which of the scheme's ends does it."""
    transport = ws.RayTransport(worker_idx=3, backend="gloo", model_id="policy")
    transport.set_model(torch.nn.Linear(2, 2))
    transport.setup_connection_and_weights_on_sender()  # nothing per actor
    for call in (lambda: transport.send_weights({}), lambda: transport.send_weights_async({})):
        with pytest.raises(RuntimeError, match=r"worker 3: .*sender\.send"):
            call()
    with pytest.raises(RuntimeError, match="RayWeightReceiverMixin"):
        transport.receive_weights(timeout=1)
    with pytest.raises(RuntimeError, match="worker 5: .*create_receiver"):
        transport.setup_connection_and_weights_on_receiver(worker_idx=5)


def test_demo_over_ray(ray_cluster):
    from weightsync.demo.trainer import run_demo

    result = run_demo("ray", workers=2, max_iterations=6, plot=None, live=False,
                      log=lambda line: None)
    assert result.final_version == 6 and len(result.batch_versions) == 48
    assert ray.is_initialized()  # the demo used our cluster and left it running


def test_stopped_actor_one_deadline_named_and_healthy_get_the_next(actors):
    """A SIGSTOPped actor on the broadcast path: send(timeout=T) ends within T naming it,
    and the next send reaches the healthy actor (it used to take 40 s, then a raw
    GetTimeoutError naming no worker)."""
    import signal

    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, node_local=False)
    group = actors(scheme, 2)
    model = make_model()
    pid = ray.get(group[1].pid.remote())
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        stop_process(pid)
        try:
            fill_all(model, 5.0)
            t0 = time.monotonic()
            with pytest.raises(ws.WeightSyncTimeoutError) as info:
                sender.send(timeout=6)
            assert time.monotonic() - t0 < 6 + 2
            assert info.value.worker_ids == (1,) and "worker(s) [1]" in str(info.value)
            fill_all(model, 6.0)
            t0 = time.monotonic()
            version = sender.send(timeout=6)  # rebuilt without the stopped actor
            assert time.monotonic() - t0 < 6 + 2
            assert states([group[0]]) == [(version, checksum(model))]
            assert sender.send(timeout=6) == version + 1  # no rebuild: fast
        finally:
            os.kill(pid, signal.SIGCONT)


def test_corrupted_chunk_raises_integrity_error_and_keeps_the_version(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, node_local=False)
    group = actors(scheme, 2)
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        before = checksum(model)
        assert states(group) == [(0, before)] * 2
        ray.get(group[1].corrupt_wire.remote(True))
        fill_all(model, 7.0)
        assert sender.send(timeout=20) == 1  # delivered; checked before it is applied
        assert ray.get(group[1].poll_error.remote()) == "IntegrityError"
        assert states(group) == [(1, checksum(model)), (0, before)]  # kept its version
        ray.get(group[1].corrupt_wire.remote(False))
        assert sender.send(timeout=20) == 2
        assert states(group) == [(2, checksum(model))] * 2


def test_rendezvous_refuses_a_peer_without_the_token(tmp_path):
    """A third process that reaches the trainer's TCPStore (it accepts any peer) cannot
    plant values a member accepts, nor join the group as a member."""
    import datetime
    import json
    import sys
    import threading

    import torch.distributed as dist

    from weightsync.transports.ray.group import AuthenticatedStore, GroupInfo, WeightGroup

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    secret = os.urandom(32)
    honest = AuthenticatedStore(store, secret, "gen1")
    honest.set("address/1", b"10.0.0.1:1234")
    attack = f"""
import datetime, json, sys
import torch, torch.distributed as dist
from weightsync.transports.ray.group import GroupInfo, WeightGroup
port = {store.port}
peer = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=5))
keys = peer.list_keys()  # the store hands out its key names to anyone
for key in keys:
    peer.set(key, b"evil")  # and lets anyone overwrite them
out = {{"keys": len(keys)}}
info = GroupInfo("127.0.0.1", port, 2, 2, "gloo", {{0: 1}}, 4.0, secret="00" * 32, nonce="n")
try:
    WeightGroup(info, 1, host="127.0.0.1")
    out["joined"] = True
except Exception as exc:
    out["joined"] = False
    out["error"] = type(exc).__name__ + ": " + str(exc)[:200]
print(json.dumps(out))
"""
    errors: list[BaseException] = []

    def rank0() -> None:
        info = GroupInfo("127.0.0.1", int(store.port), 2, 2, "gloo", {0: 1}, 6.0,
                         secret=secret.hex(), nonce="n")
        try:
            WeightGroup(info, 0, store=store, host="127.0.0.1")
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=rank0)
    thread.start()
    proc = subprocess.run([sys.executable, "-c", attack], capture_output=True, text=True,
                          timeout=60)
    thread.join(30)
    assert not thread.is_alive()
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["keys"] >= 1 and result["joined"] is False, result
    assert errors, "rank 0 built a group with a peer that has no token"
    with pytest.raises(ws.IntegrityError, match="not written by a holder"):
        honest.get("address/1")  # the forged value is refused


def test_checksummed_broadcast_in_chunks_catches_one_flipped_byte():
    """The group's checked broadcast (rank 0 and rank 1 in threads, real gloo over TCP):
    every chunk arrives with its checksum; a byte flipped on arrival is pinned to its chunk."""
    import datetime
    import threading

    import torch.distributed as dist

    from weightsync.transports.ray import group as ray_group
    from weightsync.transports.ray.group import GroupInfo, WeightGroup

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    nbytes = 2 * ray_group.CHUNK_BYTES + 13  # three chunks, the last one short
    sent = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    for generation, hook, expected_bad in ((1, None, []), (2, "flip", [1])):
        info = GroupInfo("127.0.0.1", int(store.port), 2, generation, "gloo", {0: 1}, 20.0,
                         secret=os.urandom(32).hex(), nonce="n")
        got = torch.zeros(nbytes, dtype=torch.uint8)
        result: dict[str, object] = {}

        def flip(pieces, seen=[0]):  # noqa: B006  (counts chunks across calls)
            if seen[0] == 1:
                pieces[0][5] ^= 0x01
            seen[0] += 1

        def member(info=info, got=got, result=result, hook=hook, flip=flip):
            group = WeightGroup(info, 1, host="127.0.0.1")
            result["bad"] = group.receive_checked([got], 20.0, flip if hook else None)

        thread = threading.Thread(target=member)
        thread.start()
        sums = WeightGroup(info, 0, store=store, host="127.0.0.1").send_checked([sent], 20.0)
        thread.join(30)
        assert len(sums) == 3 and result["bad"] == expected_bad
        if not hook:
            assert torch.equal(got, sent)


def test_checksum_helpers():
    from weightsync.transports.ray.group import _sums_list, _sums_tensor, wire_checksum

    data = torch.arange(1000, dtype=torch.int64).view(torch.uint8)[:7993]  # a ragged tail
    base = wire_checksum(data)
    for index in (0, 4000, 7992):  # a word, and a tail byte
        changed = data.clone()
        changed[index] ^= 0x80
        assert wire_checksum(changed) != base
    sums = [0, 1, 2**63, 2**64 - 1]
    assert _sums_list(_sums_tensor(sums, torch.device("cpu"))) == sums


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_nccl_backend_without_cuda_says_what_to_do():
    import pickle

    from weightsync.transports.ray.group import wire_device

    scheme = ws.RayWeightSyncScheme(num_workers=2, backend="nccl")
    copy = pickle.loads(pickle.dumps(scheme))  # what each actor receives
    assert copy.backend == "nccl" and copy.secret == scheme.secret
    with pytest.raises(ws.WeightSyncError, match="backend='gloo'"):
        wire_device("nccl")
    with pytest.raises(ValueError, match="backend"):
        wire_device("mpi")
    assert wire_device("gloo") == torch.device("cpu")


def test_streamed_pack_fills_each_chunk_as_pack_would(monkeypatch):
    """The pack streamed into the broadcast, chunk by chunk (small chunks here, so tensors
    straddle them), leaves the same bytes as one whole pack."""
    from weightsync.core.layout import Layout
    from weightsync.transports.ray import group as ray_group
    from weightsync.transports.ray.stream import can_stream, streamed_pack

    monkeypatch.setattr(ray_group, "CHUNK_BYTES", 1000)
    flat = {"a": torch.randn(37, 11), "b": torch.arange(999, dtype=torch.int64),
            "c": torch.randn(5, 300).t(),  # not contiguous
            "d": torch.tensor(3.5, dtype=torch.float64), "e": torch.zeros(0)}
    layout = Layout.from_weights(flat)
    assert can_stream(layout, flat)
    expected = layout.allocate()
    layout.pack(flat, expected)
    got = layout.allocate()
    fill = streamed_pack(layout, flat, got)
    chunks = ray_group._chunks(ray_group.bucket_buffers(layout, got))
    assert len(chunks) > 10
    for index, chunk in reversed(list(enumerate(chunks))):  # any order: each is its own
        fill(index, chunk)
    assert all(torch.equal(got[d], expected[d]) for d in expected)
    assert not can_stream(layout, flat | {"b": flat["b"].double()})  # no cast into integers
    # the scheme's dtype: floating-point tensors cast chunk by chunk, as pack casts them
    cast = layout.with_dtype(torch.bfloat16)
    assert can_stream(cast, flat)
    expected, got = cast.allocate(), cast.allocate()
    cast.pack(flat, expected)
    fill = streamed_pack(cast, flat, got)
    for index, chunk in enumerate(ray_group._chunks(ray_group.bucket_buffers(cast, got))):
        fill(index, chunk)
    assert all(torch.equal(got[d], expected[d]) for d in expected)


def test_poll_with_nothing_newer_returns_none_at_once(actors, node_local):
    """Regression: on the node-local path newer_published() said yes whatever the version,
    so callers that wait for a published version blocked for their whole timeout."""
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=20, node_local=node_local)
    group = actors(scheme, 2)
    model = make_model()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        assert sender.connect(timeout=60) == 0
        assert states(group) == [(0, checksum(model))] * 2  # version 0 applied by a poll
        for _ in range(3):
            for newer, applied, took in ray.get([a.poll_timed.remote() for a in group],
                                                timeout=30):
                assert (newer, applied) == (False, None)
                assert took < 0.5, took
        fill_all(model, 1.0)
        assert sender.send(worker_ids=[0], timeout=30) == 1
        answers = ray.get([a.poll_timed.remote() for a in group], timeout=30)
        assert [a[:2] for a in answers] == [(True, 1), (False, None)]
        assert all(took < 0.5 for _n, _a, took in answers), answers
        answers = ray.get([a.poll_timed.remote() for a in group], timeout=30)
        assert [a[:2] for a in answers] == [(False, None), (False, None)]
        held = states(group)
        assert held[0] == (1, checksum(model)) and held[1][0] == 0
