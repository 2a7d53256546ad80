"""VLLMDoubleBufferSyncScheme: slots on disk, atomic manifest, acks; real processes and files."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from dbuf_workers import hammer_reader, looping_sender
from safetensors import safe_open
from slot_damage import KINDS, damage_slot
from workers import close_during_connect, drain, echo_worker, make_model

import weightsync as ws
from weightsync.transports.directory.manifest import MANIFEST, slot_path


@pytest.fixture
def directory(tmp_path_factory):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="ws-test-", dir=base))
    yield path
    shutil.rmtree(path)


def manifest(directory):
    return json.loads((directory / MANIFEST).read_text())


def test_slots_are_safetensors_files_updated_in_place(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        assert sender.update_weights() == 0
        inodes = {p.name: p.stat().st_ino for p in directory.glob("slot-*.safetensors")}
        assert sorted(inodes) == ["slot-0.safetensors", "slot-1.safetensors"]
        for _ in range(5):
            with torch.no_grad():
                model[0].weight.add_(1)
            sender.update_weights()
        after = {p.name: p.stat().st_ino for p in directory.glob("slot-*.safetensors")}
        assert after == inodes  # preallocated: updates copy into the existing maps
        committed = manifest(directory)["latest"]
        assert committed["version"] == 5
        with safe_open(str(slot_path(directory, committed["slot"])), "pt") as f:
            assert set(f.keys()) == set(model.state_dict())
            for name, tensor in model.state_dict().items():
                assert torch.equal(f.get_tensor(name), tensor), name


def test_cast_to_bf16_on_the_fly(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, dtype=torch.bfloat16)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()
        with safe_open(str(slot_path(directory, 0)), "pt") as f:
            assert f.get_tensor("0.weight").dtype == torch.bfloat16
            assert f.get_tensor("1.num_batches_tracked").dtype == torch.int64
        local = make_model()
        with torch.no_grad():
            local[0].weight.zero_()
        receiver = scheme.create_receiver(0)
        receiver.register_model(local)
        assert receiver.connect(timeout=5) == 0
        assert torch.equal(local[0].weight, model[0].weight.bfloat16().float())
        receiver.close()


def test_send_blocks_for_acks_and_isolation(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2, timeout=30)
    for i in range(2):
        workers.start(echo_worker, scheme, i)
    model = make_model()
    sender = scheme.create_sender()
    sender.register_model(model)
    assert sender.connect(timeout=60) == 0
    assert sorted(m[1:3] for m in drain(workers.out, 2)) == [(0, 0), (1, 0)]
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    assert sender.send(worker_ids=[0], timeout=30) == 1
    assert drain(workers.out, 1)[0][1:3] == (0, 1)
    time.sleep(0.3)
    assert workers.out.empty()  # worker 1 was not named: it keeps version 0
    assert sender.send(timeout=30) == 2
    assert sorted(m[1:3] for m in drain(workers.out, 2)) == [(0, 2), (1, 2)]
    with pytest.raises(RuntimeError, match="no send_async"):
        sender.wait_async()
    sender.send_async()
    with pytest.raises(RuntimeError, match="pending"):
        sender.send_async()
    assert sender.wait_async(timeout=30) == 3
    workers.kill(1)
    with pytest.raises(ws.WorkerLostError) as info:
        sender.send(timeout=10)
    assert info.value.worker_ids == (1,)
    sender.close()


def test_snapshot_and_explicit_weights(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.update_weights({k: torch.full_like(v, 3.0) for k, v in before.items()})
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        local = make_model()
        receiver = scheme.create_receiver(0)
        receiver.register_model(local)
        receiver.connect(timeout=5)
        with torch.no_grad():
            model[0].weight.fill_(42.0)  # the optimizer writes after the send
        assert receiver.poll() is None
        assert float(local[0].weight.flatten()[0]) == 3.0
        with torch.no_grad():
            local[0].weight.fill_(-1.0)  # a worker writing its copy touches no slot
        receiver2 = scheme.create_receiver(0)
        other = make_model()
        receiver2.register_model(other)
        receiver2.connect(timeout=5)
        assert float(other[0].weight.flatten()[0]) == 3.0
        receiver.close()
        receiver2.close()


@pytest.mark.slow
def test_tear_free_hammer_with_reader_processes(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2, timeout=30)
    weights = {f"t{i}": torch.zeros(4096) for i in range(8)}
    sender = scheme.create_sender()
    sender.register_model(weights)
    sender.update_weights()
    for i in range(2):
        workers.start(hammer_reader, scheme, i)
    sender.connect(timeout=60)
    for version in range(1, 301):
        for t in weights.values():
            t.fill_(float(version))
        assert sender.update_weights() == version
    time.sleep(0.3)
    workers.stop.set()
    for _, idx, reads, violations, applied, final in drain(workers.out, 2):
        assert violations == 0, f"reader {idx}: {violations} torn reads of {reads}"
        assert reads >= 1000 and applied >= 2 and final == 300
    sender.close()


@pytest.mark.slow
def test_sender_killed_mid_write_leaves_last_complete_version(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=30)
    ctx = mp.get_context("spawn")
    out = workers.out.new()
    proc = ctx.Process(target=looping_sender, args=(scheme, out), daemon=True)
    proc.start()
    try:
        committed = [m for m in drain(workers.out, 4, timeout=120) if m[0] == "committed"]
        assert committed
        time.sleep(0.037)  # somewhere in the middle of writing a 64 MB slot
        proc.kill()
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    state = manifest(directory)
    version = state["latest"]["version"]
    # a receiver connects after the crash, verifies the checksums and gets a whole version
    from dbuf_workers import big_model

    local = big_model()
    receiver = scheme.create_receiver(0)
    receiver.register_model(local)
    assert receiver.connect(timeout=10) == version
    assert all(bool((t == float(version)).all()) for t in local.values())
    with pytest.raises(ws.SenderLostError):
        receiver.poll()  # the trainer is gone, and the receiver says so
    # the next sender run recovers the directory and carries on numbering
    weights = big_model()
    with scheme.create_sender() as sender:
        assert sender.version == version
        sender.register_model(weights)
        for t in weights.values():
            t.fill_(-1.0)
        assert sender.update_weights() == version + 1
        assert not list(directory.glob(".*.tmp-*"))
        assert receiver.receive(timeout=10) == version + 1
        assert all(bool((t == -1.0).all()) for t in local.values())
    receiver.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_slot_raises_integrity_error_and_keeps_version(directory, damage):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()
        local = make_model()
        receiver = scheme.create_receiver(0)
        receiver.register_model(local)
        receiver.connect(timeout=5)
        held = {k: v.clone() for k, v in local.state_dict().items()}
        with torch.no_grad():
            model[0].weight.add_(1.0)
        sender.update_weights()
        path = slot_path(directory, manifest(directory)["latest"]["slot"])
        if damage == "flip":
            with open(path, "r+b") as fh:
                fh.seek(path.stat().st_size - 5)
                byte = fh.read(1)
                fh.seek(-1, 1)
                fh.write(bytes([byte[0] ^ 0x10]))
        else:
            os.truncate(path, path.stat().st_size - 64)
        fresh = scheme.create_receiver(0)
        fresh.register_model(make_model())
        with pytest.raises(ws.IntegrityError):
            receiver.poll()
        with pytest.raises(ws.IntegrityError):
            fresh.connect(timeout=2)
        assert receiver.version == 0
        assert all(torch.equal(v, held[k]) for k, v in local.state_dict().items())
        receiver.close()
        fresh.close()


def _random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=generator), "b": torch.randn(64, generator=generator)}


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_or_compensating_bytes_are_refused_and_nothing_is_applied(directory, kind):
    """Damage a sum of 64-bit words cannot see (two 4 KiB pages or 256-byte rows swapped,
    a +x/-x pair of words, the top bit of two words flipped) is an IntegrityError."""
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    with scheme.create_sender() as sender:
        sender.register_model(_random_weights(0))
        sender.update_weights()
        local = _random_weights(1)
        receiver = scheme.create_receiver(0)
        receiver.register_model(local)
        receiver.connect(timeout=5)
        held = {k: v.clone() for k, v in local.items()}
        sender.update_weights(_random_weights(2))
        damage_slot(slot_path(directory, manifest(directory)["latest"]["slot"]), kind, "w")
        with pytest.raises(ws.IntegrityError, match="checksum mismatch"):
            receiver.poll()
        assert receiver.version == 0
        assert all(torch.equal(v, held[k]) for k, v in local.items())
        receiver.close()


@pytest.mark.parametrize(("recorded", "message"), [
    (None, "records no checksum function"),
    ("lane32-weighted-v9", "records checksum function 'lane32-weighted-v9'"),
])
def test_a_manifest_of_another_checksum_function_is_refused(directory, recorded, message):
    """A manifest from an older writer (no function named) or a newer one (a function this
    reader does not know) fails clearly instead of a mismatch, or worse, a pass."""
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    with scheme.create_sender() as sender:
        sender.register_model(_random_weights(0))
        sender.update_weights()
        obj = manifest(directory)
        assert obj["checksum"] == "lane32-weighted-v1"
        if recorded is None:
            del obj["checksum"]
        else:
            obj["checksum"] = recorded
        tmp = directory / (MANIFEST + ".new")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, directory / MANIFEST)
        receiver = scheme.create_receiver(0)
        receiver.register_model(_random_weights(1))
        with pytest.raises(ws.IntegrityError, match=message):
            receiver.connect(timeout=2)
        receiver.close()


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", "C:evil"])
def test_names_that_escape_the_directory_are_refused(directory, name):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    with scheme.create_sender() as sender:
        sender.register_model({name: torch.zeros(2)})
        with pytest.raises(ValueError, match="refused"):
            sender.update_weights()
    assert not list(directory.glob("slot-*"))


def test_nothing_on_disk_is_unpickled(directory, monkeypatch):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()

        def refuse(*args, **kwargs):
            raise AssertionError("unpickling is not allowed here")

        monkeypatch.setattr(pickle, "loads", refuse)
        monkeypatch.setattr(pickle, "load", refuse)
        monkeypatch.setattr(torch, "load", refuse)
        receiver = scheme.create_receiver(0)
        receiver.register_model(make_model())
        assert receiver.connect(timeout=5) == 0
        receiver.close()


def test_mismatched_receiver_model_is_refused(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    with scheme.create_sender() as sender:
        sender.register_model(make_model())
        sender.update_weights()
        receiver = scheme.create_receiver(0)
        receiver.register_model(make_model(width=17))
        with pytest.raises(ws.SchemaMismatchError, match="worker 0"):
            receiver.connect(timeout=5)
        assert receiver.version == -1


def test_one_sender_per_directory(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    with scheme.create_sender(), pytest.raises(RuntimeError, match="another sender"):
        ws.VLLMDoubleBufferSyncScheme(directory).create_sender()


def _filled(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64,), value) for i in range(3)}


def test_close_from_another_thread_ends_a_connect_waiting_for_a_first_version(directory):
    """No version committed yet (the trainer has not started): connect(timeout=30) polls the
    directory until a close() from another thread ends it with the closed error."""
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=30)
    receiver = scheme.create_receiver(0)
    receiver.register_model(make_model())
    close_during_connect(receiver)


def test_newest_committed_and_apply_version(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2, timeout=10)
    local = _filled(-1.0)
    receiver = scheme.create_receiver(1)
    receiver.register_model(local)
    assert receiver.newest_committed() is None  # nothing committed yet
    with scheme.create_sender() as sender:
        sender.register_model(_filled(0.0))
        sender.update_weights()
        sender.update_weights(_filled(1.0))
        assert receiver.newest_committed() == 1
        assert receiver.version == -1  # reading the manifest applies nothing
        assert all(bool((t == -1.0).all()) for t in local.values())
        assert receiver.apply_version(0) == 0  # exactly that version, not the newest
        assert receiver.version == 0 and all(bool((t == 0.0).all()) for t in local.values())
        assert json.loads((directory / "ack-1.json").read_text())["version"] == 0
        assert receiver.apply_version(1, timeout=5) == 1
        assert all(bool((t == 1.0).all()) for t in local.values())
        sender.update_weights(_filled(3.0))
        sender.update_weights(_filled(4.0))  # versions 0 and 1 are overwritten by now
        assert receiver.newest_committed() == 3
        for gone in (0, 99):
            with pytest.raises(ws.WeightSyncError, match=f"worker 1: version {gone} is not in any slot"):
                receiver.apply_version(gone)
        assert receiver.version == 1 and all(bool((t == 1.0).all()) for t in local.values())
    receiver.close()


def test_newest_committed_follows_worker_ids(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2, timeout=30)
    workers.start(echo_worker, scheme, 0)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()
        assert drain(workers.out, 1)[0][1:3] == (0, 0)
        assert sender.send(worker_ids=[0], timeout=30) == 1
        held_back = scheme.create_receiver(1)
        held_back.register_model(make_model())
        assert held_back.newest_committed() == 0  # worker 1 was not named
        assert held_back.apply_version(0) == 0
        with pytest.raises(ws.WeightSyncError, match="worker 1: version 5 is not in any slot"):
            held_back.apply_version(5)
        assert held_back.version == 0
        held_back.close()


@pytest.mark.parametrize("change", ["assign", "submodule"])
def test_receiver_follows_a_model_changed_after_register(directory, change):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=10)
    source = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(source)
        sender.update_weights()
        local = make_model()
        receiver = scheme.create_receiver(0)
        receiver.register_model(local)
        assert receiver.connect(timeout=5) == 0
        if change == "assign":
            local.load_state_dict({k: torch.zeros_like(v) for k, v in local.state_dict().items()},
                                  assign=True)
        else:
            local[0] = torch.nn.Linear(8, 16)
        with torch.no_grad():
            for t in source.state_dict().values():
                t.fill_(7)
        assert sender.update_weights() == 1
        assert receiver.poll() == 1
        for name, tensor in local.state_dict().items():  # the tensors the model uses now
            assert bool((tensor == 7).all()), name
        receiver.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_weights_use_slots_registered_with_cuda(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=30, dtype=torch.bfloat16)
    source = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(16, device="cuda")}
    local = {k: torch.zeros_like(v) for k, v in source.items()}
    sender = scheme.create_sender()
    sender.register_model(source)
    sender.update_weights()
    writer_slots = list(sender.writer._slots.values())
    assert writer_slots and all(s.cuda_registered for s in writer_slots)  # pinned D2H copies
    receiver = scheme.create_receiver(0)
    receiver.register_model(local)
    assert receiver.connect(timeout=30) == 0
    reader_slots = list(receiver.reader._slots.values())
    assert reader_slots and all(s.cuda_registered for s in reader_slots)  # pinned H2D copies
    for name, tensor in source.items():
        assert torch.equal(local[name], tensor.bfloat16().float()), name
    receiver.close()
    sender.close()
    assert not any(s.cuda_registered for s in writer_slots + reader_slots)  # unregistered
