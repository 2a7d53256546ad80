"""The side of ranks 1..N-1 of the rank protocol, written once over a
:class:`~.board.MemberBoard`.

Within its ``send()``, a rank announces itself (a new incarnation per connection and per
model), then takes the first plan that names its incarnation and that it has not handled:
it writes its part (the medium's ``write``), posts its done and returns once rank 0 posted
the outcome (committed: the plan's version; failed: the error every rank raises).

Stale answers are dropped: a plan decided before this send began (the rank was late, or
stopped while idle) is not this send's, so one late rank costs at most the attempt it
missed; a plan naming another incarnation (before a restart) is not this rank's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import TrainerRankLostError
from weightsync.transports.ranks.board import POLL_S, MemberBoard
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan

logger = logging.getLogger(__name__)


class RankMember:
    """Rank ``rank`` (1..N-1), over ``board``."""

    def __init__(self, board: MemberBoard, rank: int) -> None:
        self.board, self.rank = board, rank
        self.hello: Hello | None = None
        #: the plan whose failure the last take_part raised (None: it raised no outcome)
        self.failed: Plan | None = None
        self._handled: set[str] = set()  # attempts taken part in, or decided before asked
        #: the hello was posted for the send now under way: a plan naming it answers this send
        self._announced_now = False

    def announce(self, hello: Hello) -> None:
        """Post ``hello`` if it is a new incarnation."""
        if self.hello is None or self.hello.incarnation != hello.incarnation:
            self.board.post_hello(hello)
            self.hello = hello
            self._announced_now = True

    def take_part(self, write: Callable[[Plan], dict[str, Any]], version: int,
                  deadline: Deadline) -> int:
        """Write this rank's part of the next plan rank 0 posts for it (the version this
        rank's sender expects, ``version``, or the one rank 0 is at) and return the version
        committed; raise the attempt's failure as every rank does."""
        assert self.hello is not None, "announce() first"
        incarnation = self.hello.incarnation
        self.failed = None
        fresh, self._announced_now = self._announced_now, False
        self.board.wait(0.0)  # take in what arrived while this rank was away
        missed: Outcome | None = None  # the newest attempt for it that failed before it came
        for plan in self.board.plans():
            outcome = self.board.outcome(plan.attempt)
            if outcome is not None:
                named = plan.incarnations.get(self.rank) == incarnation
                if named and fresh:  # it answers the hello of this very send: not stale
                    continue
                self._handled.add(plan.attempt)  # decided before this send: not its
                missed = None if outcome.committed else outcome if named else missed
        while True:
            for plan in self.board.plans():
                if plan.attempt in self._handled or plan.incarnations.get(self.rank) != incarnation:
                    continue
                self._handled.add(plan.attempt)
                outcome = self.board.outcome(plan.attempt)
                if outcome is not None:  # decided while this rank waited: it is told why
                    if outcome.committed:
                        continue
                    self.failed = plan
                    raise outcome.error(self.rank)
                detail = write(plan)
                self.board.post_done(Done(self.rank, incarnation, plan.attempt, detail))
                return self._outcome(plan, deadline)
            self._check_lead()
            if deadline.expired():
                if missed is not None:  # the last news of that version: why it failed
                    raise missed.error(self.rank, f" (before this rank's send began; no "
                                                  f"other attempt came within {deadline})")
                raise TrainerRankLostError(
                    f"trainer rank {self.rank}: trainer rank 0 did not start version {version} "
                    f"within {deadline} (is it sending? every rank calls send() for each "
                    "version)", rank=0)
            self.board.wait(deadline.slice(POLL_S))

    def _outcome(self, plan: Plan, deadline: Deadline) -> int:
        while True:
            outcome = self.board.outcome(plan.attempt)
            if outcome is not None:
                if outcome.committed:
                    return plan.version
                self.failed = plan
                raise outcome.error(self.rank)
            try:
                self._check_lead()
            except TrainerRankLostError:  # rank 0 may have decided just before it left
                outcome = self.board.outcome(plan.attempt)
                if outcome is None:
                    raise
                continue
            if deadline.expired():
                raise TrainerRankLostError(
                    f"trainer rank {self.rank}: trainer rank 0 did not commit version "
                    f"{plan.version} within {deadline} (this rank wrote its part)", rank=0)
            self.board.wait(deadline.slice(POLL_S))

    def _check_lead(self) -> None:
        why = self.board.lead_lost()
        if why:
            raise TrainerRankLostError(f"trainer rank {self.rank}: trainer rank 0 {why}", rank=0)
