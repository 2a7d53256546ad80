"""The directory transport under faults: malformed control files, restarts, stray slots,
deadlines, locks held by stuck processes. Real processes and real files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import pytest
import torch
from dbuf_workers import hold_slot_locks, late_echo_worker
from other_user import run_in_child
from workers import drain, echo_worker, make_model

import weightsync as ws
from weightsync.transports.directory.manifest import MANIFEST, ack_path, slot_path

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


@pytest.fixture
def directory():
    path = Path(tempfile.mkdtemp(prefix="ws-faults-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def weights(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), value), "b": torch.full((4,), value)}


def replace_file(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` the way a writer would: a new file renamed into place."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def latest_slot(directory: Path) -> Path:
    return slot_path(directory, json.loads((directory / MANIFEST).read_text())["latest"]["slot"])


# ---------------------------------------------------------------- malformed control files
BAD_MANIFESTS = {
    "nested": b"[" * 200_000 + b"]" * 200_000,
    "nested-object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "array": b"[]",
    "truncated": b'{"format":"weightsync-double-buffer/1","latest":{"vers',
    "missing-fields": b'{"format":"weightsync-double-buffer/1"}',
    "wrong-types": b'{"format":"weightsync-double-buffer/1","fingerprint":"x",'
                   b'"latest":{"version":"0","slot":0},"workers":{},"slots":{}}',
    "bad-slot-key": b'{"format":"weightsync-double-buffer/1","fingerprint":"x",'
                    b'"latest":{"version":0,"slot":0},"workers":{},"slots":{"../x":{}}}',
    "not-utf8": b"\xff\xfe{}",
}


@pytest.mark.parametrize("kind", sorted(BAD_MANIFESTS))
def test_malformed_manifest_is_an_integrity_error_naming_it(directory, kind):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        sender.update_weights()
        connected = scheme.create_receiver(0)
        connected.register_model(weights(1.0))
        assert connected.connect(timeout=5) == 0
        replace_file(directory / MANIFEST, BAD_MANIFESTS[kind])
        fresh = scheme.create_receiver(1)
        fresh.register_model(weights(1.0))
        with pytest.raises(ws.IntegrityError, match="manifest.json"):
            fresh.connect(timeout=2)
        with pytest.raises(ws.IntegrityError, match="manifest.json"):
            connected.poll()
        assert connected.version == 0 and bool((connected.model["w"] == 0.0).all())
        connected.close()
        fresh.close()


@pytest.mark.parametrize("ack", [b"[" * 100_000, b"{}", b'{"version":"1","pid":1,"host":"h"}', b"7"])
def test_malformed_ack_is_an_integrity_error_naming_it(directory, ack):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=5)
    replace_file(ack_path(directory, 0), ack)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        start = time.monotonic()
        with pytest.raises(ws.IntegrityError, match="ack-0.json"):
            sender.send(timeout=3)
        assert time.monotonic() - start < 3


def _header(obj: object) -> bytes:
    raw = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    return struct.pack("<Q", len(raw)) + raw


BAD_HEADERS = {
    "nested": _header(b"[" * 100_000 + b"]" * 100_000),
    "array": _header([]),
    "entry-not-object": _header({"w": 3}),
    "bad-offsets": _header({"w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", 16]}}),
    "negative-shape": _header({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}),
    "huge-length": struct.pack("<Q", 1 << 62) + b"{}",
    "short": b"\x01\x00",
}


@pytest.mark.parametrize("kind", sorted(BAD_HEADERS))
def test_bad_safetensors_header_is_an_integrity_error_naming_the_slot(directory, kind):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        sender.update_weights()
        slot = latest_slot(directory)
        replace_file(slot, BAD_HEADERS[kind] + b"\x00" * 2048)
        receiver = scheme.create_receiver(0)
        receiver.register_model(weights(1.0))
        with pytest.raises(ws.IntegrityError, match=slot.name):
            receiver.connect(timeout=2)
        assert receiver.version == -1
        receiver.close()


# ---------------------------------------------------------------- restarts
def test_restarted_trainer_waits_for_a_worker_whose_old_ack_names_a_dead_pid(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=30)
    model = make_model()
    with scheme.create_sender() as sender:  # the first run: a worker acks, then both die
        sender.register_model(model)
        workers.start(echo_worker, scheme, 0)
        assert sender.connect(timeout=60) == 0
        drain(workers.out, 1)
        workers.kill(0)
    assert json.loads(ack_path(directory, 0).read_text())["version"] == 0
    workers.start(late_echo_worker, scheme, 0, 1.5)  # restarts 1.5 s after the trainer
    with scheme.create_sender() as sender:
        sender.register_model(model)
        assert sender.connect(timeout=30) == 1  # not WorkerLostError at once
        assert drain(workers.out, 1)[0][1:3] == (0, 1)
        assert sender.send(timeout=30) == 2
    workers.kill(0)
    with scheme.create_sender() as sender:  # nobody restarts: a timeout that says why
        sender.register_model(model)
        with pytest.raises(ws.WeightSyncTimeoutError, match="is gone"):
            sender.connect(timeout=1)


def test_a_temp_file_of_another_pid_namespace_is_not_judged_by_its_pid(directory):
    """A sender starting up removes temp files of dead writers; one written in another pid
    namespace (its name's tag differs) is left alone while young: its pid means nothing here."""
    foreign = directory / ".ack-0.json.tmp-1.0badc0de-0123456789ab"  # pid 1 elsewhere
    old_foreign = directory / ".ack-1.json.tmp-1.0badc0de-ba9876543210"
    dead_here = directory / ".ack-2.json.tmp-999999999-0123456789ab"  # older name format
    for path in (foreign, old_foreign, dead_here):
        path.write_bytes(b"{}")
    os.utime(old_foreign, (time.time() - 3600, time.time() - 3600))
    with ws.VLLMDoubleBufferSyncScheme(directory, timeout=5).create_sender():
        assert foreign.exists()
        assert not old_foreign.exists() and not dead_here.exists()


def test_stray_slot_files_are_not_turned_into_slots(directory):
    for index in range(2, 42):
        slot_path(directory, index).touch(mode=0o600)
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=5)
    model = {"w": torch.zeros(1 << 18)}  # 1 MB
    with scheme.create_sender() as sender:
        sender.register_model(model)
        for _ in range(4):
            sender.update_weights()
        slots = sorted(p.name for p in directory.glob("slot-*"))
        assert slots == ["slot-0.safetensors", "slot-1.safetensors"]
        assert sum(p.stat().st_size for p in directory.glob("slot-*")) < 3 << 20


