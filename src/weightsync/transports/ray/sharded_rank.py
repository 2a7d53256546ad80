"""Ranks 1..N-1 of a sharded trainer on the Ray scheme.

Such a rank is a process connected to the Ray cluster that holds only its shards. It finds
rank 0's rendezvous actor by name (in the scheme's namespace, since the ranks are separate
Ray jobs), announces its global layout and the regions it writes (its *hello*, posted again
when it registers another model), and for each version polls the board: it joins each new
group generation as group rank ``rank`` (group ranks ``0..N-1`` are the trainer's ranks),
waits for the plan of a version ``>=`` its own (a rank that fell behind writes the version
rank 0 is at: ``committed``), streams its pieces to every relay actor (``shard_stream``),
reports done, and returns once rank 0 posted the version's outcome: committed, or failed
(the same :class:`TrainerRankLostError` / :class:`SchemaMismatchError` as rank 0 raises).
The rendezvous actor dies with rank 0's process: that is :class:`TrainerRankLostError`
naming rank 0.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    TrainerRankLostError,
    WeightSyncError,
)
from weightsync.core.layout import Layout
from weightsync.core.shards import describe_regions, local_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.ray.group import GroupInfo, WeightGroup
from weightsync.transports.ray.shard_stream import send_pieces

logger = logging.getLogger(__name__)

#: how often a rank looks at the board while it waits
POLL_S = 0.02


class RankRayWriter:
    """Trainer rank ``rank`` (1..N-1): writes its pieces of each version rank 0 plans."""

    needs_acks = False
    sharded = True

    def __init__(self, *, rank: int, secret: str, rendezvous_name: str, namespace: str,
                 dtype: torch.dtype | None) -> None:
        import ray

        self._ray = ray
        self.rank = rank
        self.secret = secret
        self.rendezvous_name = rendezvous_name
        self.namespace = namespace
        self.dtype = dtype
        self.joined_at = NO_VERSION
        self.committed = NO_VERSION
        self._board: Any = None
        self._group: WeightGroup | None = None
        self._tried_generation = 0  # the newest generation this rank tried to join
        self._hello: tuple[str, Any] | None = None  # (fingerprint, regions) announced
        self._nonce = ""
        self._seen: set[str] = set()  # attempts this rank took part in or was told about

    # ------------------------------------------------------------------ lifecycle
    def start(self, deadline: Deadline) -> None:
        """Find rank 0's rendezvous actor (rank 0 may start later), and the newest version
        committed: a rank that joins late continues from there."""
        while True:
            try:
                self._board = self._ray.get_actor(self.rendezvous_name, namespace=self.namespace)
                break
            except ValueError:
                if deadline.expired():
                    raise TrainerRankLostError(
                        f"trainer rank {self.rank}: rank 0's rendezvous actor "
                        f"{self.rendezvous_name!r} (namespace {self.namespace!r}) did not "
                        f"appear within {deadline}: is rank 0 running, with the same "
                        "scheme?", rank=0) from None
                time.sleep(deadline.slice(0.1))
        board = self._call("board", deadline)
        self.joined_at = int(board["committed"])
        if board["plan"] is not None and board["outcome"] is not None:
            self._seen.add(str(board["plan"]["attempt"]))  # decided before this rank began

    def _call(self, method: str, deadline: Deadline, *args: Any) -> Any:
        """One call to the board; rank 0's rendezvous actor gone is rank 0 lost."""
        ray = self._ray
        try:
            return ray.get(getattr(self._board, method).remote(*args),
                           timeout=deadline.remaining())
        except ray.exceptions.RayActorError as exc:
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: rank 0 is gone (its rendezvous actor "
                f"{self.rendezvous_name!r} died: {type(exc).__name__})", rank=0) from None
        except ray.exceptions.GetTimeoutError:
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: rank 0's rendezvous actor did not answer within "
                f"{deadline}", rank=0) from None

    # ------------------------------------------------------------------ publish
    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        """Write this rank's pieces of the version rank 0 plans (``>= version``) and
        return once rank 0 committed it; raise what rank 0 raised if it failed."""
        wire = layout.with_dtype(self.dtype).on_device("cpu")
        pieces = local_pieces(flat, self.rank)
        regions = describe_regions(pieces)
        self._announce(layout, regions, deadline)
        plan = self._wait_plan(version, deadline)
        attempt = str(plan["attempt"])
        self._seen.add(attempt)
        self.committed = int(plan["version"])
        error: str | None = None
        group = self._group
        if plan.get("nonces", {}).get(self.rank, plan.get("nonces", {}).get(str(self.rank))) \
                != self._nonce:
            error = "its layout changed after rank 0 checked it (register_model again?)"
        elif group is None or group.info.generation != plan["generation"]:
            error = f"it is not a member of group generation {plan['generation']}"
        else:
            left = deadline.remaining()
            try:
                send_pieces(group, pieces, wire, regions, plan["relays"], self.committed,
                            None if left is None else left * 0.9, int(plan["chunk_bytes"]))
            except RuntimeError as exc:
                error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if error is not None:
            logger.warning("trainer rank %d: version %d: %s", self.rank, self.committed, error)
            self._drop_group()
        self._call("post_done", deadline, self.rank, attempt, {"error": error})
        self._wait_outcome(attempt, deadline)
        return {}

    def _announce(self, layout: Layout, regions: dict[str, list[int]], deadline: Deadline) -> None:
        """Post this rank's hello when it is new or changed (another model registered)."""
        key = (layout.fingerprint, regions)
        if self._hello == key:
            return
        self._nonce = secrets.token_hex(8)
        self._call("post_hello", deadline, self.rank, {
            "nonce": self._nonce, "layout": layout.to_dict(), "regions": regions})
        self._hello = key

    def _wait_plan(self, version: int, deadline: Deadline) -> dict[str, Any]:
        """Join each new generation as it appears; return the first undecided plan of a
        version ``>= version`` this rank has not taken part in (a decided one it never saw
        is raised: every rank's send fails the same way)."""
        while True:
            board = self._call("board", deadline)
            info, plan, outcome = board["info"], board["plan"], board["outcome"]
            # a generation with no plan yet is being built (rank 0 waits for every rank);
            # one that has a plan is in use or, failed, dead: never joined late
            if info is not None and int(info["generation"]) > self._tried_generation and (
                    plan is None or int(plan["generation"]) < int(info["generation"])):
                self._join(info, deadline)
            if plan is not None and int(plan["version"]) >= version \
                    and str(plan["attempt"]) not in self._seen:
                if outcome is None:  # not a member of its generation: publish says so
                    return dict(plan)
                if outcome is not None:
                    self._seen.add(str(plan["attempt"]))
                    self._raise_outcome(outcome)
            if deadline.expired():
                raise TrainerRankLostError(
                    f"trainer rank {self.rank}: rank 0 did not plan version {version} within "
                    f"{deadline} (is it sending?)", rank=0)
            time.sleep(deadline.slice(POLL_S))

    def _join(self, info: dict[str, Any], deadline: Deadline) -> None:
        """Join group generation ``info`` as group rank ``rank`` (blocks until every member
        joined, within the generation's timeout)."""
        generation = int(info["generation"])
        self._tried_generation = generation
        self._drop_group()
        self._call("post_joining", deadline, self.rank, generation)
        try:
            self._group = WeightGroup(GroupInfo(**(dict(info) | {"secret": self.secret})),
                                      self.rank)
        except (RuntimeError, IntegrityError) as exc:
            logger.warning("trainer rank %d could not join group generation %d: %s",
                           self.rank, generation, exc)
            self._group = None

    def _wait_outcome(self, attempt: str, deadline: Deadline) -> None:
        while True:
            outcome = self._call("get_outcome", deadline, attempt)
            if outcome is not None:
                self._raise_outcome(outcome)
                return
            if deadline.expired():
                raise TrainerRankLostError(
                    f"trainer rank {self.rank}: rank 0 did not commit version "
                    f"{self.committed} within {deadline}", rank=0)
            time.sleep(deadline.slice(POLL_S))

    def _raise_outcome(self, outcome: dict[str, Any]) -> None:
        failure = outcome.get("failed")
        if failure is None:
            return
        self._drop_group()
        message = f"trainer rank {self.rank}: {failure.get('message', 'the version failed')}"
        if failure.get("type") == "schema":
            raise SchemaMismatchError(message, key=failure.get("key"))
        if failure.get("type") == "lost":
            raise TrainerRankLostError(message, rank=int(failure["rank"]))
        raise WeightSyncError(message)

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    # ------------------------------------------------------------------ the rest
    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        return {}  # done in publish: rank 0 signals the actors and collects their answers

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Nothing: rank 0 waits for the actors."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Nothing: rank 0 waits for the actors."""

    def held_versions(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        self._drop_group()
