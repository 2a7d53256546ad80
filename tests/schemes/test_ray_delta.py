"""RayWeightSyncScheme's ``dtype=`` and ``delta=True`` on one local Ray instance: the actors
take the group's path (``node_local=False``), as actors on other hosts do, so the delta
streams, their verification and their accounting run here cheaply (the two-host version:
``test_ray_delta_multihost.py``)."""

from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("zstandard")

from ray_actors import digest, tiny_transformer  # noqa: E402

import weightsync as ws  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [TESTS_DIR, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}})
    yield
    ray.shutdown()


@pytest.fixture
def actors(ray_cluster):
    from ray_actors import DeltaCollector

    made = []

    def make(scheme, indices, dtype=BF16):
        group = [DeltaCollector.remote(scheme, i, dtype) for i in indices]
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
    """One AdamW step on a random batch (the trainer's fp32 master weights)."""
    tokens = torch.randint(0, 8192, (2, 8))
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def last(sender):
    return sender.stats()["last"]


@pytest.mark.parametrize("node_local", [True, False], ids=["node-local", "broadcast"])
def test_dtype_alone_casts_as_packed(actors, node_local):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, node_local=node_local)
    group = actors(scheme, [0, 1])
    model = tiny_transformer()
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        assert sender.connect(timeout=60) == 0
        assert states(group) == [(0, cast_digest(model))] * 2
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step(model, optimizer)
        assert sender.send(timeout=30) == 1
        assert states(group) == [(1, cast_digest(model))] * 2
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the trainer's own
        cast_bytes = sum(v.numel() * 2 for v in model.state_dict().values())
        figures = last(sender)
        assert figures["nbytes"] == 2 * cast_bytes  # the trainer's fp32 layout
        assert figures["delta_chunks"] == 0
        # actors on the trainer's node take shared memory: nothing crosses a network
        assert figures["wire_bytes"] == (0 if node_local else 2 * cast_bytes)


def test_delta_accounting_skips_fallbacks(actors, caplog):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, delta=True,
                                    node_local=False)
    group = actors(scheme, [0, 1])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        first = last(sender)
        full = first["wire_bytes"] // 2
        assert first["delta_chunks"] == 0 and first["chunks"] == 4  # 2 chunks x 2 actors
        for version in (1, 2, 3):  # small AdamW steps: most bf16 words unchanged
            step(model, optimizer)
            assert sender.send(timeout=30) == version
            assert states(group) == [(version, cast_digest(model))] * 2
            figures = last(sender)
            assert figures["delta_chunks"] == figures["chunks"] == 4
            assert figures["wire_bytes"] < 0.25 * 2 * full
        assert sender.stats()["whole_versions"] == {"first_version": 2}
        # worker 1 skipped: then it gets whole chunks, worker 0 deltas
        step(model, optimizer)
        assert sender.send(worker_ids=[0], timeout=30) == 4
        assert last(sender)["chunks"] == 2 and last(sender)["delta_chunks"] == 2
        step(model, optimizer)
        with caplog.at_level("INFO", logger="weightsync.transports.ray.writer"):
            assert sender.send(timeout=30) == 5
        assert states(group) == [(5, cast_digest(model))] * 2
        assert last(sender)["delta_chunks"] == 2 and last(sender)["chunks"] == 4
        assert sender.stats()["whole_versions"] == {"first_version": 2, "behind": 1}
        whole = [r.getMessage() for r in caplog.records if "goes whole" in r.getMessage()]
        assert len(whole) == 1, whole
        for named in ("version 5 goes whole to worker 1 (node ", "its node holds version 3",
                      "the deltas are against version 4", "[behind]"):
            assert named in whole[0], whole
        step(model, optimizer)
        assert sender.send(timeout=30) == 6
        assert last(sender)["delta_chunks"] == 4  # both hold the base again
        # every word changes (as after a large step): whole chunks, by themselves
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * (p.abs().mean() + 1e-3))
        assert sender.send(timeout=30) == 7
        assert states(group) == [(7, cast_digest(model))] * 2
        figures = last(sender)
        assert figures["delta_chunks"] == 0 and figures["wire_bytes"] >= 2 * full


def test_corrupted_delta_is_refused_and_sent_whole(actors):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, delta=True,
                                    node_local=False)
    group = actors(scheme, [0, 1])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.get(group[1].corrupt_next_delta.remote())
        step(model, optimizer)
        assert sender.send(timeout=30) == 1  # worker 1 refused the delta, then got it whole
        figures = last(sender)
        assert figures["delta_refused"] == 1
        assert figures["chunks"] == 6 and figures["delta_chunks"] == 4
        assert states(group) == [(1, cast_digest(model))] * 2
        step(model, optimizer)
        assert sender.send(timeout=30) == 2  # its base is the verified version: deltas again
        assert last(sender)["delta_chunks"] == last(sender)["chunks"] == 4
        assert states(group) == [(2, cast_digest(model))] * 2
        assert sender.stats()["whole_versions"] == {"first_version": 2, "refused": 1}


