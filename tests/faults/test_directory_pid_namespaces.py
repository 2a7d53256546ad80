"""The directory transport across pid namespaces (containers on one host): a trainer and its
workers see different pid numbers and different /proc trees, so a pid says nothing about a
process of another namespace. Real pid namespaces (root only), real processes."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pidns import Namespaces, pid_namespaces_usable

import weightsync as ws

pytestmark = pytest.mark.skipif(not pid_namespaces_usable(),
                                reason="needs root on Linux (pid and mount namespaces)")

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def weights(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), value), "b": torch.full((4,), value)}


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


# ---------------------------------------------------------------- process bodies
def _connected_trainer(out: Any, directory: str) -> None:
    """Publish version 0, wait for worker 0 to take it, then idle until killed."""
    sender = ws.VLLMDoubleBufferSyncScheme(directory, timeout=20).create_sender()
    sender.register_model(weights(0.0))
    version = sender.connect(timeout=20)
    out.put(("connected", version, os.getpid(), _pid_namespace()))
    time.sleep(30)


def _watching_reader(out: Any, directory: str) -> None:
    """Connect, then wait for versions until the sender is reported lost (or 15 s pass)."""
    receiver = ws.VLLMDoubleBufferSyncScheme(directory, timeout=20).create_receiver(0)
    receiver.register_model(weights(-1.0))
    version = receiver.connect(timeout=20)
    out.put(("connected", version, os.getpid(), _pid_namespace()))
    end = time.monotonic() + 15
    try:
        while time.monotonic() < end:
            receiver.receive(timeout=0.2)
    except ws.SenderLostError as exc:
        out.put(("sender-lost", time.monotonic(), str(exc)))
    else:
        out.put(("never-lost", receiver.version))
    finally:
        receiver.close()


def _sending_trainer(out: Any, directory: str, versions: int) -> None:
    """Send ``versions`` versions to worker 0, reporting each outcome."""
    sender = ws.VLLMDoubleBufferSyncScheme(directory, timeout=20).create_sender()
    sender.register_model(weights(0.0))
    out.put(("connected", sender.connect(timeout=20), os.getpid(), _pid_namespace()))
    for value in range(1, versions + 1):
        try:
            out.put(("sent", sender.send(weights(float(value)), timeout=10)))
        except ws.WeightSyncError as exc:
            out.put(("failed", value, type(exc).__name__, str(exc)))
    out.put(("done",))
    sender.close()


def _following_worker(out: Any, directory: str, versions: int) -> None:
    """Connect, then apply every version up to ``versions``."""
    model = weights(-1.0)
    receiver = ws.VLLMDoubleBufferSyncScheme(directory, timeout=20).create_receiver(0)
    receiver.register_model(model)
    out.put(("connected", receiver.connect(timeout=20), os.getpid(), _pid_namespace()))
    end = time.monotonic() + 20
    try:
        while receiver.version < versions and time.monotonic() < end:
            if receiver.receive(timeout=0.2) is not None:
                out.put(("version", receiver.version, float(model["w"][0])))
    finally:
        receiver.close()


# ---------------------------------------------------------------- harness
@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    pool = Namespaces()
    yield pool
    pool.close()


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ws-pidns-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _get(out: Any, timeout: float) -> Any:
    try:
        return out.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no message within {timeout} s")


# ---------------------------------------------------------------- tests
def test_a_reader_in_another_namespace_sees_the_trainers_death(directory, namespaces):
    """Trainer and reader are each pid 1 of their own namespace: the same pid, two processes.
    The reader must not take the trainer's lock for its own: SIGKILL the trainer and the
    reader's receive() raises SenderLostError within its deadline."""
    trainer, trainer_init = namespaces.start(1, _connected_trainer, str(directory))
    reader, _ = namespaces.start(1, _watching_reader, str(directory))
    connected = _get(reader, 20)
    assert connected[:3] == ("connected", 0, 1), connected
    trained = _get(trainer, 20)
    assert trained[:3] == ("connected", 0, 1), trained
    assert trained[3] != connected[3], "trainer and reader must be in different pid namespaces"

    killed_at = time.monotonic()
    os.kill(trainer_init, signal.SIGKILL)
    report = _get(reader, 10)
    assert report[0] == "sender-lost", report
    assert report[1] - killed_at < 3.0, f"the loss was seen {report[1] - killed_at:.1f} s late"
    assert "no live sender" in report[2]


def test_a_worker_in_another_namespace_is_never_reported_lost(directory, namespaces):
    """The worker runs as pid 64 of its own namespace (under a reaper, as under tini), with
    the trainer's hostname: pid 64 names no process of the trainer's namespace (the trainer
    is its pid 1, its threads the next few). It applies every version, and the trainer's
    sends never call it lost."""
    versions = 5
    trainer, _ = namespaces.start(1, _sending_trainer, str(directory), versions)
    worker, _ = namespaces.start(64, _following_worker, str(directory), versions)
    connected = _get(worker, 20)
    assert connected[0] == "connected" and connected[2] == 64, connected

    reports = [_get(trainer, 30)]
    while reports[-1] != ("done",):
        reports.append(_get(trainer, 30))
    failed = [r for r in reports if r[0] == "failed"]
    assert not failed, failed
    assert [r[1] for r in reports if r[0] == "sent"] == list(range(1, versions + 1))
    applied = []
    while len(applied) < versions:
        event, version, value = _get(worker, 10)
        assert event == "version" and value == float(version)
        applied.append(version)
    assert applied[-1] == versions
