"""The rank-protocol conformance suite: the same faults against every transport that takes
``trainer_ranks``, two real rank processes holding ``ws.LocalShard`` halves and one worker.

The rule (docs/sharded.md): a rank that never appears, dies or stalls is
``TrainerRankLostError(rank=r)`` on every other rank within its deadline, rank 0
included; a failed version is not counted (the next committed version takes its number);
one late rank costs at most the version it missed; a worker cannot act as a rank, and a
record forged on the board without the rank key is dropped; a rank restarted during a send
(also while rank 0 is held inside it) joins the next version; a second live claimant of a
rank index is refused, saying so."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
from rank_harness import ROWS, TRANSPORTS, Ranks

pytestmark = pytest.mark.timeout(180)

#: a generous margin over a deadline, for a loaded machine
SLACK_S = 3.0
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the Ray cases of this module; its GCS address."""
    pytest.importorskip("ray")
    from ray_processes import local_ray_instance

    yield from local_ray_instance(TESTS_DIR)


@pytest.fixture(params=["shared_mem", "directory", "net", "net_scheme",
                        pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])])
def transport(request):
    if request.param == "ray":
        from rank_harness_ray import Ray

        made = Ray(timeout=60, address=request.getfixturevalue("ray_cluster"))
    else:
        made = TRANSPORTS[request.param](timeout=60)
    yield made
    made.close()


@pytest.fixture
def ranks(transport):
    group = Ranks(transport)
    yield group
    group.close()


@pytest.fixture
def worker(transport):
    made = transport.worker()
    yield made
    made.close()


def ok(ranks, key, version, timeout=60.0):
    got = ranks.next(key, timeout)
    assert got[:3] == ("ok", got[1], version), got
    return got


def lost(ranks, key, rank, within, timeout=60.0):
    """``key`` raised ``TrainerRankLostError`` naming ``rank``, within ``within`` seconds."""
    got = ranks.next(key, timeout)
    assert got[0] == "error" and got[2] == "TrainerRankLostError" and got[4] == rank, got
    assert got[5] < within + SLACK_S, got
    return got


def worker_if_ray(request):
    """Ray's rank 0 is handed its actor at ``create_sender``, so the actor must exist; on
    the other transports these failures come before any worker matters, and a worker
    whose ``connect()`` never ends would only wait out its own deadline at teardown."""
    if request.node.callspec.params.get("transport") == "ray":
        request.getfixturevalue("worker")


def connect_both(ranks, worker):
    for r in (0, 1):
        assert ranks.start(r)[0] == "ready"
    for r in (0, 1):
        ranks.tell(r, "connect", 60)
    for r in (0, 1):
        ok(ranks, r, 0)
    worker.holds(0)


def send_both(ranks, version, timeout=60):
    for r in (0, 1):
        ranks.tell(r, "send", timeout)
    for r in (0, 1):
        ok(ranks, r, version)


@pytest.mark.parametrize("missing", [0, 1])
def test_a_rank_that_never_starts_is_named_within_the_deadline(transport, ranks, missing,
                                                              request):
    worker_if_ray(request)
    present = 1 - missing
    assert ranks.start(present)[0] == "ready"
    ranks.tell(present, "connect", 6)
    lost(ranks, present, missing, within=6)


def test_a_killed_rank_is_named_and_a_restarted_one_joins_the_next_version(ranks, worker):
    connect_both(ranks, worker)
    ranks.kill(1)
    ranks.tell(0, "send", 6)
    lost(ranks, 0, 1, within=6)
    assert ranks.start(1)[0] == "ready"
    ranks.tell(1, "connect", 60, 1.0)
    ranks.tell(0, "send", 60)
    ok(ranks, 1, 1)  # the failed version was not counted: versions stay dense
    ok(ranks, 0, 1)
    worker.holds(1)
    send_both(ranks, 2)
    worker.holds(2)


def test_a_stopped_rank_is_named_within_the_deadline_and_catches_up(ranks, worker):
    connect_both(ranks, worker)
    ranks.signal(1, signal.SIGSTOP)
    ranks.tell(0, "send", 4)
    lost(ranks, 0, 1, within=4)
    ranks.tell(1, "send", 60)
    ranks.signal(1, signal.SIGCONT)
    time.sleep(0.5)  # rank 1 resumes into its send before rank 0 retries
    ranks.tell(0, "send", 60)
    ok(ranks, 0, 1)
    ok(ranks, 1, 1)
    worker.holds(1)


def test_a_layout_disagreement_is_refused_naming_rank_and_key(ranks, request):
    worker_if_ray(request)
    assert ranks.start(0)[0] == "ready"
    assert ranks.start(1, rows=ROWS + 2)[0] == "ready"  # another global shape of "w"
    for r in (0, 1):
        ranks.tell(r, "connect", 20)
    for r in (0, 1):
        got = ranks.next(r)
        assert got[0] == "error" and got[2] == "SchemaMismatchError", got
        assert "rank 1" in got[3] and "'w'" in got[3], got


def test_a_late_rank_costs_at_most_the_version_it_missed(ranks, worker):
    """Rank 1's send gives up before rank 0 starts its own (an evaluation on rank 0):
    every later version commits on both ranks."""
    connect_both(ranks, worker)
    ranks.tell(1, "send", 1)
    lost(ranks, 1, 0, within=1)
    for version in range(1, 5):
        send_both(ranks, version)
    worker.holds(4)


