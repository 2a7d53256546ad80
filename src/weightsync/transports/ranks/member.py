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
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from weightsync.core.deadline import Deadline
from weightsync.core.errors import TrainerRankLostError, WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, describe_regions, local_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.ranks.board import POLL_S, MemberBoard
from weightsync.transports.ranks.liveness import process_detail
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan, new_id

logger = logging.getLogger(__name__)


class RankMember:
    """Rank ``rank`` (1..N-1), over ``board``. ``liveness``: its hellos carry this process's
    pid and host (:func:`~.liveness.process_detail`), for media that cannot tell a lost rank
    from a connection (files, a Ray actor)."""

    def __init__(self, board: MemberBoard, rank: int, *, liveness: bool = False) -> None:
        self.board, self.rank, self.liveness = board, rank, liveness
        self.hello: Hello | None = None
        #: the plan whose failure the last take_part raised (None: it raised no outcome)
        self.failed: Plan | None = None
        self._handled: set[str] = set()  # attempts taken part in, or decided before asked
        #: the hello was posted for the send now under way: a plan naming it answers this send
        self._announced_now = False

    def run(self, layout: Layout, regions: dict[str, list[int]],
            write: Callable[[Plan], dict[str, Any]], version: int, deadline: Deadline) -> int:
        """The whole round on this rank: announce the model (a new incarnation when its
        layout or its ``regions`` changed), then write its part of the next plan rank 0
        posts for it (``write(plan)`` returns the done record's detail); returns the
        version committed, or raises the attempt's failure as every rank does."""
        known = self.hello
        if known is None or known.fingerprint != layout.fingerprint or known.regions != regions:
            self.announce(Hello(self.rank, new_id(), layout.to_dict(), layout.fingerprint,
                                regions, process_detail() if self.liveness else {}))
        return self.take_part(write, version, deadline)

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


class MemberPlane(Protocol):
    """A medium's data plane on ranks 1..N-1: where a rank's pieces go."""

    def start(self, deadline: Deadline) -> int:
        """Reach rank 0's medium; returns the newest version committed (this rank's first
        send is the next)."""

    def writer(self, pieces: list[ShardPiece], layout: Layout, deadline: Deadline
               ) -> Callable[[Plan], dict[str, Any]]:
        """How this send writes ``pieces`` where a plan says; returns its done's detail."""

    def failed(self, plan: Plan | None) -> None:
        """The send raised the failure of ``plan`` (None: no outcome of rank 0's)."""

    def close(self, hello: Hello | None) -> None:
        """Let the medium go (and withdraw ``hello``, where the board keeps it)."""

    # optional: ``version_figures(version) -> dict``, what crossed this rank's medium for
    # that version (its sender's ``stats()["last"]`` adds it)


class MemberWriter:
    """Trainer rank ``rank`` (1..N-1) as its sender's writer, on any medium: each send is
    :meth:`RankMember.run` over ``board``, writing through ``plane``. It never waits for
    the workers: rank 0 confirms every version to them."""

    needs_acks = False
    sharded = True

    def __init__(self, rank: int, board: MemberBoard, plane: MemberPlane, *,
                 liveness: bool = False, joined_at: int = NO_VERSION) -> None:
        self.rank, self.plane = rank, plane
        self.member = RankMember(board, rank, liveness=liveness)
        #: the newest committed version when this rank joined, and the last it committed
        self.joined_at = self.published = joined_at
        self.committed = NO_VERSION

    def start(self, deadline: Deadline) -> None:
        self.joined_at = self.plane.start(deadline)

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Write this rank's part of the next version rank 0 plans for it; returns once
        rank 0 committed it (``committed`` says which), or raises why it failed."""
        pieces = local_pieces(flat, self.rank)
        write = self.plane.writer(pieces, layout, deadline)
        try:
            self.committed = self.published = self.member.run(
                layout, describe_regions(pieces), write, version, deadline)
        except WeightSyncError:
            self.plane.failed(self.member.failed)
            raise
        return {}

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        return {}

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: dict[int, str]) -> None:
        """Rank 0 confirms the version to the workers."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Rank 0's ``connect()`` waits for the workers; this rank's ends at the commit."""

    def version_figures(self, version: int) -> dict[str, Any]:
        """What crossed this rank's medium for ``version``, where its plane counts it."""
        figures = getattr(self.plane, "version_figures", None)
        return figures(version) if callable(figures) else {}

    def held_versions(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        self.plane.close(self.member.hello)
