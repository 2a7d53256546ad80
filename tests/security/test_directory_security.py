"""The directory transport against a hostile directory: symlinks, FIFOs, foreign owners,
loose permissions. Real files; the attacks by another user run as ``nobody`` (needs root)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from other_user import needs_root, run_as_user, run_in_child

import weightsync as ws
from weightsync.transports.directory.files import UnsafeDirectoryError, UnsafeFileError
from weightsync.transports.directory.manifest import MANIFEST, SENDER_LOCK, ack_path, slot_path

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
PRECIOUS = b"precious: must never be overwritten\n"


@pytest.fixture
def base():
    """A private (0700) folder in /dev/shm, removed with all it holds."""
    path = Path(tempfile.mkdtemp(prefix="ws-sec-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(tmp_path):
    """A file the trainer (but nobody else) can write: what an attacker wants overwritten."""
    path = tmp_path / "victim.txt"
    path.write_bytes(PRECIOUS)
    return path


def weights(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), value), "b": torch.full((4,), value)}


def committed_directory(path: Path) -> ws.VLLMDoubleBufferSyncScheme:
    """A directory with version 0 committed by a sender that has since closed."""
    scheme = ws.VLLMDoubleBufferSyncScheme(path, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        sender.update_weights()
    return scheme


# ---------------------------------------------------------------- another user's directory
def _prepare_trap(directory: str, victim: str) -> None:
    os.mkdir(directory, 0o777)
    os.chmod(directory, 0o777)
    os.symlink(victim, os.path.join(directory, SENDER_LOCK))
    os.symlink(victim, os.path.join(directory, MANIFEST))


@pytest.mark.multiuser
@needs_root
def test_directory_prepared_by_another_user_is_refused(victim):
    public = Path(tempfile.mkdtemp(prefix="ws-sec-public-", dir=SHM))
    os.chmod(public, 0o1777)  # like /tmp or /dev/shm: anyone may create an entry
    try:
        trap = public / "policy"
        run_as_user(_prepare_trap, str(trap), str(victim), timeout=10)
        assert trap.stat().st_uid == 65534
        scheme = ws.VLLMDoubleBufferSyncScheme(trap, timeout=2)
        with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
            scheme.create_sender()
        receiver = scheme.create_receiver(0)
        receiver.register_model(weights())
        with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
            receiver.connect(timeout=2)
        assert victim.read_bytes() == PRECIOUS
        assert sorted(p.name for p in trap.iterdir()) == [MANIFEST, SENDER_LOCK]
    finally:
        shutil.rmtree(public)


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@pytest.mark.multiuser
@needs_root
def test_another_user_cannot_read_the_weights(base):
    os.chmod(base, 0o755)  # the parent is open, as /dev/shm is: the modes must protect
    scheme = committed_directory(base / "policy")
    assert stat.S_IMODE((base / "policy").stat().st_mode) == 0o700
    for name in ("slot-0.safetensors", MANIFEST):
        with pytest.raises(PermissionError):
            run_as_user(_read, str(base / "policy" / name), timeout=10)
    with pytest.raises(PermissionError):
        run_as_user(os.listdir, str(base / "policy"), timeout=10)
    del scheme


# ---------------------------------------------------------------- modes
def test_files_are_private_by_default(base):
    directory = base / "new"
    scheme = committed_directory(directory)
    receiver = scheme.create_receiver(0)
    receiver.register_model(weights(1.0))
    assert receiver.connect(timeout=5) == 0
    receiver.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["ack-0.json", MANIFEST, "sender.lock", "slot-0.safetensors",
                     "slot-1.safetensors"]
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name


def test_mode_option_shares_with_the_group(base):
    old_umask = os.umask(0o077)  # the asked-for mode wins over a strict umask
    try:
        directory = base / "shared"
        scheme = ws.VLLMDoubleBufferSyncScheme(directory, mode=0o640)
        with scheme.create_sender() as sender:
            sender.register_model(weights())
            sender.update_weights()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path.name
    with pytest.raises(ValueError, match="mode"):
        ws.VLLMDoubleBufferSyncScheme(directory, mode=0o777)


@pytest.mark.parametrize("loose", [0o777, 0o1777, 0o775])
def test_directory_writable_by_others_is_refused(base, loose):
    directory = base / "loose"
    directory.mkdir()
    os.chmod(directory, loose)
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=2)
    with pytest.raises(UnsafeDirectoryError, match="writable by"):
        scheme.create_sender()
    receiver = scheme.create_receiver(0)
    receiver.register_model(weights())
    with pytest.raises(UnsafeDirectoryError, match="writable by"):
        receiver.connect(timeout=2)
    assert list(directory.iterdir()) == []
    # a group the user chose to share with may write, if the mode says so
    os.chmod(directory, 0o770)
    with ws.VLLMDoubleBufferSyncScheme(directory, mode=0o660).create_sender() as sender:
        sender.register_model(weights())
        sender.update_weights()


# ---------------------------------------------------------------- symlinks
def test_symlinked_lock_is_refused_and_not_followed(base, victim):
    directory = base / "policy"
    directory.mkdir(mode=0o700)
    os.symlink(victim, directory / SENDER_LOCK)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        ws.VLLMDoubleBufferSyncScheme(directory).create_sender()
    assert victim.read_bytes() == PRECIOUS


def test_symlinked_manifest_and_ack_are_refused(base, victim):
    directory = base / "policy"
    scheme = committed_directory(directory)
    os.replace(directory / MANIFEST, base / "real-manifest.json")
    os.symlink(base / "real-manifest.json", directory / MANIFEST)
    receiver = scheme.create_receiver(0)
    receiver.register_model(weights())
    with pytest.raises(ws.IntegrityError, match="manifest.json is a symbolic link"):
        receiver.connect(timeout=2)
    receiver.close()
    os.replace(base / "real-manifest.json", directory / MANIFEST)
    os.symlink(victim, ack_path(directory, 0))
    with scheme.create_sender() as sender:
        sender.register_model(weights())
        with pytest.raises(ws.IntegrityError, match="ack-0.json is a symbolic link"):
            sender.connect(timeout=2)
        # the receiver replaces the link with its own file and never writes through it
        receiver = scheme.create_receiver(0)
        receiver.register_model(weights())
        assert receiver.connect(timeout=5) == 1
        assert not ack_path(directory, 0).is_symlink()
        assert sender.connect(timeout=5) == 1
        receiver.close()
    assert victim.read_bytes() == PRECIOUS


def test_symlinked_slot_is_replaced_never_written_through(base, victim):
    directory = base / "policy"
    directory.mkdir(mode=0o700)
    os.symlink(victim, slot_path(directory, 0))
    scheme = ws.VLLMDoubleBufferSyncScheme(directory)
    with scheme.create_sender() as sender:
        sender.register_model(weights(3.0))
        sender.update_weights()
        assert not slot_path(directory, 0).is_symlink()
    assert victim.read_bytes() == PRECIOUS
    committed = committed_directory(directory)
    latest = slot_path(directory, json.loads((directory / MANIFEST).read_text())["latest"]["slot"])
    os.replace(latest, base / "slot-copy")
    os.symlink(base / "slot-copy", latest)
    receiver = committed.create_receiver(0)
    receiver.register_model(weights())
    with pytest.raises(ws.IntegrityError, match="symbolic link"):
        receiver.connect(timeout=2)


# ---------------------------------------------------------------- FIFOs never hang a call
def _connect_receiver(directory: str) -> str:
    receiver = ws.VLLMDoubleBufferSyncScheme(directory, timeout=2).create_receiver(0)
    receiver.register_model(weights())
    try:
        receiver.connect(timeout=2)
    except ws.WeightSyncError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "connected"


def _poll_receiver(directory: str, fifo: str) -> str:
    receiver = ws.VLLMDoubleBufferSyncScheme(directory, timeout=2).create_receiver(0)
    receiver.register_model(weights())
    receiver.connect(timeout=2)
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    try:
        receiver.poll()
    except ws.WeightSyncError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "polled"


def _sender_call(directory: str, call: str) -> str:
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, timeout=2)
    try:
        with scheme.create_sender() as sender:
            sender.register_model(weights())
            getattr(sender, call)(timeout=2)
    except (ws.WeightSyncError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "sent"


@pytest.mark.parametrize("name", [MANIFEST, "slot-0.safetensors"])
def test_fifo_in_place_of_a_file_fails_connect_and_poll_in_time(base, name):
    directory = base / "policy"
    committed_directory(directory)
    fifo = directory / name
    with_fifo = base / "fifo-copy"
    shutil.copytree(directory, with_fifo)
    (with_fifo / name).unlink()
    os.mkfifo(with_fifo / name, 0o600)
    outcome = run_in_child(_connect_receiver, str(with_fifo), timeout=20)
    assert outcome.startswith(("IntegrityError", "UnsafeFileError")) and name in outcome
    if name != MANIFEST:
        return  # a poll with nothing newer reads no slot
    sender = ws.VLLMDoubleBufferSyncScheme(directory).create_sender()  # keeps a live sender
    try:
        outcome = run_in_child(_poll_receiver, str(directory), str(fifo), timeout=20)
        assert outcome.startswith(("IntegrityError", "UnsafeFileError")) and name in outcome
    finally:
        sender.close()


def test_fifo_lock_fails_poll_in_time(base):
    directory = base / "policy"
    committed_directory(directory)
    sender = ws.VLLMDoubleBufferSyncScheme(directory).create_sender()
    try:  # the live sender keeps its lock on the unlinked file; a FIFO takes the name
        outcome = run_in_child(_poll_receiver, str(directory), str(directory / SENDER_LOCK),
                               timeout=20)
        assert outcome.startswith("UnsafeFileError") and SENDER_LOCK in outcome
    finally:
        sender.close()


def test_fifo_lock_or_ack_fails_the_sender_in_time(base):
    directory = base / "policy"
    committed_directory(directory)
    os.mkfifo(ack_path(directory, 0), 0o600)
    outcome = run_in_child(_sender_call, str(directory), "connect", timeout=20)
    assert outcome.startswith(("IntegrityError", "UnsafeFileError")) and "ack-0.json" in outcome
    outcome = run_in_child(_sender_call, str(directory), "send", timeout=20)
    assert "ack-0.json" in outcome
    (directory / SENDER_LOCK).unlink()
    os.mkfifo(directory / SENDER_LOCK, 0o600)
    outcome = run_in_child(_sender_call, str(directory), "connect", timeout=20)
    assert outcome.startswith("UnsafeFileError") and SENDER_LOCK in outcome
