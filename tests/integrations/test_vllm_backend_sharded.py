"""The vLLM trainer engine with ``trainer_ranks=2`` on the network path, without a server:
rank 0 here (its client a host receiver in this process), rank 1 a spawned process; each
rank's source is its ``ws.LocalShard`` rows (a mapping: nothing is gathered). Every version
staged on the host equals the whole model in bf16. A rank key that is missing or short is
refused before anything listens."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import rank_harness as net_ranks
import torch
from rank_harness import RankGroup
from vllm_engine import vllm_or_skip

from weightsync.schemes.double_buffer import VLLMDoubleBufferSyncScheme

TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def _vllm() -> None:
    vllm_or_skip()
    pytest.importorskip("zstandard")


def _staged(directory: Path, local: int) -> dict[str, torch.Tensor]:
    model = {"bias": torch.zeros(5, dtype=torch.bfloat16),
             "matrix": torch.zeros(net_ranks.NET_ROWS, net_ranks.NET_COLS, dtype=torch.bfloat16)}
    receiver = VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=10).create_receiver(0)
    receiver.register_model(model)
    receiver.connect(timeout=10)
    try:
        receiver.apply_version(local, timeout=10)
    finally:
        receiver.close()
    return model


def test_two_engine_ranks_send_versions_without_a_gather(tmp_path: Path):
    from weightsync.integrations.vllm.backend import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo

    key, versions = secrets.token_hex(32), 3
    group = RankGroup()
    group.start(net_ranks.engine_rank, 1, 2, key, versions, TIMEOUT)
    client = net_ranks.StagingClient(tmp_path / "staged", TIMEOUT)
    source = net_ranks.rank_flat(0, 0)
    try:
        engine = WeightSyncTrainerEngine.trainer_init(
            WeightSyncTrainerInitInfo(rank=0, trainer_ranks=2, rank_key=key,
                                      address="127.0.0.1:0", dtype="bfloat16", delta=True,
                                      timeout=TIMEOUT),
            client=client, source=source)  # type: ignore[arg-type]
        try:
            assert len(set(client.info["addresses"])) == 2 and "rank_key" not in client.info
            assert key not in str(client.info)  # the servers never see the ranks' secret
            for version in range(versions):
                if version:
                    source.update(net_ranks.rank_flat(0, version))
                    engine.send_weights()
                assert engine.version == version
                assert engine.stats()["last"]["version"] == version
                got = _staged(tmp_path / "staged", client.staged[version])
                for name, want in net_ranks.full_weights(version).items():
                    assert torch.equal(got[name], want.to(torch.bfloat16)), (version, name)
        finally:
            engine.shutdown()
        outcome = group.collect(TIMEOUT)[0]
        assert outcome.ok, (outcome.error_type, outcome.error, outcome.traceback)
        assert outcome.value == list(range(versions))
    finally:
        group.kill_all()
        client.host.close()


@pytest.mark.parametrize("rank_key", ["", "short"])
def test_a_missing_or_short_rank_key_is_refused(rank_key: str, monkeypatch: pytest.MonkeyPatch):
    from weightsync.integrations.vllm.backend import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo

    monkeypatch.delenv("WEIGHTSYNC_RANK_KEY", raising=False)
    with pytest.raises(ValueError, match="rank key"):
        WeightSyncTrainerEngine.trainer_init(
            WeightSyncTrainerInitInfo(rank=0, trainer_ranks=2, rank_key=rank_key,
                                      address="127.0.0.1:0"),
            client=None, source={"w": torch.zeros(2)})  # type: ignore[arg-type]
