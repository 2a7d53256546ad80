"""A trainer rank killed or stopped between writing its shards and its record: the version
is never committed, the reader keeps the last whole one, every rank's send raises
TrainerRankLostError naming the rank within its deadline; a restarted (or resumed) rank
joins the next attempt and the version commits whole."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from rank_harness import RankGroup, local_shard_rank, sharded_scheme

from weightsync.transports.directory.files import read_json_object
from weightsync.transports.directory.ranks import PENDING, Pending
from weightsync.transports.ranks.seal import RecordSeal


@pytest.fixture
def directory():
    path = Path(tempfile.mkdtemp(prefix="ws-sharded-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _wait(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _failed(scheme):
    """Rank 0 gave up on an attempt: ``pending.json`` keeps the failed outcome (also once
    rank 0 retried)."""
    path, seal = scheme.directory / PENDING, RecordSeal(scheme.config.rank_key)
    obj = read_json_object(path)
    return obj is not None and any(not o.committed for o in
                                   Pending.from_json(obj, str(path), seal).outcomes)


def test_killed_rank_fails_the_version_and_a_restarted_rank_joins(directory):
    fault = {"rank": 2, "version": 1, "how": "kill", "send_timeout": 30}
    group = RankGroup()
    scheme = sharded_scheme(directory, 3)
    try:
        for rank in range(3):
            group.start(local_shard_rank, rank, 3, scheme, 3, fault)
        _wait(lambda: not group.processes[2].is_alive(), 60, "rank 2 to kill itself")
        assert group.processes[2].exitcode == -signal.SIGKILL
        # restarted only once rank 0 gave up on version 1: a restart that comes back first
        # (a loaded machine) lets that attempt commit, and no send fails at all
        _wait(lambda: _failed(scheme), 30, "rank 0 to give up on version 1")
        group.start(local_shard_rank, 2, 3, scheme, 3)  # restarted, no fault this time
        outcomes = group.collect(90)
    finally:
        group.kill_all()
    assert all(o.ok for o in outcomes), [(o.rank, o.error, o.traceback[-1500:]) for o in outcomes]
    lead, other, restarted = (o.value for o in outcomes)
    # rank 1 reaches version 1 only after rank 0 gave up on it when its start is slow (a
    # loaded machine): it then joins rank 0's retry, and none of its sends fails
    assert lead["errors"] and other["versions"] == [0, 1, 2], (lead, other)
    for report in (lead, other) if other["errors"] else (lead,):
        # one failed send each, naming rank 2, well within 30 s
        (kind, rank, message, seconds, step), = report["errors"]
        assert (kind, rank, step) == ("TrainerRankLostError", 2, 1), message
        assert "trainer rank 2" in message and seconds < 10, (message, seconds)
        assert report["versions"] == [0, 1, 2]
    assert restarted["first"] == 1 and restarted["versions"] == [1, 2]


def test_stopped_rank_fails_the_version_within_the_deadline(directory):
    fault = {"rank": 1, "version": 1, "how": "stop", "send_timeout": 3}
    group = RankGroup()
    scheme = sharded_scheme(directory, 2)
    try:
        for rank in range(2):
            group.start(local_shard_rank, rank, 2, scheme, 3, fault)
        _wait(lambda: _failed(scheme), 60, "rank 0 to give up on the stopped rank")
        os.kill(group.processes[1].pid, signal.SIGCONT)
        outcomes = group.collect(90)
    finally:
        group.kill_all()
    assert all(o.ok for o in outcomes), [(o.rank, o.error, o.traceback[-1500:]) for o in outcomes]
    lead, stopped = (o.value for o in outcomes)
    (kind, rank, message, seconds, step), = lead["errors"]
    assert (kind, rank, step) == ("TrainerRankLostError", 1, 1), message
    assert 2.5 < seconds < 6, seconds  # its deadline (3 s), not a hang
    assert "did not write its part" in message
    # the stopped rank, resumed, learns that its version failed, then retries with rank 0
    assert [e[:2] for e in stopped["errors"]] == [("TrainerRankLostError", 1)]
    assert lead["versions"] == stopped["versions"] == [0, 1, 2]