def test_headers_no_sender_writes_are_refused_and_sent_whole(actors, caplog):
    """A chunk header whose size or kind no sender writes (2**40 bytes, a negative size,
    an unknown kind) is refused before anything is allocated for it, the stream is still
    taken to its end, and the node gets the version whole within the same send."""
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, delta=True,
                                    node_local=False)
    group = actors(scheme, [0, 1])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    corruptions = [(1, 2**40, "of 1099511627776 payload bytes (expected 1 to"),
                   (1, -8, "of -8 payload bytes (expected 1 to"),
                   (0, 9, "unknown chunk kind 9")]
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        for version, (field, value, why) in enumerate(corruptions, start=1):
            ray.get(group[1].corrupt_next_header.remote(field, value))
            step(model, optimizer)
            caplog.clear()
            with caplog.at_level("WARNING", logger="weightsync.transports.ray.writer"):
                assert sender.send(timeout=30) == version
            figures = last(sender)
            assert figures["delta_refused"] == 1
            assert figures["chunks"] == 6 and figures["delta_chunks"] == 4
            assert states(group) == [(version, cast_digest(model))] * 2
            for named in ("worker 1 (host ", f"version {version} rebuilt from deltas",
                          "(first: chunk 0, its header is refused: ", why):
                assert named in caplog.text, caplog.text
        step(model, optimizer)
        assert sender.send(timeout=30) == len(corruptions) + 1  # deltas again
        assert last(sender)["delta_chunks"] == last(sender)["chunks"] == 4
        assert states(group) == [(len(corruptions) + 1, cast_digest(model))] * 2


def test_replacement_actor_takes_whole_chunks_then_deltas(actors, caplog):
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, delta=True,
                                    node_local=False)
    group = actors(scheme, [0, 1])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        step(model, optimizer)
        sender.send(timeout=30)
        ray.kill(group[1])
        replacement = actors(scheme, [1])[0]  # announces itself: joins at the next send
        step(model, optimizer)
        with caplog.at_level("INFO", logger="weightsync.transports.ray.writer"):
            assert sender.send(timeout=30) == 2
        figures = last(sender)
        assert figures["chunks"] == 4 and figures["delta_chunks"] == 2  # whole for the new one
        assert sender.stats()["whole_versions"] == {"first_version": 2, "new_actor": 1}
        assert ("version 2 goes whole to worker 1 (node " in caplog.text
                and "a new actor: the one that verified version 1 was replaced [new_actor]"
                in caplog.text), caplog.text
        step(model, optimizer)
        assert sender.send(timeout=30) == 3
        assert last(sender)["delta_chunks"] == 4
        assert states([group[0], replacement]) == [(3, cast_digest(model))] * 2


def test_an_actor_announced_after_connect_keeps_taking_deltas(actors, caplog):
    """An actor's constructor announces it to the sender; on a loaded machine that can land
    after the trainer, handed the same actor's handle, already sent it a version. The
    announcement is the same actor again (a copy of its handle): its node still holds the
    base, so the next version still goes as deltas (it went whole before, unexplained)."""
    scheme = ws.RayWeightSyncScheme(num_workers=2, timeout=30, dtype=BF16, delta=True,
                                    node_local=False)
    group = actors(scheme, [0, 1])
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with scheme.create_sender(group) as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        ray.get(group[1].announce.remote(), timeout=30)  # the late constructor's announce
        for version in (1, 2):
            step(model, optimizer)
            with caplog.at_level("INFO", logger="weightsync.transports.ray"):
                assert sender.send(timeout=30) == version
            assert states(group) == [(version, cast_digest(model))] * 2
            assert last(sender)["delta_chunks"] == last(sender)["chunks"] == 4, last(sender)
        assert "worker 1 announced its actor again" in caplog.text, caplog.text
        assert "goes whole" not in caplog.text, caplog.text
        assert sender.stats()["whole_versions"] == {"first_version": 2}


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="dtype"):
        ws.RayWeightSyncScheme(dtype=torch.int8)
    with pytest.raises(ValueError, match="gloo"):
        ws.RayWeightSyncScheme(backend="nccl", delta=True)
    scheme = ws.RayWeightSyncScheme(dtype=BF16, delta=True)
    assert scheme.dtype is BF16 and scheme.delta is True
    assert "delta=True" in repr(scheme)
