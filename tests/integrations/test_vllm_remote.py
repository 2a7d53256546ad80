"""The server host's receiver of the network path, without vLLM: it fetches versions from a
real trainer listener over loopback TCP and stages them in a real host-local directory,
where a worker reads them with the directory path's own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weightsync.core.errors import SchemaMismatchError
from weightsync.integrations.vllm.remote import HostReceiver, request_key
from weightsync.schemes.double_buffer import VLLMDoubleBufferSyncScheme
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
