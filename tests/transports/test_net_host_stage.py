"""One fetch per host (``transports/net/host_stage.py``): real files in /dev/shm, real
``flock``s, a real process killed while it holds the host's lock."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
from pathlib import Path

import pytest
import torch
from stopped import stop_process

from weightsync.core.deadline import Deadline
from weightsync.core.errors import UnsafeDirectoryError, WeightSyncTimeoutError
from weightsync.transports.net.host_stage import HostStage, sweep
from weightsync.transports.net.packed import pack


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((1000,), value), "b": torch.full((7, 3), value)}


def _fetch_of(value: float, version: int, calls: list[int]):
    def fetch(base, allocate):
        calls.append(version)
        packed = pack(_weights(value), version)
        buffer = allocate(packed.nbytes)
        buffer.copy_(packed.buffer)
        packed.buffer = buffer
        return packed, "session-1"
    return fetch


def test_workers_of_one_host_share_one_fetch_and_the_last_removes_it():
    key = secrets.token_hex(8)
    first, second = HostStage(key, "worker 0"), HostStage(key, "worker 1")
    assert first.directory == second.directory
    calls: list[int] = []
    assert first.stage(0, _fetch_of(1.0, 0, calls), Deadline(5)) == 0
    assert second.stage(0, _fetch_of(9.0, 0, calls), Deadline(5)) == 0  # found staged
    assert calls == [0]
    dest = {"a": torch.zeros(1000, dtype=torch.float64), "b": torch.zeros(7, 3)}
    assert second.apply(dest, -1) == 0
    assert dest["a"].eq(1.0).all() and dest["b"].eq(1.0).all()  # cast into the model's dtype
    assert second.apply(dest, 0) is None  # nothing newer
    for version in (1, 2, 3):
        first.stage(version, _fetch_of(float(version), version, calls), Deadline(5))
    assert sorted(p.name for p in first.directory.glob("v*.json")) == ["v2.json", "v3.json"]
    first.close()
    assert first.directory.exists()  # worker 1 still holds it
    second.close()
    assert not first.directory.exists()


def _hold_lock_and_die(key: str) -> None:
    stage = HostStage(key, "doomed worker")

    def fetch(base, allocate):
        allocate(4096)
        time.sleep(300)  # killed here, holding the host's lock mid-fetch

    stage.stage(0, fetch, Deadline(None))


def test_a_worker_killed_mid_fetch_lets_the_next_one_fetch():
    key = secrets.token_hex(8)
    stage = HostStage(key, "worker 0")
    doomed = mp.get_context("fork").Process(target=_hold_lock_and_die, args=(key,), daemon=True)
    doomed.start()
    try:
        deadline = time.monotonic() + 10
        while not (stage.directory / "incoming.bin").exists():
            assert time.monotonic() < deadline, "the doomed worker never started its fetch"
            time.sleep(0.01)
        with pytest.raises(WeightSyncTimeoutError, match="staging lock") as busy:
            stage.stage(0, _fetch_of(1.0, 0, []), Deadline(0.3))  # it holds the lock
        assert f"doomed worker (pid {doomed.pid})" in str(busy.value)  # asleep: no state
        stop_process(doomed.pid)  # a frozen holder holds up its host: the error says so
        with pytest.raises(WeightSyncTimeoutError, match="staging lock") as stuck:
            stage.stage(0, _fetch_of(1.0, 0, []), Deadline(0.3))
        assert f"doomed worker (pid {doomed.pid}, stopped) held this host's" in str(stuck.value)
        doomed.kill()
        doomed.join(10)
        calls: list[int] = []
        assert stage.stage(0, _fetch_of(2.0, 0, calls), Deadline(5)) == 0
        assert calls == [0]
        dest = _weights(0.0)
        assert stage.apply(dest, -1) == 0 and dest["a"].eq(2.0).all()
    finally:
        doomed.kill()
        stage.close()


def test_a_symlink_or_an_open_directory_is_refused(tmp_path: Path):
    key = secrets.token_hex(8)
    probe = HostStage(key, "probe")
    path = probe.directory
    probe.close()
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, path)
    try:
        with pytest.raises(UnsafeDirectoryError, match="symlink"):
            HostStage(key, "worker 0")
    finally:
        os.unlink(path)
    os.mkdir(path, 0o700)
    os.chmod(path, 0o777)
    try:
        with pytest.raises(UnsafeDirectoryError, match="open to others"):
            HostStage(key, "worker 0")
    finally:
        os.rmdir(path)
    assert list(target.iterdir()) == []  # nothing written through the link


def test_a_start_sweeps_only_sessions_no_live_worker_holds():
    held, orphan = HostStage(secrets.token_hex(8), "live"), HostStage(secrets.token_hex(8), "gone")
    orphan_dir = orphan.directory
    os.close(orphan._members)  # as if its last worker had been killed: no lock left
    orphan._members = -1
    old = time.time() - 3600
    for path in (held.directory, orphan_dir):
        os.utime(path, (old, old))
    assert sweep(orphan_dir.parent) >= 1
    assert not orphan_dir.exists() and held.directory.exists()
    held.close()