def test_a_worker_cannot_act_as_a_rank(transport, ranks, worker):
    """The workers' copy of the scheme holds no rank key: create_sender(rank=1) on it is
    refused, saying so. A worker that makes up a key of its own (with everything else it
    holds: token, address, directory, rendezvous name) and joins as rank 1 proves nothing
    to rank 0: it is refused or never counted, and the real ranks commit the next version
    with their own rows (the worker holds it whole: no 666 in it)."""
    as_worker = pickle.loads(pickle.dumps(transport.worker_scheme()))  # as a worker gets it
    with pytest.raises(ValueError, match=r"workers' copy.*for_workers\(\)"):
        as_worker.create_sender(rank=1)
    connect_both(ranks, worker)
    assert ranks.start(1, key="poser", scheme=transport.posing_scheme(),
                       first_value=666.0)[0] == "ready"
    ranks.tell("poser", "connect", 4, 666.0)
    got = ranks.next("poser")
    assert got[0] == "error", got
    send_both(ranks, 1)
    worker.holds(1)


def test_a_forged_hello_or_done_is_dropped(transport, ranks, worker):
    """Where the ranks' records lie on a board anyone inside the medium may write (the
    directory's files, the Ray rendezvous actor), a process without the rank key posts a
    hello claiming rank 1 (as a live process) before the real rank 1 joins, and a done
    answering rank 0's plan for rank 1 before rank 1 writes: both are dropped, rank 0
    waits for the real rank 1, and the version commits with the real rows.

    On a board without the seal, the forged hello made the real rank 1 a second live
    claimant (refused), and the forged done let rank 0 commit without rank 1's rows."""
    forger = transport.forger()
    if forger is None:
        pytest.skip(f"{transport.name}: a rank proves the key in its connection's handshake; "
                    "there is no board to post on without it")
    assert ranks.start(0)[0] == "ready"
    forger.hello(1)
    assert ranks.start(1)[0] == "ready"
    for r in (0, 1):
        ranks.tell(r, "connect", 60)
    for r in (0, 1):
        ok(ranks, r, 0)
    worker.holds(0)
    ranks.tell(0, "send", 60)
    forger.done(1, timeout=30)
    time.sleep(1.0)  # rank 0 polls the board every few ms: it would have taken the done
    assert ranks.outs[0].empty(), ranks.next(0)
    ranks.tell(1, "send", 60)
    ok(ranks, 0, 1)
    ok(ranks, 1, 1)
    worker.holds(1)


def test_a_rank_restarted_while_rank_0_is_inside_its_send_joins_the_next_version(
        ranks, worker, tmp_path):
    """The race of a restart during a send, made deterministic: rank 0 is held inside its
    send of version 1 (its plan posted for the old rank 1, before it waits for the others);
    the old rank 1 is killed and a new rank-1 process connects then; rank 0 is released.
    Neither crashes: rank 0 names rank 1 (restarted) for that version, and the new rank 1
    joins the next attempt, which commits version 1 (versions stay dense)."""
    hold = str(tmp_path / "hold")
    assert ranks.start(0, hold=hold)[0] == "ready"
    assert ranks.start(1)[0] == "ready"
    for r in (0, 1):
        ranks.tell(r, "connect", 60)
    for r in (0, 1):
        ok(ranks, r, 0)
    worker.holds(0)
    ranks.tell(0, "send", 60)
    deadline = time.monotonic() + 60
    while not os.path.exists(hold + ".held"):
        assert time.monotonic() < deadline, "rank 0 never reached its wait for the ranks"
        time.sleep(0.01)
    ranks.kill(1)
    assert ranks.start(1)[0] == "ready"
    ranks.tell(1, "connect", 60, 1.0)
    time.sleep(1.5)  # the new rank 1 connects and announces itself while rank 0 is held
    assert ranks.outs[1].empty(), ranks.next(1)
    open(hold + ".go", "w").close()
    lost(ranks, 0, 1, within=60)
    ranks.tell(0, "send", 60)
    ok(ranks, 0, 1)
    ok(ranks, 1, 1)
    worker.holds(1)
    send_both(ranks, 2)
    worker.holds(2)


def test_a_rank_restarted_during_a_send_joins_the_next_version(ranks, worker):
    connect_both(ranks, worker)
    ranks.tell(0, "send", 8)
    time.sleep(1.0)  # rank 0 is waiting for rank 1's part
    ranks.kill(1)
    assert ranks.start(1)[0] == "ready"
    ranks.tell(1, "connect", 60, 1.0)
    lost(ranks, 0, 1, within=8)
    ranks.tell(0, "send", 60)
    ok(ranks, 0, 1)
    ok(ranks, 1, 1)
    worker.holds(1)
    send_both(ranks, 2)
    worker.holds(2)


def test_a_second_live_claimant_of_a_rank_is_refused_saying_so(ranks, worker):
    connect_both(ranks, worker)
    assert ranks.start(1, key="second")[0] == "ready"
    ranks.tell("second", "connect", 6, 1.0)
    got = ranks.next("second")
    assert got[0] == "error" and "already" in got[3], got
    send_both(ranks, 1)
    worker.holds(1)
