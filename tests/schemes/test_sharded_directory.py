"""VLLMDoubleBufferSyncScheme(trainer_ranks=N): every rank of a sharded trainer writes its
shards into the slot, rank 0 commits; a directory reader applies whole tensors equal to the
gathered model after each send. Real processes (spawned ranks, gloo for FSDP2 / DTensor)."""

from __future__ import annotations

import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from rank_harness import (
    RankGroup,
    free_port,
    fsdp_rank,
    hammering_reader,
    local_shard_rank,
    own_scheme_rank,
    racing_rank,
    run_ranks,
    sharded_scheme,
    tp_rank,
    wrong_layout_rank,
)

import weightsync as ws
from weightsync.transports.directory.manifest import MANIFEST


@pytest.fixture
def directory():
    path = Path(tempfile.mkdtemp(prefix="ws-sharded-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _all_ok(outcomes):
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error, o.traceback[-1500:],
                                         o.exitcode, o.timed_out) for o in outcomes]
    return [o.value for o in outcomes]


def test_create_sender_checks_the_rank(tmp_path):
    scheme = ws.VLLMDoubleBufferSyncScheme(tmp_path / "d", trainer_ranks=2)
    assert pickle.loads(pickle.dumps(scheme)).trainer_ranks == 2
    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match=r"rank must be an int in 0\.\.1"):
            scheme.create_sender(rank=bad)
    with pytest.raises(ValueError, match="trainer_ranks"):
        ws.VLLMDoubleBufferSyncScheme(tmp_path / "d", trainer_ranks=0)
    single = ws.VLLMDoubleBufferSyncScheme(tmp_path / "e")
    with pytest.raises(ValueError, match=r"0\.\.0"):
        single.create_sender(rank=1)
    single.create_sender().close()


@pytest.mark.parametrize("world", [2, 3])
def test_local_shards_uneven_rows_and_columns(directory, world):
    reports = _all_ok(run_ranks(local_shard_rank, world, 90,
                                       sharded_scheme(directory, world), 3))
    assert all(r["versions"] == [0, 1, 2] for r in reports)


def test_ranks_that_each_make_the_scheme_again_share_the_directory_key(directory):
    """torchrun-style: no scheme is handed over; every rank makes its own of the directory,
    reads the same rank key from it (the file is the scheme's mode: 0o600), and they commit
    together; the workers' copy still holds no key."""
    reports = _all_ok(run_ranks(own_scheme_rank, 2, 90, directory, 2))
    assert all(r["versions"] == [0, 1] for r in reports)
    key_file = directory / "rank-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    scheme = sharded_scheme(directory, 2)
    assert scheme.config.rank_key == key_file.read_text()
    assert pickle.loads(pickle.dumps(scheme.for_workers())).config.rank_key == ""


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_trainer_reader_equals_gathered_model(directory, world):
    reports = _all_ok(run_ranks(fsdp_rank, world, 150,
                                       sharded_scheme(directory, world, 60), free_port(), 3))
    assert all(r["versions"] == [0, 1, 2] for r in reports)
    assert reports[0]["diffs"] == [0.0, 0.0, 0.0]


def test_tensor_parallel_shard1_and_replicated_norm_cast_to_bf16(directory):
    reports = _all_ok(run_ranks(
        tp_rank, 2, 150, sharded_scheme(directory, 2, 60, dtype=torch.bfloat16), free_port(), 3))
    assert reports[0]["diffs"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("wrong", "match"), [
    ("shape", r"trainer rank 1 registered another model: key 'w'"),
    ("overlap", r"key 'w': trainer ranks 0 and 1 both write"),
])
def test_layout_disagreement_is_refused_before_any_byte(directory, wrong, match):
    outcomes = run_ranks(wrong_layout_rank, 2, 60, sharded_scheme(directory, 2, 20), wrong)
    assert [o.error_type for o in outcomes] == ["SchemaMismatchError"] * 2, outcomes
    import re
    assert all(re.search(match, o.error) for o in outcomes), [o.error for o in outcomes]
    assert not (directory / MANIFEST).exists()


def test_tear_free_while_ranks_send_as_fast_as_they_can(directory):
    """Ranks race through 30 versions without waiting for the reader; a reader in its own
    process applies what it can, and every version it holds is exactly that step's model."""
    steps, world = 30, 2
    group = RankGroup()
    scheme = sharded_scheme(directory, world, 60)
    try:
        for rank in range(world):
            group.start(racing_rank, rank, world, scheme, steps)
        reader = RankGroup()
        try:
            reader.start(hammering_reader, 0, 1, directory, steps - 1)
            seen = _all_ok(reader.collect(120))[0]
        finally:
            reader.kill_all()
        versions = _all_ok(group.collect(120))
    finally:
        group.kill_all()
    assert all(v == list(range(steps)) for v in versions), versions
    assert seen[-1] == steps - 1 and seen == sorted(set(seen)), seen
