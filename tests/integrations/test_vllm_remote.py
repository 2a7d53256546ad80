"""The server host's receiver of the network path, without vLLM: it fetches versions from a
real trainer listener over loopback TCP and stages them in a real host-local directory,
where a worker reads them with the directory path's own code; the staging of a killed
receiver is swept at the next start, and nothing else is."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pidns import Namespaces, pid_namespaces_usable

from weightsync.core.errors import SchemaMismatchError, UnsafeDirectoryError
from weightsync.schemes.double_buffer import VLLMDoubleBufferSyncScheme
from weightsync.serving.host_receiver import HostReceiver, request_key
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import pack
from weightsync.transports.net.publisher import VersionPublisher

pytest.importorskip("zstandard")

CRED = host_credential("token", "host-b")

TIMEOUT = 10.0


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}


def _read(directory: Path, local: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a worker that attaches now loads of staged version ``local``."""
    model = {"w": torch.zeros(64, 32, dtype=dtype), "b": torch.zeros(32, dtype=dtype)}
    receiver = VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=TIMEOUT) \
        .create_receiver(0)
    receiver.register_model(model)
    receiver.connect(timeout=TIMEOUT)
    try:
        receiver.apply_version(local, timeout=TIMEOUT)
    finally:
        receiver.close()
    return model


def _session(dtype: torch.dtype | None, weights: dict[str, torch.Tensor]) -> VersionPublisher:
    publisher = VersionPublisher("127.0.0.1:0", "token", timeout=TIMEOUT, delta=False)
    publisher.publish(pack(weights, 0, dtype))
    return publisher


def test_a_new_trainer_session_with_another_dtype_is_staged_at_its_init(tmp_path: Path):
    """A server keeps running while its trainer restarts with another wire dtype (fp32, then
    bf16): the new session's init starts the host's staging over instead of refusing the
    layout; within one session a version of another layout is still refused."""
    host = HostReceiver(tmp_path / "staged", 1, "host-b", TIMEOUT)
    first = _session(None, _weights(0))
    try:
        local = host.stage(first.address, CRED, None, request_key("t1", "init/a"), TIMEOUT,
                           new_session=True)
        assert torch.equal(_read(tmp_path / "staged", local, torch.float32)["w"], _weights(0)["w"])
    finally:
        first.close()
    second = _session(torch.bfloat16, _weights(1))
    try:
        local = host.stage(second.address, CRED, None, request_key("t2", "init/a"), TIMEOUT,
                           new_session=True)
        got = _read(tmp_path / "staged", local, torch.bfloat16)
        assert torch.equal(got["w"], _weights(1)["w"].to(torch.bfloat16))
        second.publish(pack(_weights(2), 1, torch.float32))  # another layout mid-session
        with pytest.raises(SchemaMismatchError):
            host.stage(second.address, CRED, 1, request_key("t2", "version/1"), TIMEOUT)
    finally:
        second.close()
        host.close()
    assert not (tmp_path / "staged").exists()


def _staging(tmp_path: Path, name: str) -> Path:
    """A staging path as :func:`staging_directory` names it, under ``tmp_path``."""
    return tmp_path / f"weightsync-vllm-{os.getuid()}-{name}"


def _receiver(out: Any, directory: str, address: str | None) -> None:
    """A host's receiver process: stages the trainer's version (if ``address``), reports,
    then waits to be killed."""
    host = HostReceiver(Path(directory), 1, "host-a", TIMEOUT)
    if address is not None:
        host.stage(address, host_credential("token", "host-b"), None, request_key("t", "init/a"), TIMEOUT)
    out.put(("staged", os.getpid(), sorted(p.name for p in Path(directory).iterdir())))
    time.sleep(60)


def _get(out: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while out.empty():
        assert time.monotonic() < end, f"no message within {timeout} s"
        time.sleep(0.01)
    return out.get()


def test_a_sigkilled_receivers_staging_is_swept_at_the_next_start(tmp_path: Path):
    """vLLM kills its workers at exit: the staging a killed receiver leaves (twice the
    model's size in RAM) is removed when the next receiver on the host starts. A live
    receiver's staging, and a directory of that name without a receiver's owner record, are
    kept."""
    ctx = mp.get_context("fork")
    publisher = _session(None, _weights(0))
    procs = []
    try:
        for name, address in (("dead", publisher.address), ("live", None)):
            out = ctx.SimpleQueue()
            proc = ctx.Process(target=_receiver, args=(out, str(_staging(tmp_path, name)), address),
                               daemon=True)
            proc.start()
            procs.append(proc)
            assert _get(out, 20)[0] == "staged"
        assert any(p.name.startswith("slot-") for p in _staging(tmp_path, "dead").iterdir())
        procs[0].kill()
        procs[0].join(10)
        unowned = _staging(tmp_path, "unowned")
        unowned.mkdir(mode=0o700)
        (unowned / "data").write_text("not weightsync's")
        host = HostReceiver(_staging(tmp_path, "next"), 1, "host-b", TIMEOUT)
        assert not _staging(tmp_path, "dead").exists()
        assert _staging(tmp_path, "live").is_dir()
        assert (unowned / "data").exists()
        host.close()
    finally:
        publisher.close()
        for proc in procs:
            proc.kill()
            proc.join(10)


@pytest.mark.parametrize("target", ["directory", "missing"])
def test_a_symlink_planted_at_the_staging_path_is_refused_and_never_followed(tmp_path: Path,
                                                                            target: str):
    """Another process of the host planted a symlink where the receiver stages: a named
    error, and neither the link nor what it points to is touched."""
    pointed = tmp_path / "pointed"
    if target == "directory":
        pointed.mkdir(mode=0o700)
        (pointed / "data").write_text("keep")
    staging = _staging(tmp_path, "planted")
    staging.symlink_to(pointed)
    with pytest.raises(UnsafeDirectoryError, match=f"{staging} is a symbolic link"):
        HostReceiver(staging, 1, "host-a", TIMEOUT)
    assert staging.is_symlink() and os.readlink(staging) == str(pointed)
    if target == "directory":
        assert sorted(p.name for p in pointed.iterdir()) == ["data"]
    else:
        assert not pointed.exists()


@pytest.mark.skipif(not pid_namespaces_usable(), reason="needs root on Linux (pid namespaces)")
def test_staging_of_a_receiver_in_another_pid_namespace_is_never_swept(tmp_path: Path):
    """A receiver that runs as pid 1 of its own pid namespace, /dev/shm shared: its pid
    means another process here, so its staging is kept while it runs, and after it is
    killed (only a receiver of its namespace can tell)."""
    pool = Namespaces()
    try:
        out, init = pool.start(1, _receiver, str(_staging(tmp_path, "other")), None)
        assert out.get(timeout=20)[:2] == ("staged", 1)
        HostReceiver(_staging(tmp_path, "here"), 1, "host-b", TIMEOUT).close()
        assert _staging(tmp_path, "other").is_dir()
        os.kill(init, signal.SIGKILL)
        pool.close()
        HostReceiver(_staging(tmp_path, "here"), 1, "host-b", TIMEOUT).close()
        assert _staging(tmp_path, "other").is_dir()
    finally:
        pool.close()