def test_slots_named_in_the_manifest_survive_a_restart(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2, timeout=30)
    model = make_model()
    workers.start(echo_worker, scheme, 0)
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()
        for _ in range(3):  # worker 1 stays on version 0 while worker 0 moves on
            with torch.no_grad():
                model[0].weight.add_(1.0)
            sender.send(worker_ids=[0], timeout=30)
    assert json.loads((directory / MANIFEST).read_text())["workers"]["1"]["version"] == 0
    with scheme.create_sender() as sender:
        sender.register_model(model)
        assert sender.send(worker_ids=[0], timeout=30) == 4
        receiver = scheme.create_receiver(1)
        receiver.register_model(make_model())
        assert receiver.connect(timeout=5) == 0  # its slot was kept, checksums intact
        receiver.close()


# ---------------------------------------------------------------- one deadline per call
def test_send_ends_within_its_timeout_when_every_slot_is_locked(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=20)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        sender.update_weights()
        paths = sorted(str(p) for p in directory.glob("slot-*"))
        out = workers.out.new()
        proc = workers.ctx.Process(target=hold_slot_locks, args=(paths, False, out, workers.stop),
                                   daemon=True)
        proc.start()
        workers.procs[0] = proc
        assert out.get(timeout=30) == ("locked", 2)  # a slow reader holds both slots
        sender.update_weights()  # goes to a third slot: the pool (num_workers + 2) is full
        assert len(list(directory.glob("slot-*"))) == 3
        for call in ("send", "send_async"):
            start = time.monotonic()
            with pytest.raises(ws.WeightSyncTimeoutError, match="still being read"):
                getattr(sender, call)(timeout=1.0)
            assert time.monotonic() - start < 8, call  # not the scheme's 20 s


def _poll_once(directory: str) -> object:
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=30)
    receiver = scheme.create_receiver(0)
    receiver.register_model(weights(-1.0))
    start = time.monotonic()
    result = receiver.poll()
    return result, time.monotonic() - start


