"""Rank 0 of a sharded trainer on the Ray scheme: the round of
:meth:`~weightsync.transports.ranks.lead.RankLead.run` over the rendezvous actor's records
(sealed with the ranks' key: a rank record that does not prove it is dropped and logged),
and Ray's data plane. Rank 0 is a :class:`~weightsync.transports.ray.writer.RayWriter` that
never holds the whole model: it owns the actor handles and the group generations (group
ranks ``0..N-1`` are the trainer's ranks, the relay actors follow). Its body builds a
generation if there is none, plans it with the relays and the chunk size, signals every
relay, streams its own pieces (``shard_stream``) and waits for every relay's answer; a relay
stages a version only once every rank's stream arrived whole and verified, so no actor takes
a failed one, and the next send rebuilds the group."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import (
    IntegrityError,
    TrainerRankLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.layout import Layout
from weightsync.core.shards import describe_regions, local_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.ranks.board import POLL_S
from weightsync.transports.ranks.lead import LeadRound, Model, RankLead
from weightsync.transports.ranks.liveness import hello_dead, lost_verdict
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan
from weightsync.transports.ranks.seal import (
    DONE,
    HELLO,
    MAC,
    OUTCOME,
    PLAN,
    DropLog,
    RecordSeal,
)
from weightsync.transports.ray import shard_stream
from weightsync.transports.ray.members import BROADCAST_SHARE, RayMembers, share
from weightsync.transports.ray.rendezvous import board_call_timeout
from weightsync.transports.ray.shard_stream import send_pieces
from weightsync.transports.ray.writer import RayWriter, _Flight

logger = logging.getLogger(__name__)


class RayLeadBoard:
    """The rank board on the rendezvous actor, rank 0's side (a
    :class:`~weightsync.transports.ranks.board.LeadBoard`). ``broken``: the ranks whose
    stream a relay saw break in the attempt under way (the data plane's word)."""

    def __init__(self, members: RayMembers, world: int, rank_key: str) -> None:
        self.members, self.world = members, world
        self.seal = RecordSeal(rank_key)
        self._drops = DropLog(logger)
        #: the hellos verified, by their proof (the board is read every few ms; a hello of
        #: a large model takes milliseconds to verify)
        self._verified: dict[str, Hello] = {}
        self.broken: dict[int, str] = {}
        self.watch: Callable[[], None] | None = None  # polls the relays while they take
        self.deadline: Deadline | None = None  # the round under way's (``publish`` sets it)

    def call(self, method: str, *args: Any) -> Any:
        """One call on the rendezvous actor, within the round's deadline
        (``rendezvous.board_call_timeout``)."""
        members = self.members
        timeout = board_call_timeout(self.deadline)
        try:
            return members._ray.get(getattr(members.rendezvous, method).remote(*args),
                                    timeout=timeout)
        except members._ray.exceptions.GetTimeoutError:
            raise WeightSyncTimeoutError(
                f"trainer rank 0: its rendezvous actor {members.rendezvous_name!r} did not "
                f"answer {method} within {timeout} s (its node overloaded, or the actor "
                "stuck)") from None

    def _all_hellos(self) -> dict[int, Hello]:
        out = {}
        verified = {}
        for rank, raw in self.call("get_hellos").items():
            where = f"trainer rank {rank}'s hello"
            proof = raw.get(MAC) if isinstance(raw, dict) else None
            hello = self._verified.get(proof) if isinstance(proof, str) else None
            if hello is None:
                try:
                    hello = Hello.from_json(self.seal.opened(HELLO, raw, where), where)
                except IntegrityError as exc:
                    self._drops.dropped(int(rank), exc, raw)
                    continue
            verified[str(proof)] = hello
            if hello.rank == int(rank):
                out[hello.rank] = hello
        self._verified = verified
        return out

    def hellos(self) -> dict[int, Hello]:
        return {r: h for r, h in self._all_hellos().items()
                if 1 <= r < self.world and not hello_dead(h)}

    def lost(self, rank: int, incarnation: str) -> str:
        verdict = lost_verdict(self._all_hellos().get(rank), incarnation, "closed")
        if not verdict and rank in self.broken:
            return f"broke off its stream ({self.broken[rank]})"
        return verdict

    def post_plan(self, plan: Plan) -> None:
        self.broken = {}
        self.call("post_plan", self.seal.seal(PLAN, plan.to_json()))

    def dones(self, attempt: str) -> dict[int, Done]:
        out = {}
        for rank, raw in self.call("get_dones", attempt).items():
            where = f"trainer rank {rank}'s done"
            try:
                done = Done.from_json(self.seal.opened(DONE, raw, where), where)
            except IntegrityError as exc:
                self._drops.dropped(int(rank), exc, raw)
                continue
            if done.rank == int(rank) and done.attempt == attempt:
                out[done.rank] = done
        return out

    def post_outcome(self, outcome: Outcome) -> None:
        self.call("post_outcome", outcome.attempt, self.seal.seal(OUTCOME, outcome.to_json()))

    def wait(self, seconds: float) -> None:
        if self.watch is not None:
            self.watch()
        time.sleep(min(seconds, POLL_S))


class RayLeadWriter(RayWriter):
    """Rank 0 of ``trainer_ranks`` ranks: leads the rank protocol, and sends its own pieces."""

    sharded = True

    def __init__(self, *, trainer_ranks: int, rank_key: str, **options: Any) -> None:
        super().__init__(trainer_ranks=trainer_ranks, rank_key=rank_key, **options)
        self.trainer_ranks = trainer_ranks
        self.joined_at = NO_VERSION
        self.committed = NO_VERSION  # the version the last round committed (the sender reads it)
        self.board = RayLeadBoard(self.members, trainer_ranks, rank_key)
        self.lead = RankLead(self.board, trainer_ranks)
        self._pieces: list[Any] = []
        self._own: dict[str, list[int]] = {}  # the regions of rank 0's pieces
        self._own_error: str | None = None
        self._built_for: dict[int, str] = {}  # the rank incarnations the group was built with

    # ------------------------------------------------------------------ publish
    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        """The whole round at ``version``: meet the ranks, build a generation if needed,
        signal every relay actor, send rank 0's pieces, then wait for every rank's done and
        every relay's answer; a failure of any of it fails the version on every rank. The
        actors' answers are judged by ``wait_acked``, as for an unsharded trainer."""
        self._flight = None
        self.board.deadline = deadline

        def model() -> Model:
            self.members.take_announcements(deadline)
            self._prepare(layout)
            self._pieces = local_pieces(flat, 0)
            self._own = describe_regions(self._pieces)
            return layout, self._own

        try:
            dead = self.lead.run(version, deadline, model,
                                 lambda round_: self._round(round_, layout, requested))
        except BaseException:
            flight, self._flight = self._flight, None
            if flight is not None:  # the relays were signalled: rebuilt at the next send
                self.members.group = None
                self._answers_after_failure(flight, deadline)
            raise
        finally:
            self.board.watch = None
            self.board.deadline = None
        self.committed = version
        return dead

    def _round(self, round_: LeadRound, layout: Layout, requested: list[int]) -> Losses:
        members, version, deadline, own = self.members, round_.version, round_.deadline, self._own
        dead, silent = self._group(layout, own, version, deadline)
        assert members.group is not None
        regions = {0: own} | {r: h.regions for r, h in self.board.hellos().items()}
        keep = [w for w in requested if w not in members.reported]
        dead |= {w: "not a member of the group" for w in keep
                 if w not in members.members and w not in dead and w not in silent}
        flight = self._flight = _Flight(version, {}, silent)
        flight.keep = {w for w in keep if w not in dead}
        group = members.group
        detail = {"generation": group.info.generation,
                  "relays": sorted(group.info.ranks.values()),
                  "chunk_bytes": shard_stream.CHUNK_BYTES}
        _, dones = round_.write(detail, lambda plan: self._send_own(flight, regions, deadline))
        failures = self._wait_relays(flight, dones, deadline)
        if failures:
            raise WeightSyncError(
                f"version {version} failed: {'; '.join(failures)}; no worker takes it, they "
                "keep the version they hold (the group is rebuilt at the next send)")
        return dead

    def _group(self, layout: Layout, own: dict[str, list[int]], version: int,
               deadline: Deadline) -> tuple[Losses, Losses]:
        """A group generation with every rank met (built anew when a rank restarted);
        returns the workers dead and silent meanwhile."""
        members = self.members
        dead: Losses = {}
        silent: Losses = {}
        if self.lead.met != self._built_for:
            members.group = None  # a rank restarted: its new process joins a new one
        if members.group is None:
            assert self._layout is not None
            budget = share(deadline, BROADCAST_SHARE)
            try:
                dead, silent = members.build(self._layout, None, budget or self._timeout,
                                             deadline, relay=self.backend == "gloo")
            except WorkerLostError as exc:
                raise self._blame_join(version, exc) from exc
            silent = {w: why for w, why in silent.items() if w not in members.reported}
            # a rank restarted meanwhile announced itself before it joined: meet it now
            self.lead.meet(layout, own, version, deadline)
            self._built_for = dict(self.lead.met)
        return dead, silent

    def _blame_join(self, version: int, exc: WorkerLostError) -> BaseException:
        """The group could not be built: a rank that never started joining is lost."""
        joining = self.board.call("get_joining")
        generation = self.members._generation
        for r in range(1, self.trainer_ranks):
            if joining.get(r) != generation:
                return TrainerRankLostError(
                    f"trainer rank {r} did not join group generation {generation} for "
                    f"version {version} ({exc})", rank=r)
        return exc

    def republish(self, requested: list[int], version: int, deadline: Deadline) -> Losses:
        raise NotImplementedError(
            "a sharded trainer holds no whole snapshot to send again: a replacement actor "
            "joins at the next send")

    def _send_own(self, flight: _Flight, regions: dict[int, dict[str, list[int]]],
                  deadline: Deadline) -> None:
        """Signal every relay actor, then send rank 0's own pieces to each (a stream that
        breaks is rank 0's failure, said once every rank answered)."""
        members, group, version = self.members, self.members.group, flight.version
        assert group is not None and self._wire_layout is not None
        flight.sent = True  # RayWriter.deliver has nothing left to do
        budget = share(deadline, BROADCAST_SHARE)
        chunk_bytes = shard_stream.CHUNK_BYTES
        delivery = {"generation": group.info.generation, "checked": True,
                    "timeout_s": None if budget is None else budget * 0.95,
                    "sharded": {"regions": regions, "chunk_bytes": chunk_bytes}}
        flight.delivery = delivery
        for w, h in members.members.items():
            if w in members.followers:
                continue  # signalled with its relay's answer
            followers = [f for f in members.relays_of(w) if f in flight.keep]
            flight.refs[w] = h._weightsync_receive.remote(
                version, w in flight.keep, None,
                delivery | {"relay": followers} if followers else delivery)
        self.board.watch = lambda: self._watch(flight)
        self._own_error = None
        try:
            send_pieces(group, self._pieces, self._wire_layout, regions[0],
                        sorted(group.info.ranks.values()), version, budget, chunk_bytes)
        except RuntimeError as exc:
            logger.warning("trainer rank 0: sending version %d failed: %s", version, exc)
            self._own_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    # ------------------------------------------------------------------ wait
    def _watch(self, flight: _Flight) -> None:
        """The relays that answered so far: the ranks whose stream one saw break."""
        ray, refs = self.members._ray, list(flight.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in ready:
            try:
                answer = ray.get(ref, timeout=0)
            except Exception:  # judged by wait_acked
                continue
            if isinstance(answer, dict):
                for r in answer.get("lost_ranks") or []:
                    self.board.broken.setdefault(int(r), str(answer.get("refused")))

    def _wait_relays(self, flight: _Flight, dones: dict[int, Done], deadline: Deadline
                     ) -> list[str]:
        """Every relay's answer until ``deadline.ahead()``, once every rank is done; returns
        what failed (a rank's or rank 0's own stream, a relay's: the version cannot be
        whole)."""
        refs = list(flight.refs.values())
        if refs:
            self.members._ray.wait(refs, num_returns=len(refs),
                                   timeout=deadline.ahead().remaining())
            self._watch(flight)
        failures = [f"trainer rank {r}: {d.detail['error']}" for r, d in sorted(dones.items())
                    if d.detail.get("error")]
        if self._own_error is not None:
            failures.insert(0, f"trainer rank 0: {self._own_error}")
        return failures + [f"a relay: {why}" for why in self.board.broken.values()]

    def _answers_after_failure(self, flight: _Flight, deadline: Deadline) -> None:
        """Let the relays' takes finish (they fail: their stream broke) so they are free for
        the next build; their versions stay as they were."""
        answers = self.members.answers(flight.refs, share(deadline, 0.5))
        for w, acked in answers.values.items():
            if isinstance(acked, dict) and "held" in acked and w in flight.keep:
                self._versions[w] = int(acked["held"])
