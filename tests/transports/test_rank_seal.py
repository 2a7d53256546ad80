"""The rank key's seal on board records (``transports/ranks/seal.py``): a record verifies
only under the key it was sealed with, as the kind it was sealed as, with every field as it
was; the directory board drops (and logs, naming the rank) what does not verify."""

from __future__ import annotations

import json
import logging

import pytest

from weightsync.core.errors import IntegrityError
from weightsync.schemes.ranks import new_rank_key
from weightsync.transports.directory.ranks import LeadFiles, MemberFiles, hello_path, rank_path
from weightsync.transports.ranks.records import Done, Hello, Plan, new_id
from weightsync.transports.ranks.seal import DONE, HELLO, PLAN, RecordSeal, UnsealedRecordError


def _done() -> dict:
    return Done(1, new_id(), new_id(), {"checksums": [1, 2**63 + 5], "error": None}).to_json()


def test_a_sealed_record_verifies_only_as_it_was_sealed():
    key = new_rank_key()
    seal = RecordSeal(key)
    record = _done()
    sealed = json.loads(json.dumps(seal.seal(DONE, record)))  # as a file or Ray carries it
    assert seal.opened(DONE, sealed, "rank 1's done") == record
    with pytest.raises(UnsealedRecordError, match="rank 1's done does not prove"):
        RecordSeal(new_rank_key()).opened(DONE, sealed, "rank 1's done")  # another key
    with pytest.raises(UnsealedRecordError):
        seal.opened(HELLO, sealed, "w")  # another kind
    for field, value in (("rank", 2), ("attempt", new_id()), ("incarnation", new_id()),
                         ("detail", {"checksums": [0, 0], "error": None})):
        with pytest.raises(UnsealedRecordError):
            seal.opened(DONE, sealed | {field: value}, "w")  # another rank, round, part
    with pytest.raises(UnsealedRecordError):
        seal.opened(DONE, record, "w")  # no proof at all
    with pytest.raises(IntegrityError):
        seal.opened(DONE, ["not", "a", "record"], "w")
    with pytest.raises(ValueError, match="workers' copy"):
        RecordSeal("")


def test_the_directory_board_drops_forged_records_and_logs_the_rank(tmp_path, caplog):
    key = new_rank_key()
    lead = LeadFiles(tmp_path, 0o600, 2, 0.005, key)
    member = MemberFiles(tmp_path, 0o600, 1, 0.005, key)
    hello = Hello(1, new_id(), {}, "fp", {}, {"pid": 1})
    forged = hello.to_json() | {"mac": "00" * 32}
    hello_path(tmp_path, 1).write_text(json.dumps(forged))
    with caplog.at_level(logging.WARNING):
        assert lead.hellos() == {}
        assert lead.hellos() == {}  # the same forgery is logged once
    dropped = [r for r in caplog.records if "trainer rank 1's" in r.getMessage()]
    assert len(dropped) == 1, caplog.text
    member.post_hello(hello)  # a forged hello holds nothing: the real rank takes its place
    assert lead.hellos()[1] == hello
    plan = Plan(1, new_id(), {1: hello.incarnation}, {"slot": 0})
    lead.post_plan(plan)
    assert member.plans() == [plan]
    rank_path(tmp_path, 1).write_text(json.dumps(
        Done(1, hello.incarnation, plan.attempt).to_json() | {"mac": "00" * 32}))
    assert lead.dones(plan.attempt) == {}
    member.post_done(Done(1, hello.incarnation, plan.attempt))
    assert list(lead.dones(plan.attempt)) == [1]
    hello_path(tmp_path, 1).write_text(json.dumps(forged))  # overwritten again
    assert lead.lost(1, hello.incarnation) == ""  # not lost: the rank writes it again
    member.plans()
    assert lead.hellos()[1] == hello
    other = RecordSeal(new_rank_key())  # a plan from a process handed another scheme
    (tmp_path / "pending.json").write_text(json.dumps(
        {"plan": other.seal(PLAN, plan.to_json()), "outcomes": []}))
    assert member.plans() == []


def test_a_proof_already_on_a_record_is_replaced_when_sealed_again():
    seal = RecordSeal(new_rank_key())
    record = _done()
    twice = seal.seal(DONE, seal.seal(DONE, record))
    assert seal.opened(DONE, twice, "w") == record
