"""Ranks 1..N-1 of a sharded trainer on the Ray scheme: a
:class:`~weightsync.transports.ranks.member.MemberWriter` over rank 0's rendezvous actor
(found by name in the scheme's namespace; the actor dies with rank 0's process, which is
:class:`TrainerRankLostError` naming rank 0). While it waits for a plan the rank joins each
new group generation as group rank ``rank``; for its plan it streams its pieces to every
relay actor (``shard_stream``) and its done carries the error its stream hit, if any. Its
records are sealed with the ranks' key, and it takes only rank 0's that prove it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    TrainerRankLostError,
    WeightSyncError,
)
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, describe_regions
from weightsync.transports.ranks.board import POLL_S
from weightsync.transports.ranks.member import MemberWriter
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan
from weightsync.transports.ranks.seal import (
    DONE,
    HELLO,
    OUTCOME,
    PLAN,
    WITHDRAW,
    DropLog,
    RecordSeal,
)
from weightsync.transports.ray.group import GroupInfo, WeightGroup
from weightsync.transports.ray.rendezvous import board_call_timeout
from weightsync.transports.ray.shard_stream import send_pieces

logger = logging.getLogger(__name__)


class RayMemberBoard:
    """Rank ``rank``'s side of the board on rank 0's rendezvous actor (a
    :class:`~weightsync.transports.ranks.board.MemberBoard`), and its data plane (a
    :class:`~weightsync.transports.ranks.member.MemberPlane`): joining group generations,
    streaming its pieces to the relays."""

    def __init__(self, rank: int, secret: str, rank_key: str, rendezvous_name: str,
                 namespace: str, dtype: torch.dtype | None) -> None:
        import ray

        self._ray, self.rank, self.secret, self.dtype = ray, rank, secret, dtype
        self.seal = RecordSeal(rank_key)
        self._drops = DropLog(logger)
        self.rendezvous_name, self.namespace = rendezvous_name, namespace
        self.actor: Any = None
        self.group: WeightGroup | None = None
        self._tried_generation = 0  # the newest generation this rank tried to join
        self.deadline: Deadline | None = None  # of the call under way (start, a send)
        self._snapshot: dict[str, Any] = {}

    def start(self, deadline: Deadline) -> int:
        """Find rank 0's rendezvous actor (rank 0 may start later); returns the newest
        version committed (a rank that joins late continues from there)."""
        self.deadline = deadline
        while True:
            try:
                self.actor = self._ray.get_actor(self.rendezvous_name, namespace=self.namespace)
                break
            except ValueError:
                if deadline.expired():
                    raise TrainerRankLostError(
                        f"trainer rank {self.rank}: rank 0's rendezvous actor "
                        f"{self.rendezvous_name!r} (namespace {self.namespace!r}) did not "
                        f"appear within {deadline}: is rank 0 running, with the same "
                        "scheme?", rank=0) from None
                time.sleep(deadline.slice(0.1))
        return int(self._call("board")["committed"])

    def _call(self, method: str, *args: Any) -> Any:
        """One call to the board, within the send's deadline (``board_call_timeout``); rank
        0's rendezvous actor gone, or silent past it, is rank 0 lost."""
        ray = self._ray
        timeout = board_call_timeout(self.deadline)
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError as exc:
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: rank 0 is gone (its rendezvous actor "
                f"{self.rendezvous_name!r} died: {type(exc).__name__})", rank=0) from None
        except ray.exceptions.GetTimeoutError:
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: rank 0's rendezvous actor did not answer {method} "
                f"within {timeout} s", rank=0) from None

    # ------------------------------------------------------------------ the board
    def post_hello(self, hello: Hello) -> None:
        why = self._call("post_hello", self.rank, self.seal.seal(HELLO, hello.to_json()))
        if why:
            raise WeightSyncError(f"trainer rank {self.rank} was refused by rank 0: {why}")

    def withdraw(self, hello: Hello) -> None:
        if self.actor is not None:
            with contextlib.suppress(Exception):
                withdrawal = {"rank": self.rank, "incarnation": hello.incarnation}
                self._ray.get(self.actor.withdraw_hello.remote(
                    self.rank, self.seal.seal(WITHDRAW, withdrawal)), timeout=2)

    def plans(self) -> list[Plan]:
        raw = self._look()["plan"]
        where = "rank 0's plan"
        try:
            return [] if raw is None else [Plan.from_json(self.seal.opened(PLAN, raw, where),
                                                          where)]
        except IntegrityError as exc:
            self._drops.dropped(0, exc, raw)
            return []

    def outcome(self, attempt: str) -> Outcome | None:
        plan, raw = self._snapshot.get("plan"), self._snapshot.get("outcome")
        if raw is None or plan is None or plan.get("attempt") != attempt:
            raw = self._call("get_outcome", attempt)
        if raw is None:
            return None
        where = "rank 0's outcome"
        try:
            outcome = Outcome.from_json(self.seal.opened(OUTCOME, raw, where), where)
        except IntegrityError as exc:
            self._drops.dropped(0, exc, raw)
            return None
        return outcome if outcome.attempt == attempt else None

    def post_done(self, done: Done) -> None:
        why = self._call("post_done", self.rank, done.attempt,
                         self.seal.seal(DONE, done.to_json()))
        if why:
            logger.warning("trainer rank %d: rank 0's board refused its done: %s", self.rank,
                           why)

    def lead_lost(self) -> str:
        return ""  # every call raises once the rendezvous actor died with rank 0

    def wait(self, seconds: float) -> None:
        self._look()
        if seconds > 0:
            time.sleep(min(seconds, POLL_S))

    def _look(self) -> dict[str, Any]:
        """The board now; join a new generation being built (one no plan named yet: rank
        0 waits for every rank; one a plan named is in use or, failed, dead)."""
        snapshot = self._snapshot = self._call("board")
        info, planned = snapshot["info"], int(snapshot.get("planned_generation", -1))
        if info is not None and int(info["generation"]) > self._tried_generation \
                and planned < int(info["generation"]):
            self._join(info)
        return snapshot

    # ------------------------------------------------------------------ the data plane
    def _join(self, info: dict[str, Any]) -> None:
        """Join group generation ``info`` as group rank ``rank`` (blocks until every member
        joined, within the generation's timeout)."""
        generation = int(info["generation"])
        self._tried_generation = generation
        self.drop_group()
        self._call("post_joining", self.rank, generation)
        try:
            self.group = WeightGroup(GroupInfo(**(dict(info) | {"secret": self.secret})),
                                     self.rank)
        except (RuntimeError, IntegrityError) as exc:
            logger.warning("trainer rank %d could not join group generation %d: %s",
                           self.rank, generation, exc)
            self.group = None

    def drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ as the member's plane
    def writer(self, pieces: list[ShardPiece], layout: Layout, deadline: Deadline
               ) -> Callable[[Plan], dict[str, Any]]:
        """Stream ``pieces`` to every relay actor of the generation a plan names; the done
        carries the error a stream hit, if any."""
        wire = layout.with_dtype(self.dtype).on_device("cpu")
        regions = describe_regions(pieces)
        self.deadline = deadline  # the board's calls of this send wait within it

        def write(plan: Plan) -> dict[str, Any]:
            detail, group, error = plan.detail, self.group, None
            if group is None or group.info.generation != detail.get("generation"):
                error = f"it is not a member of group generation {detail.get('generation')}"
            else:
                left = deadline.remaining()
                try:
                    send_pieces(group, pieces, wire, regions, list(detail["relays"]),
                                plan.version, None if left is None else left * 0.9,
                                int(detail["chunk_bytes"]))
                except RuntimeError as exc:
                    error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if error is not None:
                logger.warning("trainer rank %d: version %d: %s", self.rank, plan.version, error)
                self.drop_group()
            return {"error": error}

        return write

    def failed(self, plan: Plan | None) -> None:
        if plan is not None and "generation" in plan.detail:
            self.drop_group()  # rank 0 builds a new one for the next attempt

    def close(self, hello: Hello | None) -> None:
        self.drop_group()
        if hello is not None:
            self.withdraw(hello)


def rank_ray_writer(*, rank: int, secret: str, rank_key: str, rendezvous_name: str,
                    namespace: str, dtype: torch.dtype | None) -> MemberWriter:
    """Trainer rank ``rank`` (1..N-1): writes its pieces of each version rank 0 plans."""
    board = RayMemberBoard(rank, secret, rank_key, rendezvous_name, namespace, dtype)
    return MemberWriter(rank, board, board, liveness=True)
