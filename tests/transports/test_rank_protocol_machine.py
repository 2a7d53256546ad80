"""The rank protocol's state machines (``transports/ranks``) over an in-memory board, in
threads: what the transports share, checked without any medium. The same faults against
real processes and every medium: ``tests/faults/test_rank_protocol.py``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError, SchemaMismatchError, TrainerRankLostError
from weightsync.core.layout import Layout, TensorSpec
from weightsync.transports.ranks.lead import LeadRound, RankLead
from weightsync.transports.ranks.member import RankMember
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan, new_id

LAYOUT = Layout([TensorSpec("w", (4, 3), torch.float32, "cpu")])
HALF = {0: {"w": [0, 2, 0, 3]}, 1: {"w": [2, 4, 0, 3]}}


class MemoryBoard:
    """Both sides of a board in one process: what a medium carries, nothing more."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.hello: dict[int, Hello] = {}
        self.plan_list: list[Plan] = []
        self.done_by: dict[str, dict[int, Done]] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.gone: dict[int, str] = {}

    # the lead's side
    def hellos(self) -> dict[int, Hello]:
        return {r: h for r, h in self.hello.items() if r not in self.gone}

    def lost(self, rank: int, incarnation: str) -> str:
        hello = self.hello.get(rank)
        if hello is None or hello.incarnation != incarnation:
            return "restarted"
        return self.gone.get(rank, "")

    def post_plan(self, plan: Plan) -> None:
        with self.cond:
            self.plan_list.append(plan)
            self.done_by[plan.attempt] = {}
            self.cond.notify_all()

    def dones(self, attempt: str) -> dict[int, Done]:
        return dict(self.done_by.get(attempt, {}))

    def post_outcome(self, outcome: Outcome) -> None:
        with self.cond:
            self.outcomes[outcome.attempt] = outcome
            self.cond.notify_all()

    def wait(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait(seconds)

    # a member's side
    def post_hello(self, hello: Hello) -> None:
        with self.cond:
            self.hello[hello.rank] = hello
            self.cond.notify_all()

    def plans(self) -> list[Plan]:
        return list(self.plan_list)

    def outcome(self, attempt: str) -> Outcome | None:
        return self.outcomes.get(attempt)

    def post_done(self, done: Done) -> None:
        with self.cond:
            if done.attempt in self.done_by:
                self.done_by[done.attempt][done.rank] = done
            self.cond.notify_all()

    def lead_lost(self) -> str:
        return self.gone.get(0, "")


def hello(rank: int = 1, layout: Layout = LAYOUT, regions: dict | None = None) -> Hello:
    return Hello(rank, new_id(), layout.to_dict(), layout.fingerprint,
                 HALF[rank] if regions is None else regions)


def lead_send(lead: RankLead, version: int, timeout: float) -> int:
    """What a transport's rank 0 does for one version: the whole round, writing nothing."""
    def body(round_: LeadRound) -> int:
        round_.write({"slot": 1}, lambda plan: None)
        return version

    return lead.run(version, Deadline(timeout), lambda: (LAYOUT, HALF[0]), body)


def in_thread(fn, *args):
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def member_send(member: RankMember, version: int, timeout: float, written: list[int]) -> int:
    def write(plan: Plan) -> dict[str, object]:
        written.append(plan.version)
        return {"slot": plan.detail["slot"]}

    return member.take_part(write, version, Deadline(timeout))


def test_records_round_trip_and_are_validated():
    plan = Plan(3, new_id(), {1: "abc"}, {"slot": 2})
    assert Plan.from_json(plan.to_json(), "p") == plan
    outcome = Outcome("a", 3, False, "lost", 1, "gone", None)
    assert Outcome.from_json(outcome.to_json(), "o") == outcome
    assert isinstance(outcome.error(1), TrainerRankLostError) and outcome.error(1).rank == 1
    with pytest.raises(IntegrityError, match="version has the wrong type"):
        Plan.from_json(plan.to_json() | {"version": "3"}, "p")
    with pytest.raises(IntegrityError, match="committed"):
        Outcome.from_json(outcome.to_json() | {"committed": 1}, "o")
    with pytest.raises(IntegrityError, match="region"):
        Hello.from_json(hello().to_json() | {"regions": {"w": [-1]}}, "h")


def test_a_late_member_costs_at_most_the_attempt_it_missed():
    board = MemoryBoard()
    lead, member = RankLead(board, 2), RankMember(board, 1)
    member.announce(hello())
    written: list[int] = []
    with pytest.raises(TrainerRankLostError) as late:  # rank 0 has not begun: it is named
        member_send(member, 1, 0.2, written)
    assert late.value.rank == 0 and "did not start version 1" in str(late.value)
    for version in (1, 2, 3):  # every later version commits on both
        thread, box = in_thread(member_send, member, version, 5.0, written)
        assert lead_send(lead, version, 5.0) == version
        thread.join(5)
        assert box == {"value": version}
    assert written == [1, 2, 3]


def test_an_attempt_decided_before_a_send_began_is_dropped_and_named_at_its_deadline():
    board = MemoryBoard()
    lead, member = RankLead(board, 2), RankMember(board, 1)
    member.announce(hello())
    written: list[int] = []
    with pytest.raises(TrainerRankLostError):  # its send gives up before rank 0 starts
        member_send(member, 1, 0.05, written)
    with pytest.raises(TrainerRankLostError):  # the member is stopped: nobody writes
        lead_send(lead, 1, 0.3)
    with pytest.raises(TrainerRankLostError) as missed:  # it woke up: no new attempt
        member_send(member, 1, 0.2, written)
    assert missed.value.rank == 1 and "before this rank's send began" in str(missed.value)
    thread, box = in_thread(member_send, member, 1, 5.0, written)  # the next attempt
    time.sleep(0.05)
    assert lead_send(lead, 1, 5.0) == 1
    thread.join(5)
    assert box == {"value": 1} and written == [1]


def test_a_failure_decided_for_this_sends_hello_before_the_member_looks_is_raised_at_once():
    """Rank 0 refuses the hello of a send (its plan and outcome posted) before that send's
    first look at the board: the failure answers this send, it is not a stale one."""
    board = MemoryBoard()
    lead, member = RankLead(board, 2), RankMember(board, 1)
    member.announce(hello(regions={"w": [0, 4, 0, 3]}))  # overlaps rank 0's rows
    with pytest.raises(SchemaMismatchError):
        lead_send(lead, 0, 5.0)
    started = time.monotonic()
    with pytest.raises(SchemaMismatchError, match="trainer ranks 0 and 1 both write"):
        member_send(member, 0, 5.0, [])
    assert time.monotonic() - started < 2.0  # not waited out to its deadline


def test_a_failure_decided_while_a_member_waits_is_raised_as_rank_0_raised_it():
    board = MemoryBoard()
    lead, member = RankLead(board, 2), RankMember(board, 1)
    member.announce(hello(regions={"w": [0, 4, 0, 3]}))  # overlaps rank 0's rows
    thread, box = in_thread(member_send, member, 0, 5.0, [])
    time.sleep(0.05)
    with pytest.raises(SchemaMismatchError, match="trainer ranks 0 and 1 both write"):
        lead_send(lead, 0, 5.0)
    thread.join(5)
    assert isinstance(box["error"], SchemaMismatchError) and box["error"].key == "w"


def test_the_lead_names_a_missing_a_lost_and_a_restarted_rank_early():
    board = MemoryBoard()
    lead = RankLead(board, 2)
    t0 = time.monotonic()
    with pytest.raises(TrainerRankLostError, match="did not join version 0") as missing:
        lead_send(lead, 0, 1.0)
    assert missing.value.rank == 1 and time.monotonic() - t0 < 0.95  # Deadline.ahead
    member = RankMember(board, 1)
    member.announce(hello())
    board.gone[1] = "died (pid 1)"  # a dead rank's hello does not count
    with pytest.raises(TrainerRankLostError, match="trainer rank 1 did not join") as lost:
        lead_send(lead, 0, 0.5)
    assert lost.value.rank == 1
    del board.gone[1]
    plan_count = len(board.plans())
    with pytest.raises(TrainerRankLostError, match="restarted") as restarted:
        lead.meet(LAYOUT, HALF[0], 0, Deadline(1))
        plan = lead.begin(0, {})
        board.post_hello(hello())
        lead.wait_done(plan, Deadline(1))
    assert restarted.value.rank == 1 and len(board.plans()) == plan_count + 1


def test_the_round_posts_a_failure_of_the_medium_and_raises_it():
    """``RankLead.run``: an exception in the medium's body (after every rank wrote) is the
    attempt's failure on every rank, and rank 0 raises it; the next round takes the same
    version number."""
    board = MemoryBoard()
    lead = RankLead(board, 2)
    member = RankMember(board, 1)
    member.announce(hello())
    written: list[int] = []
    thread, box = in_thread(member_send, member, 0, 5.0, written)

    def body(round_: LeadRound) -> None:
        round_.write({"slot": 1}, lambda plan: None)
        raise IntegrityError("the medium could not publish")

    with pytest.raises(IntegrityError, match="could not publish"):
        lead.run(0, Deadline(5.0), lambda: (LAYOUT, HALF[0]), body)
    thread.join(5)
    assert written == [0] and "could not publish" in str(box["error"])
    thread, box = in_thread(member_send, member, 0, 5.0, written)
    assert lead_send(lead, 0, 5.0) == 0
    thread.join(5)
    assert box["value"] == 0 and written == [0, 0]
