"""``NetWeightSyncScheme(trainer_ranks=2)`` on loopback: two trainer rank processes, each
registering its own ``LocalShard`` rows (no rank gathers anything), and worker processes
handed ``scheme.for_workers()``; each worker's host fetches every rank's part and each
worker holds exactly the whole version it reports. Every wait has a timeout."""

from __future__ import annotations

from collections.abc import Iterator

import net_rank_ends as ends
import pytest
import torch
from rank_harness import RankProcesses

import weightsync as ws

TIMEOUT = 30.0
#: how long the test waits for a process's next word (spawning one on a loaded host is slow)
WORD_S = 90.0


@pytest.fixture
def procs() -> Iterator[RankProcesses]:
    made = RankProcesses()
    yield made
    made.close(polite=True)


def _scheme(num_workers: int, **options: object) -> ws.NetWeightSyncScheme:
    return ws.NetWeightSyncScheme(num_workers, "127.0.0.1:0", trainer_ranks=2, timeout=TIMEOUT,
                                  **options)  # type: ignore[arg-type]


def _start(procs: RankProcesses, scheme: ws.NetWeightSyncScheme, workers: list[int],
           kill_rank_1_at: int | None = None) -> None:
    """The two ranks, then the ``workers``; ``kill_rank_1_at``: their host's fetch of that
    version starts by killing rank 1."""
    for rank in range(2):
        procs.start(("rank", rank), ends.trainer_rank, scheme, rank, TIMEOUT, 0)
    kill = None if kill_rank_1_at is None else (procs.processes[("rank", 1)].pid, kill_rank_1_at)
    for idx in workers:
        procs.start(("worker", idx), ends.worker, scheme.for_workers(), idx, TIMEOUT, kill)


def _both(procs: RankProcesses, *command: object) -> list[tuple[object, ...]]:
    """Tell both ranks ``command``; what each answered, rank by rank."""
    for rank in range(2):
        procs.tell(("rank", rank), *command)
    return [procs.next(("rank", rank), WORD_S) for rank in range(2)]


def _applied(procs: RankProcesses, idx: int, until: int) -> list[int]:
    """The versions worker ``idx`` reports up to ``until``, each checked whole."""
    seen: list[int] = []
    while not seen or seen[-1] < until:
        word = procs.next(("worker", idx), WORD_S)
        assert word[0] == "version", word
        assert word[2], f"worker {idx} holds something else than version {word[1]}"
        seen.append(int(word[1]))  # type: ignore[call-overload]
    return seen


def test_two_ranks_serve_two_workers_whole_versions(procs: RankProcesses):
    """bfloat16 on the wire, deltas per rank part (plain float32: the last test)."""
    scheme = _scheme(2, dtype=torch.bfloat16, delta=True)
    _start(procs, scheme, [0, 1])
    assert _both(procs, "connect") == [("ok", 0), ("ok", 0)]
    for version in range(1, 4):
        assert _both(procs, "send", version) == [("ok", version), ("ok", version)]
    for idx in range(2):
        seen = _applied(procs, idx, 3)
        assert seen == sorted(set(seen)) and seen[0] == 0, seen
    for rank, (word, last) in enumerate(_both(procs, "stats")):  # each rank's own link
        assert word == "stats" and last["version"] == 3 and last["hosts"] == 1, (rank, last)
        assert last["wire_bytes"] > 0, (rank, last)


def test_a_rank_killed_while_the_host_fetches_fails_the_version_and_a_restarted_one_takes_its_number(
        procs: RankProcesses):
    """Rank 1 is killed as the worker's host starts to fetch version 1 (SIGKILL): rank 0's
    send raises ``TrainerRankLostError`` naming rank 1 and the worker applies nothing new;
    a new rank 1 joins (its ``connect()`` writes the next version, as a rank that joins late
    does) and version 1 (the failed one's number, in a new round) reaches the worker whole."""
    scheme = _scheme(1, delta=True)
    _start(procs, scheme, [0], kill_rank_1_at=1)
    assert _both(procs, "connect") == [("ok", 0), ("ok", 0)]
    assert _applied(procs, 0, 0) == [0]
    procs.tell(("rank", 1), "send", 1)
    procs.tell(("rank", 0), "send", 1)
    word = procs.next(("rank", 0), WORD_S)
    assert word[:3] == ("error", "TrainerRankLostError", 1), word
    assert "while the hosts fetched version 1" in str(word[4]), word
    procs.start(("rank", 1), ends.trainer_rank, scheme, 1, TIMEOUT, 1)
    procs.tell(("rank", 0), "send", 1)
    procs.tell(("rank", 1), "connect")
    assert [procs.next(("rank", r), WORD_S) for r in range(2)] == [("ok", 1), ("ok", 1)]
    assert _applied(procs, 0, 1) == [1]  # nothing between: version 1, whole, once


def test_workers_copy_cannot_be_a_rank_and_a_killed_worker_is_named(procs: RankProcesses):
    scheme = _scheme(2)
    with pytest.raises(ValueError, match="holds no rank key"):
        scheme.for_workers().create_sender(rank=1)
    _start(procs, scheme, [0, 1])
    assert _both(procs, "connect") == [("ok", 0), ("ok", 0)]
    procs.kill(("worker", 1))
    rank_0, rank_1 = _both(procs, "send", 1)
    assert rank_0[:2] == ("error", "WorkerLostError") and rank_0[3] == [1], rank_0
    assert rank_1 == ("ok", 1)  # ranks >= 1 never wait for the workers
    assert _applied(procs, 0, 1)[-1] == 1
    assert _both(procs, "send", 2) == [("ok", 2), ("ok", 2)]  # reported once
