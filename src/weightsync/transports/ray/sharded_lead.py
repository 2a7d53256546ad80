"""Rank 0 of a sharded trainer on the Ray scheme: the coordinator.

Rank 0 is a :class:`~weightsync.transports.ray.writer.RayWriter` that never holds the whole
model. It owns the actor handles, the group generations (group ranks ``0..N-1`` are the
trainer's ranks, the relay actors follow) and the rendezvous actor, which doubles as the
board through which ranks 1..N-1 learn each generation and each version's plan and report
back (``sharded_rank.py``): no collective ever runs on the user's process group.

Version n: rank 0 checks every rank's announced layout and regions (once per change:
``SchemaMismatchError`` naming rank and key, before any byte is sent), builds a generation
if there is none, posts the plan (version, attempt, generation, relays), signals every
relay actor, sends its own pieces (``shard_stream``) and waits for every rank's done
record and every actor's answer. A rank whose record is missing at rank 0's deadline (less
a margin, so the others hear it before theirs ends), or whose stream a relay saw break, is
:class:`TrainerRankLostError`: the outcome posted says so, so every rank raises the same,
no actor takes the version (a relay stages a version only once every rank's stream
arrived whole and verified), and the next send rebuilds the group.
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
    SchemaMismatchError,
    TrainerRankLostError,
    WeightSyncError,
    WorkerLostError,
)
from weightsync.core.layout import Layout
from weightsync.core.shards import check_cover, describe_regions, local_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.ray import shard_stream
from weightsync.transports.ray.members import BROADCAST_SHARE, share
from weightsync.transports.ray.shard_stream import send_pieces
from weightsync.transports.ray.writer import RayWriter, _Flight

logger = logging.getLogger(__name__)

#: how often rank 0 looks at the board while it waits for the other ranks
POLL_S = 0.02


class ShardedLeadWriter(RayWriter):
    """Rank 0 of ``trainer_ranks`` ranks: coordinates, and sends its own pieces."""

    sharded = True

    def __init__(self, *, trainer_ranks: int, **options: Any) -> None:
        super().__init__(trainer_ranks=trainer_ranks, **options)
        self.trainer_ranks = trainer_ranks
        self.joined_at = NO_VERSION
        self.committed = NO_VERSION
        self._checked: dict[int, str] = {}  # rank -> the hello nonce whose layout was checked
        self._regions: dict[int, dict[str, list[int]]] = {}
        self._pieces: list[Any] = []
        self._attempt = ""
        self._own_error: str | None = None
        self._chunk_bytes = shard_stream.CHUNK_BYTES

    # ------------------------------------------------------------------ the ranks
    def _board(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self.members._ray.get(getattr(self.members.rendezvous, method).remote(*args),
                                     timeout=timeout)

    def _check_ranks(self, layout: Layout, regions: dict[str, list[int]], version: int,
                     deadline: Deadline) -> None:
        """Wait for every rank's hello; a layout that differs from ours, or regions that do
        not tile every tensor exactly once, are refused naming rank and key (posted, so the
        other ranks raise the same)."""
        while True:
            hellos = self._board("get_hellos", timeout=deadline.remaining())
            missing = [r for r in range(1, self.trainer_ranks) if r not in hellos]
            if not missing:
                break
            if deadline.expired():
                raise TrainerRankLostError(
                    f"trainer rank(s) {missing} did not connect within {deadline} (version "
                    f"{version}): start every rank, each calling create_sender(rank=r), "
                    "register_model() and send()", rank=missing[0])
            time.sleep(deadline.slice(0.05))
        nonces = {r: str(h["nonce"]) for r, h in hellos.items()}
        if self._checked == nonces and self._regions.get(0) == regions:
            return
        try:
            for r in range(1, self.trainer_ranks):
                theirs = Layout.from_dict(hellos[r]["layout"])
                layout.check_compatible(theirs, self_name="trainer rank 0",
                                        other_name=f"trainer rank {r}")
            regions_by_rank = {0: regions} | {r: hellos[r]["regions"]
                                              for r in range(1, self.trainer_ranks)}
            check_cover(layout, regions_by_rank)
        except SchemaMismatchError as exc:
            self._fail(version, {"type": "schema", "message": str(exc), "key": exc.key})
            raise
        self._checked, self._regions = nonces, regions_by_rank

    def _fail(self, version: int, failure: dict[str, Any]) -> None:
        """Post a failed attempt of ``version`` (the other ranks raise ``failure``)."""
        attempt = self._attempt or secrets.token_hex(8)
        if not self._attempt:
            self._board("post_plan", {"version": version, "attempt": attempt, "generation": -1,
                                      "relays": [], "nonces": {}}, timeout=5)
        self._board("post_outcome", attempt, {"failed": failure}, timeout=5)
        self._attempt = ""

    # ------------------------------------------------------------------ publish
    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        members = self.members
        self.committed = version
        self._attempt = ""
        members.take_announcements(deadline)
        self._prepare(layout)
        assert self._layout is not None and self._wire_layout is not None
        self._pieces = local_pieces(flat, 0)
        self._check_ranks(layout, describe_regions(self._pieces), version, deadline)
        dead: Losses = {}
        silent: Losses = {}
        if members.group is None:
            budget = share(deadline, BROADCAST_SHARE)
            try:
                dead, silent = members.build(self._layout, None, budget or self._timeout,
                                             deadline, relay=self.backend == "gloo")
            except WorkerLostError as exc:
                self._blame_join(version, exc)
                raise
            silent = {w: why for w, why in silent.items() if w not in members.reported}
            # a rank restarted meanwhile announced itself before it joined: check it now
            self._check_ranks(layout, describe_regions(self._pieces), version, deadline)
        assert members.group is not None
        keep = [w for w in requested if w not in members.reported]
        dead |= {w: "not a member of the group" for w in keep
                 if w not in members.members and w not in dead and w not in silent}
        self._attempt = secrets.token_hex(8)
        self._chunk_bytes = shard_stream.CHUNK_BYTES
        plan = {"version": version, "attempt": self._attempt,
                "generation": members.group.info.generation,
                "relays": sorted(members.group.info.ranks.values()), "nonces": self._checked,
                "chunk_bytes": self._chunk_bytes}
        self._board("post_plan", plan, timeout=deadline.remaining())
        self._flight = _Flight(version, {}, silent)
        return dead

    def _blame_join(self, version: int, exc: WorkerLostError) -> None:
        """The group could not be built: a rank that never started joining is lost."""
        joining = self._board("get_joining", timeout=5)
        generation = self.members._generation
        for r in range(1, self.trainer_ranks):
            if joining.get(r) != generation:
                message = (f"trainer rank {r} did not join group generation {generation} for "
                           f"version {version} ({exc})")
                self._fail(version, {"type": "lost", "rank": r, "message": message})
                raise TrainerRankLostError(message, rank=r) from exc

    def republish(self, requested: list[int], version: int, deadline: Deadline) -> Losses:
        raise NotImplementedError(
            "a sharded trainer holds no whole snapshot to send again: a replacement actor "
            "joins at the next send")

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        """Signal every relay actor, then send rank 0's own pieces to each."""
        flight, members = self._flight, self.members
        assert flight is not None and flight.version == version
        assert members.group is not None and self._wire_layout is not None
        group = members.group
        flight.sent = True
        flight.keep = {w for w in targets if w not in members.reported}
        budget = share(deadline, BROADCAST_SHARE)
        delivery = {"generation": group.info.generation, "checked": True,
                    "timeout_s": None if budget is None else budget * 0.95,
                    "sharded": {"regions": self._regions, "chunk_bytes": self._chunk_bytes}}
        flight.delivery = delivery
        for w, h in members.members.items():
            if w in members.followers:
                continue  # signalled with its relay's answer
            followers = [f for f in members.relays_of(w) if f in flight.keep]
            flight.refs[w] = h._weightsync_receive.remote(
                version, w in flight.keep, None,
                delivery | {"relay": followers} if followers else delivery)
        self._own_error = None
        try:
            send_pieces(group, self._pieces, self._wire_layout, self._regions[0],
                        sorted(group.info.ranks.values()), version, budget, self._chunk_bytes)
        except RuntimeError as exc:
            logger.warning("trainer rank 0: sending version %d failed: %s", version, exc)
            self._own_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {}

    # ------------------------------------------------------------------ wait
    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Every rank's done record and every relay's answer; a lost rank fails the version
        for everyone (posted), else it is committed and the actors' answers are judged as
        for an unsharded trainer."""
        flight = self._flight
        assert flight is not None and flight.version == version
        lost_rank, why, failures = self._wait_ranks(flight, deadline)
        if lost_rank is not None or failures:
            self._flight = None
            self.members.group = None  # rebuilt (with every rank) at the next send
            if lost_rank is not None:
                message = (f"trainer rank {lost_rank} was lost while sending version "
                           f"{version} ({why}); no worker takes it, they keep the version "
                           "they hold")
                self._fail(version, {"type": "lost", "rank": lost_rank, "message": message})
            else:
                message = (f"version {version} failed: {'; '.join(failures)}; no worker takes "
                           "it, they keep the version they hold (the group is rebuilt at "
                           "the next send)")
                self._fail(version, {"type": "failed", "message": message})
            self._answers_after_failure(flight, deadline)
            if lost_rank is not None:
                raise TrainerRankLostError(message, rank=lost_rank)
            raise WeightSyncError(message)
        self._board("post_outcome", self._attempt, {"committed": version},
                    timeout=deadline.remaining())
        self._attempt = ""
        super().wait_acked(targets, version, deadline, lost)

    def _wait_ranks(self, flight: _Flight,
                    deadline: Deadline) -> tuple[int | None, str, list[str]]:
        """Until every rank 1..N-1 reported and every relay answered: the first rank lost
        (a relay saw its stream break and it did not report done, or it is silent at the
        deadline less a margin, ``Deadline.ahead``) with why, and what failed otherwise (a rank's own
        send, a relay's stream: the version cannot be whole)."""
        ray = self.members._ray
        ahead = deadline.ahead()
        refs = list(flight.refs.values())
        while True:
            dones = self._board("get_dones", self._attempt, timeout=deadline.remaining())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            broken: dict[int, str] = {}
            for ref in ready:
                try:
                    answer = ray.get(ref, timeout=0)
                except Exception:  # judged by super().wait_acked
                    continue
                if isinstance(answer, dict):
                    for r in answer.get("lost_ranks") or []:
                        broken.setdefault(int(r), str(answer.get("refused")))
            for r in range(1, self.trainer_ranks):  # a rank that reported is alive
                if r in broken and r not in dones:
                    return r, broken[r], []
            finished = len(dones) >= self.trainer_ranks - 1 and len(ready) == len(refs)
            if not finished and ahead.expired():
                missing = [r for r in range(1, self.trainer_ranks) if r not in dones]
                if missing:
                    return missing[0], (f"it did not finish its part within {deadline} "
                                        "(dead, stopped or too slow)"), []
                finished = True  # the ranks are done; the actors are judged as usual
            if finished:
                failures = [f"trainer rank {r}: {d['error']}" for r, d in sorted(dones.items())
                            if d.get("error")]
                if self._own_error is not None:
                    failures.insert(0, f"trainer rank 0: {self._own_error}")
                failures += [f"a relay: {why}" for why in broken.values()]
                return None, "", failures
            time.sleep(POLL_S)

    def _answers_after_failure(self, flight: _Flight, deadline: Deadline) -> None:
        """Let the relays' takes finish (they fail: their stream broke) so they are free for
        the next build; their versions stay as they were."""
        answers = self.members.answers(flight.refs, share(deadline, 0.5))
        for w, acked in answers.values.items():
            if isinstance(acked, dict) and "held" in acked and w in flight.keep:
                self._versions[w] = int(acked["held"])