def test_poll_never_blocks_on_a_slot_locked_by_a_stuck_process(directory, workers):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=30)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        sender.update_weights()
        out = workers.out.new()
        proc = workers.ctx.Process(
            target=hold_slot_locks, args=([str(latest_slot(directory))], True, out, workers.stop),
            daemon=True,
        )
        proc.start()
        workers.procs[0] = proc
        assert out.get(timeout=30) == ("locked", 1)
        result, took = run_in_child(_poll_once, str(directory), timeout=20)
        assert result is None and took < 5
        receiver = scheme.create_receiver(0)
        receiver.register_model(weights(-1.0))
        start = time.monotonic()
        with pytest.raises(ws.WeightSyncTimeoutError):
            receiver.connect(timeout=1.0)
        assert time.monotonic() - start < 8
        workers.stop.set()
        proc.join(10)
        assert receiver.connect(timeout=10) == 0  # the lock is gone: it reads
        receiver.close()


# ---------------------------------------------------------------- fork after create
def _child_uses_inherited_sender(sender: ws.VLLMDoubleBufferWeightSender) -> str:
    try:
        sender.update_weights()
    except RuntimeError as exc:
        outcome = str(exc)
    else:
        outcome = "the child committed a version"
    sender.close()  # closes the child's copies only
    return outcome


def _sender_alive(directory: str) -> bool:
    from weightsync.transports.directory.manifest import sender_alive

    return sender_alive(Path(directory))


def test_a_forked_child_cannot_send_or_release_the_parents_sender(directory):
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        assert sender.update_weights() == 0
        outcome = run_in_child(_child_uses_inherited_sender, sender, timeout=20)
        assert "belongs to process" in outcome
        assert json.loads((directory / MANIFEST).read_text())["latest"]["version"] == 0
        assert run_in_child(_sender_alive, str(directory), timeout=20)  # still locked
        assert sender.update_weights() == 1


def _trainer_on_a_small_file_system(directory: str, out) -> None:
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=5)
    with scheme.create_sender() as small:
        small.register_model({"w": torch.full((1000,), 7.0)})
        small.update_weights()
    big = scheme.create_sender()
    big.register_model({"w": torch.ones(1_000_000)})  # 4 MB: more than the file system holds
    try:
        big.update_weights()
        out.put(("sent", ""))
    except OSError as exc:
        out.put(("oserror", str(exc)))
    big.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_a_full_file_system_is_an_os_error_naming_the_directory_and_the_last_version_stays():
    """Slots are reserved before they are written through their mapping: on a full file
    system the trainer used to die of SIGBUS mid-write."""
    import multiprocessing as mp
    import subprocess

    mount = Path(tempfile.mkdtemp(prefix="ws-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
                   check=True, timeout=30)
    try:
        directory = mount / "weights"
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_trainer_on_a_small_file_system, args=(str(directory), out))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0, f"the trainer died (exit code {proc.exitcode})"
        kind, message = out.get(timeout=5)
        assert kind == "oserror" and str(directory) in message
        receiver = ws.VLLMDoubleBufferSyncScheme(directory, timeout=5).create_receiver(0)
        receiver.register_model(weights_of := {"w": torch.zeros(1000)})
        assert receiver.connect(timeout=5) == 0
        assert torch.equal(weights_of["w"], torch.full((1000,), 7.0))
        receiver.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)
        shutil.rmtree(mount, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_an_ack_the_full_file_system_refuses_is_retried_and_the_poll_still_applies():
    import subprocess

    mount = Path(tempfile.mkdtemp(prefix="ws-ackfull-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
                   check=True, timeout=30)
    try:
        scheme = ws.VLLMDoubleBufferSyncScheme(mount / "w", timeout=5)
        with scheme.create_sender() as sender:
            sender.register_model(weights(1.0))
            sender.update_weights()
            receiver = scheme.create_receiver(0)
            receiver.register_model(local := weights())
            receiver.connect(timeout=5)
            sender.update_weights(weights(2.0))
            filler = mount / "filler"
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            with contextlib.suppress(OSError):  # take every block left
                while True:
                    os.write(fd, b"\0" * 4096)
            os.close(fd)
            assert receiver.poll() == 1  # applied; the ack waits for space
            assert float(local["w"][0]) == 2.0
            filler.unlink()
            assert receiver.poll() is None  # nothing newer, and the ack goes out now
            assert json.loads(ack_path(mount / "w", 0).read_text())["version"] == 1
            receiver.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)
        shutil.rmtree(mount, ignore_errors=True)
