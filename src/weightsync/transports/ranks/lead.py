"""Rank 0's side of the rank protocol, written once over a :class:`~.board.LeadBoard`.

For each attempt at version n: :meth:`RankLead.meet` waits for every rank's hello and
checks, before any byte is written, that they registered the same global layout and that
their regions tile every tensor exactly once; :meth:`begin` posts the plan (the medium's
detail: which slot); :meth:`wait_done` waits for every rank's done record of that attempt;
then :meth:`commit` or :meth:`fail` posts the outcome every rank raises or returns.
:meth:`RankLead.run` is that whole round, once for every medium: the medium's driver gives
it only its data plane (a ``body`` that picks the plan's detail and writes rank 0's part
through :meth:`LeadRound.write`, then finishes with the ranks' done records).

Rank 0 waits on ``deadline.ahead()``, so it gives up early enough for the other ranks,
waiting on their whole deadline, to hear why. A rank that never appears, died, hung up,
restarted or stayed silent is :class:`TrainerRankLostError` naming it, on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from weightsync.core.deadline import Deadline
from weightsync.core.errors import SchemaMismatchError, TrainerRankLostError
from weightsync.core.layout import Layout
from weightsync.core.shards import check_cover
from weightsync.transports.ranks.board import POLL_S, LeadBoard
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan, failure, new_id

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
#: rank 0's model in a round: its global layout, and the regions it writes
Model = tuple[Layout, dict[str, list[int]]]


def while_ranks_write(plan: Plan) -> None:
    """Called in rank 0 once it posted ``plan`` and wrote its own part, before it waits for
    the other ranks' done records; tests replace it (in rank 0's own process) to hold rank 0
    inside its send at exactly that point (a rank restarted meanwhile, a forged record)."""


def _also(ranks: list[int]) -> str:
    return f" (nor did trainer ranks {ranks[1:]})" if len(ranks) > 1 else ""


def _check_hello(layout: Layout, hello: Hello) -> None:
    """Rank ``hello.rank`` registered the same global layout as rank 0 (same names, shapes,
    dtypes, in the same order), or a SchemaMismatchError naming the rank and the key."""
    if hello.fingerprint == layout.fingerprint:
        return
    try:
        theirs = Layout.from_dict(hello.layout)
    except (ValueError, TypeError, KeyError) as exc:
        raise SchemaMismatchError(f"trainer rank {hello.rank} sent an unreadable layout: "
                                  f"{exc}") from None
    try:
        layout.check_compatible(theirs, self_name="trainer rank 0's model",
                                other_name=f"trainer rank {hello.rank}'s model")
    except SchemaMismatchError as exc:
        raise SchemaMismatchError(f"trainer rank {hello.rank} registered another model: {exc}",
                                  key=exc.key, expected=exc.expected, got=exc.got) from None
    raise SchemaMismatchError(f"trainer rank {hello.rank} registered the same tensors in "
                              "another order than trainer rank 0")


class LeadRound:
    """One attempt at ``version`` as the medium's data plane sees it inside
    :meth:`RankLead.run`: it names the plan's detail and writes rank 0's own part."""

    def __init__(self, lead: RankLead, version: int, deadline: Deadline) -> None:
        self.lead, self.version, self.deadline = lead, version, deadline
        self.plan: Plan | None = None

    def write(self, detail: dict[str, object], own: Callable[[Plan], T]
              ) -> tuple[T, dict[int, Done]]:
        """Post the plan (``detail``: the medium's, e.g. which slot), write rank 0's part
        (``own(plan)``) and wait for every rank's done record of that attempt; returns what
        ``own`` returned and the done records, by rank."""
        plan = self.plan = self.lead.begin(self.version, detail)
        mine = own(plan)
        return mine, self.lead.wait_done(plan, self.deadline)


class RankLead:
    """Rank 0 of ``world`` ranks, over ``board``."""

    def __init__(self, board: LeadBoard, world: int) -> None:
        self.board, self.world = board, world
        #: rank -> incarnation, as of the last meeting
        self.met: dict[int, str] = {}
        self.current: Plan | None = None
        self._checked: tuple[dict[int, str], str, dict[str, list[int]]] | None = None

    def run(self, version: int, deadline: Deadline, model: Callable[[], Model],
            body: Callable[[LeadRound], R]) -> R:
        """The whole round at ``version``: meet the ranks over rank 0's ``model()`` (its
        global layout and the regions it writes, read here so that a failure there is told
        to every rank too), then ``body`` writes the version (through
        :meth:`LeadRound.write`) and finishes it with the ranks' done records (publishes,
        delivers); commit once ``body`` returned, or post its failure to every rank and
        raise it."""
        try:
            layout, regions = model()
            self.meet(layout, regions, version, deadline)
            result = body(LeadRound(self, version, deadline))
        except BaseException as exc:
            self.fail(version, exc)
            raise
        self.commit()
        return result

    def meet(self, layout: Layout, own: dict[str, list[int]], version: int,
             deadline: Deadline) -> None:
        """Wait (until ``deadline.ahead()``) for every rank's hello, and check the layouts
        and the cover once per change of a rank's incarnation or of rank 0's model."""
        ahead = deadline.ahead()
        while True:
            hellos = self.board.hellos()
            missing = [r for r in range(1, self.world) if r not in hellos]
            self.met = {r: h.incarnation for r, h in hellos.items()}
            if not missing:
                break
            if ahead.expired():
                raise TrainerRankLostError(
                    f"trainer rank {missing[0]} did not join version {version} within "
                    f"{deadline}{_also(missing)} (trainer_ranks={self.world}: every rank "
                    "calls scheme.create_sender(rank=r) on the scheme handed to it, the same "
                    "for every rank, then register_model() and connect())",
                    rank=missing[0])
            self.board.wait(ahead.slice(POLL_S))
        key = (dict(self.met), layout.fingerprint, own)
        if self._checked == key:
            return
        for rank, hello in sorted(hellos.items()):
            try:
                _check_hello(layout, hello)
            except SchemaMismatchError as exc:
                exc.rank = rank  # type: ignore[attr-defined]
                raise
        check_cover(layout, {0: own, **{r: h.regions for r, h in hellos.items()}})
        self._checked = key
        logger.info("trainer ranks 0..%d agree on the layout %s", self.world - 1,
                    layout.fingerprint)

    def begin(self, version: int, detail: dict[str, object]) -> Plan:
        """Post the plan of a new attempt at ``version`` for the ranks just met."""
        plan = Plan(version, new_id(), dict(self.met), dict(detail))
        self.current = plan
        self.board.post_plan(plan)
        return plan

    def wait_done(self, plan: Plan, deadline: Deadline) -> dict[int, Done]:
        """Every rank's done record of ``plan``'s attempt, by the incarnation it names;
        a rank lost meanwhile, or silent at ``deadline.ahead()``, fails the attempt."""
        while_ranks_write(plan)
        ahead = deadline.ahead()
        while True:
            dones = {r: d for r, d in self.board.dones(plan.attempt).items()
                     if d.incarnation == plan.incarnations.get(r)}
            silent = [r for r in range(1, self.world) if r not in dones]
            if not silent:
                return dones
            for rank in silent:
                why = self.board.lost(rank, plan.incarnations[rank])
                if why:
                    raise TrainerRankLostError(
                        f"trainer rank {rank} {why} while version {plan.version} was being "
                        "written", rank=rank)
            if ahead.expired():
                raise TrainerRankLostError(
                    f"trainer rank {silent[0]} did not write its part of version "
                    f"{plan.version} within {deadline}{_also(silent)} (stopped, hung, or too "
                    "slow)", rank=silent[0])
            self.board.wait(ahead.slice(POLL_S))

    def commit(self) -> None:
        """The current attempt is committed: every rank's send returns its version."""
        plan, self.current = self.current, None
        assert plan is not None
        self.board.post_outcome(Outcome(plan.attempt, plan.version, True))

    def fail(self, version: int, error: BaseException) -> Outcome:
        """The attempt at ``version`` failed with ``error`` (before its plan, too): every
        rank that waits raises the same. A lost rank is met and checked again next time."""
        plan, self.current = self.current, None
        if plan is None:  # the outcome first: a rank never sees this plan without it (and
            # would otherwise write into a slot that was never handed out)
            plan = Plan(version, new_id(), dict(self.met))
            outcome = failure(plan, error)
            self.board.post_outcome(outcome)
            self.board.post_plan(plan)
        else:
            outcome = failure(plan, error)
            self.board.post_outcome(outcome)
        if isinstance(error, TrainerRankLostError):
            self._checked = None
        logger.warning("version %d was not committed: %s", version, outcome.message)
        return outcome
