"""The board: what the rank protocol needs from the medium that carries its records. Each
transport implements it in its own medium (socket messages for SharedMem, files for the
directory, an actor for Ray); the protocol (:mod:`.lead`, :mod:`.member`) is written once
against it and never sees the medium.

Every method returns at once (or after at most ``wait``'s seconds): the protocol owns
every deadline.
"""

from __future__ import annotations

from typing import Protocol

from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan

#: how often a rank looks at the board while it waits (a medium may wake it sooner)
POLL_S = 0.02


class LeadBoard(Protocol):
    """Rank 0's side of the board."""

    def hellos(self) -> dict[int, Hello]:
        """The newest hello of every rank 1..N-1 whose process may still answer."""

    def lost(self, rank: int, incarnation: str) -> str:
        """Why rank ``rank``'s incarnation ``incarnation`` can no longer answer (it died,
        hung up, closed, restarted), or '' while it may."""

    def post_plan(self, plan: Plan) -> None:
        """Show ``plan`` to every rank."""

    def dones(self, attempt: str) -> dict[int, Done]:
        """The done records of ``attempt`` posted so far (any other attempt's are stale)."""

    def post_outcome(self, outcome: Outcome) -> None:
        """Show how an attempt ended to every rank."""

    def wait(self, seconds: float) -> None:
        """Sleep until something may have changed on the board, at most ``seconds``."""


class MemberBoard(Protocol):
    """The side of ranks 1..N-1."""

    def post_hello(self, hello: Hello) -> None:
        """Announce this rank (again: a new incarnation replaces the old one)."""

    def plans(self) -> list[Plan]:
        """The plans seen so far that are not yet known to be decided, oldest first (a
        medium that keeps one plan returns it)."""

    def outcome(self, attempt: str) -> Outcome | None:
        """How ``attempt`` ended, if rank 0 said so."""

    def post_done(self, done: Done) -> None:
        """Tell rank 0 this rank wrote its part of ``done.attempt``."""

    def lead_lost(self) -> str:
        """Why rank 0 can no longer answer (its process died or closed), or '' while it
        may."""

    def wait(self, seconds: float) -> None:
        """Sleep until something may have changed on the board, at most ``seconds``."""
