"""The Ray scheme's trainer end, as the send lifecycle drives it.

``publish`` takes the snapshot, after building a group generation if there is none: one
packed write into shared memory when actors share the trainer's node, else into the wire
buffers. ``deliver`` signals every member actor through Ray and broadcasts the packed
buckets, checksummed as they go out, once for all actors on other nodes (when no actor
shares the trainer's node, ``publish`` already streams the pack into the broadcast, chunk
by chunk). On a node with several actors, one relays the version to the others through
its shared memory: they are signalled once it answered. ``wait_acked`` collects the
actors' answers: a dead actor becomes :class:`WorkerLostError`, a silent one
:class:`WeightSyncTimeoutError`, a failed broadcast :class:`WeightSyncError`, each naming
the workers; the next send rebuilds the group without them, so the others keep receiving.

``dtype`` casts floating-point weights as they are packed. With ``delta`` (gloo), each node
on another host gets its own point-to-point stream instead of the broadcast: every chunk as
the difference from the version that node holds (``delta_stream``); a node whose rebuilt
version fails its checksums gets it whole at once, within the same send.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import WeightSyncError, WeightSyncTimeoutError, WorkerLostError
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.delta.codec import check_available
from weightsync.transports.ray.answers import Answers
from weightsync.transports.ray.delivery import Broadcast, Delivery, DeltaStream
from weightsync.transports.ray.delta_stream import (
    WHOLE_FIRST,
    WHOLE_REFUSED,
    DeltaSender,
    WireFigures,
)
from weightsync.transports.ray.group import FillChunk, _chunks, bucket_buffers, wire_device
from weightsync.transports.ray.members import BROADCAST_SHARE, RayMembers, share
from weightsync.transports.ray.node_local import NodeLocalSender
from weightsync.transports.ray.stream import can_stream, streamed_pack

logger = logging.getLogger(__name__)


@dataclass
class _Flight:
    """One version between ``publish`` and ``wait_acked``."""

    version: int
    buffers: dict[str, torch.Tensor]  # the packed snapshot
    silent: Losses  # left out of the group built for it
    keep: set[int] = field(default_factory=set)  # the workers it is for
    refs: dict[int, Any] = field(default_factory=dict)  # one take call per member
    sent: bool = False  # signalled and broadcast (by publish, when streamed)
    broadcast_error: str | None = None
    #: what every take call carries (the sharded lead's: its wire form)
    delivery: Delivery | Mapping[str, Any] | None = None
    snapshot_id: str | None = None  # delta: the snapshot streamed
    figures: WireFigures = field(default_factory=WireFigures)


class RayWriter:
    """Trainer side of the Ray scheme: actors as workers, Ray for signals, weightsync's own
    group for the bytes. ``checksums`` is read at each send; ``dtype`` (floating-point
    weights cast as packed) and ``delta`` (per-node delta streams) are fixed."""

    needs_acks = True

    def __init__(self, *, num_workers: int, backend: str, node_local: bool, checksums: bool,
                 rendezvous_name: str, secret: str, timeout: float,
                 dtype: torch.dtype | None = None, delta: bool = False,
                 trainer_ranks: int = 1, namespace: str | None = None,
                 rank_key: str = "") -> None:
        if delta:
            check_available()
        self.members = RayMembers(num_workers=num_workers, backend=backend, secret=secret,
                                  rendezvous_name=rendezvous_name, store_timeout=timeout,
                                  trainer_ranks=trainer_ranks, namespace=namespace,
                                  rank_key=rank_key)
        self.backend = backend
        self.node_local = node_local
        self.checksums = checksums
        self._timeout = timeout
        self._layout: Layout | None = None
        self._wire_layout: Layout | None = None
        self._buffers: dict[str, torch.Tensor] | None = None  # wire buffers, made on first use
        self._latest: dict[str, torch.Tensor] | None = None  # the newest snapshot's buffers
        self._latest_in_slot = False  # ... in shared memory (else in the wire buffers)
        self.local: NodeLocalSender | None = None  # actors on this node read from here
        self._versions: dict[int, int] = {}  # the version each worker last confirmed
        self._flight: _Flight | None = None
        self.dtype = dtype
        self.delta = delta
        self._delta: DeltaSender | None = None  # made with the wire layout
        self.figures: dict[int, dict[str, int]] = {}  # version -> what crossed the network

    # ------------------------------------------------------------------ lifecycle
    def start(self, deadline: Deadline) -> None:
        """Wait until every worker's actor is known (handed over or announced)."""
        self.members.wait_for_handles(deadline)

    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        return self._snapshot(flat, layout, requested, version, deadline)

    def republish(self, requested: list[int], version: int, deadline: Deadline) -> Losses:
        """``publish`` again the newest snapshot, as ``version``, for ``requested`` (a
        replacement actor brought in at once); deliver and wait as for a send."""
        if self._layout is None:
            raise RuntimeError("nothing was published yet")
        return self._snapshot(None, self._layout, requested, version, deadline)

    def _prepare(self, layout: Layout) -> None:
        """The wire layout, and shared memory for actors on this node (gloo, CPU weights,
        ``node_local``); chosen once. ``layout`` is the trainer's, cast here to ``dtype``."""
        layout = layout.with_dtype(self.dtype)
        self._layout = layout
        if self._wire_layout is not None:
            return
        self._wire_layout = layout.on_device(wire_device(self.backend))
        if self.delta:
            self._delta = DeltaSender(self._wire_layout)
        if (self.node_local and self.backend == "gloo"
                and set(layout.nbytes_by_device) == {"cpu"}):
            self.local = NodeLocalSender(max_slots=self.members.num_workers + 2)

    def _wire_buffers(self) -> dict[str, torch.Tensor]:
        assert self._wire_layout is not None
        if self._buffers is None:
            self._buffers = self._wire_layout.allocate()
        return self._buffers

    def _snapshot(self, flat: Mapping[str, torch.Tensor] | None, layout: Layout,
                  requested: list[int], version: int, deadline: Deadline) -> Losses:
        members = self.members
        members.take_announcements(deadline)  # a replacement actor joins at the next send
        self._prepare(layout)
        assert self._layout is not None
        layout = self._layout
        wire_layout, local = self._wire_layout, self.local
        assert wire_layout is not None
        dead: Losses = {}
        silent: Losses = {}
        if members.group is None:
            budget = share(deadline, BROADCAST_SHARE)
            dead, silent = members.build(layout, local, budget or self._timeout, deadline,
                                         relay=self.node_local and self.backend == "gloo")
            silent = {w: why for w, why in silent.items() if w not in members.reported}
        assert members.group is not None
        # after the build: a worker that answers again is back
        keep = [w for w in requested if w not in members.reported]
        dead |= {w: "not a member of the group" for w in keep
                 if w not in members.members and w not in dead and w not in silent}
        local_keep = [w for w in keep if local is not None and w in local.workers]
        if flat is None:
            buffers, fill, snapshot_id = self._latest_again(local_keep, version, deadline)
        else:
            buffers, fill, snapshot_id = self._pack(flat, local_keep, version, deadline,
                                                    members.group.info.world_size)
        self._latest = buffers
        if self.backend == "nccl":
            torch.cuda.synchronize()
        self._flight = flight = _Flight(version, buffers, silent, snapshot_id=snapshot_id)
        if fill is not None:
            assert flat is not None
            targets = [w for w in requested if w not in dead]
            self._send(flight, targets, deadline, fill)
            if flight.broadcast_error is not None:  # the snapshot must be whole all the same
                wire_layout.pack(flat, buffers)
        return dead

    def _latest_again(self, local_keep: list[int], version: int, deadline: Deadline,
                      ) -> tuple[dict[str, torch.Tensor], None, str | None]:
        """``republish``: the newest snapshot as it is (already packed and cast), pointed
        at or written once more for the actors on this node that keep it."""
        assert self._latest is not None and self._wire_layout is not None
        snapshot_id = (self._delta.latest.id
                       if self._delta is not None and self._delta.latest is not None else None)
        local = self.local
        if local is not None and local_keep:
            if self._latest_in_slot:
                local.point_at_latest(local_keep)
            else:
                local.publish(self._wire_layout.named_views(self._latest), local_keep, version,
                              deadline.remaining())
        return self._latest, None, snapshot_id

    def _pack(self, flat: Mapping[str, torch.Tensor], local_keep: list[int], version: int,
              deadline: Deadline, world_size: int,
              ) -> tuple[dict[str, torch.Tensor], FillChunk | None, str | None]:
        """A new snapshot of ``flat``: written once straight into shared memory when actors
        share this node and nothing is cast or diffed; else packed (and cast) into the wire
        buffers, streamed into the broadcast as it goes out where no actor shares this node,
        and then written into shared memory for those that do. Returns the buffers, the
        chunk filler of a streamed pack, and the delta snapshot id."""
        wire_layout, local = self._wire_layout, self.local
        assert wire_layout is not None
        to_local = local is not None and bool(local.workers)
        if local is not None and to_local and self._delta is None and self.dtype is None:
            local.publish(flat, local_keep, version, deadline.remaining())
            self._latest_in_slot = True
            return local.latest_buffers(), None, None
        self._latest_in_slot = False
        buffers = self._delta.next_buffers() if self._delta is not None else self._wire_buffers()
        fill = None
        if not to_local and world_size > 1 and can_stream(wire_layout, flat):
            fill = streamed_pack(wire_layout, flat, buffers)  # packed (and cast) as it goes out
        else:
            wire_layout.pack(flat, buffers)
        snapshot_id = (self._delta.packed(buffers, version) if self._delta is not None
                       else None)
        if local is not None and to_local:
            local.publish(wire_layout.named_views(buffers), local_keep, version,
                          deadline.remaining())
        return buffers, fill, snapshot_id

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        """Signal every member (``targets`` keep the version, the others only take part in
        the broadcast), then broadcast (unless ``publish`` streamed the snapshot into the
        broadcast already); a failed broadcast is raised by ``wait_acked``."""
        flight = self._flight
        assert flight is not None and flight.version == version
        if not flight.sent:
            self._send(flight, targets, deadline, None)
        return {}

    def _send(self, flight: _Flight, targets: list[int], deadline: Deadline,
              fill: FillChunk | None) -> None:
        members, local = self.members, self.local
        assert members.group is not None and self._wire_layout is not None
        group, version = members.group, flight.version
        flight.sent = True
        flight.keep = {w for w in targets if w not in members.reported}
        remote = group.info.world_size > 1
        checked = remote and self.checksums
        budget = share(deadline, BROADCAST_SHARE)
        delivery = Delivery(group.info.generation, Broadcast(checked),
                            None if budget is None else budget * 0.95)
        flight.delivery = delivery
        streams = self._streams(flight) if remote and self._delta is not None else None
        for w, h in members.members.items():
            if w in members.followers:
                continue  # signalled with its relay's answer
            told = delivery if streams is None or w not in group.info.ranks else replace(
                delivery, plan=streams.get(group.info.ranks[w], DeltaStream(skip=True)))
            told = replace(told, relay=tuple(f for f in members.relays_of(w) if f in flight.keep))
            flight.refs[w] = h._weightsync_receive.remote(
                version, w in flight.keep, local.messages_for(w) if local is not None else None,
                told.to_wire())
        if streams is not None:
            self._stream(flight, {r: s.base for r, s in streams.items()}, budget, fill)
        elif remote:
            wire = bucket_buffers(self._wire_layout, flight.buffers)
            flight.figures.add(WireFigures(sum(b.numel() for b in wire) * (group.info.world_size - 1),
                                           len(_chunks(wire)) * (group.info.world_size - 1)))
            try:
                if checked:  # chunks, each summed as it goes out, then the sums
                    group.send_checked(wire, budget, fill)
                else:
                    group.broadcast(wire, budget, fill)
            except RuntimeError as exc:
                logger.warning("broadcast of version %d failed: %s", version, exc)
                flight.broadcast_error = (str(exc).splitlines()[0] if str(exc)
                                          else type(exc).__name__)
                members.group = None  # broken: rebuilt from the survivors at the next send

    def _streams(self, flight: _Flight) -> dict[int, DeltaStream]:
        """Delta: what each rank that needs the version is streamed (the snapshot and the
        ``base`` its deltas are against, None: whole, logged with the reason); ranks whose
        actor and followers all are left out by ``worker_ids`` get nothing."""
        members, delta = self.members, self._delta
        assert members.group is not None and delta is not None
        streams, first = {}, []
        for w, rank in members.group.info.ranks.items():
            if w in flight.keep or any(f in flight.keep for f in members.relays_of(w)):
                handle = members.members.get(w)
                streams[rank] = DeltaStream(flight.snapshot_id, delta.base_for(w, handle))
                why = delta.why_whole(w, handle)
                if why is None:
                    continue
                delta.count_whole(why[0])
                if why[0] == WHOLE_FIRST:
                    first.append(w)
                else:
                    logger.info("version %d goes whole to worker %d (%s): %s [%s]",
                                flight.version, w, members.where(w), why[1], why[0])
        if first:
            logger.info("version %d goes whole to worker(s) %s: the first version sent, no "
                        "node holds a base yet [%s]", flight.version, first, WHOLE_FIRST)
        return streams

    def _stream(self, flight: _Flight, targets: dict[int, str | None],
                budget: float | None, fill: FillChunk | None = None) -> None:
        """Delta: send the streams (``fill`` packs each chunk first, see ``publish``); a
        failure breaks the group like a failed broadcast."""
        assert self._delta is not None and self.members.group is not None
        try:
            flight.figures.add(self._delta.send(self.members.group, targets, budget, fill))
        except RuntimeError as exc:
            logger.warning("the delta streams of version %d failed: %s", flight.version, exc)
            flight.broadcast_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.members.group = None

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Collect every member's answer; raise naming the dead, the silent, or the failed
        broadcast (the group is then rebuilt at the next send)."""
        flight, self._flight = self._flight, None
        assert flight is not None and flight.version == version
        members = self.members
        answers = members.answers(flight.refs, deadline.remaining())
        if self._delta is not None and flight.snapshot_id is not None:
            answers = self._resend_refused(flight, answers, deadline)
            self._note_bases(flight, answers)
        self.figures[version] = flight.figures.as_dict()
        for old in sorted(self.figures)[:-8]:
            del self.figures[old]
        answers = self._relayed(flight, answers, deadline)
        for w, acked in answers.values.items():
            if w in flight.keep:
                self._versions[w] = int(acked["held"] if isinstance(acked, dict) else acked)
        dead = dict(lost) | answers.dead
        silent = flight.silent | answers.silent
        for w in answers.dead:
            members.drop(w, self.local)
        missed = answers.errors  # answered with an error: alive, but without this version
        if dead or silent or missed or flight.broadcast_error:
            members.group = None  # rebuilt at the next send, without the dead
        members.reported.update(dead, silent)
        for w in silent:
            members.members.pop(w, None)
        what = "; ".join([f"worker {w}: {why}" for w, why in sorted((dead | silent).items())]
                         + [f"worker {w}: {e}" for w, e in sorted(missed.items())])
        if dead:
            raise WorkerLostError(
                f"lost worker(s) {sorted(dead)} while sending version {version}: {what}. The "
                "next send rebuilds the group from the others; a replacement actor joins then "
                "(or at once with add_worker).", worker_ids=list(dead), version=version)
        if silent:
            raise WeightSyncTimeoutError(
                f"worker(s) {sorted(silent)} did not take version {version} within "
                f"{deadline}: {what}. The next send rebuilds the group without them "
                "(a worker that answers again rejoins then).", worker_ids=list(silent))
        if missed or flight.broadcast_error:
            error = flight.broadcast_error
            raise WeightSyncError(
                f"the broadcast of version {version} failed{': ' + error if error else ''}"
                f"{'; ' + what if what else ''}; the group is rebuilt at the next send")

    def _resend_refused(self, flight: _Flight, answers: Answers, deadline: Deadline) -> Answers:
        """Delta: a node whose rebuilt version failed its checksums (it raised
        IntegrityError and kept its base) gets the version whole, at once."""
        members, group, delta = self.members, self.members.group, self._delta
        assert delta is not None
        refused = {w: a["refused"] for w, a in answers.values.items()
                   if isinstance(a, dict) and a.get("refused")}
        if not refused or group is None:
            return answers
        for w, why in sorted(refused.items()):
            logger.warning("worker %d refused the delta of version %d (%s); sending it whole",
                           w, flight.version, why)
        flight.figures.delta_refused += len(refused)
        for _ in refused:
            delta.count_whole(WHOLE_REFUSED)
        refs: dict[int, Any] = {}
        targets: dict[int, str | None] = {}
        assert isinstance(flight.delivery, Delivery)
        for w in refused:
            followers = tuple(f for f in members.relays_of(w) if f in flight.keep)
            whole = replace(flight.delivery, plan=DeltaStream(flight.snapshot_id), relay=followers)
            refs[w] = members.members[w]._weightsync_receive.remote(
                flight.version, w in flight.keep, None, whole.to_wire())
            targets[group.info.ranks[w]] = None
        self._stream(flight, targets, share(deadline, BROADCAST_SHARE))
        more = members.answers(refs, deadline.remaining())
        for w in refused:
            answers.values.pop(w, None)
        answers.values |= more.values
        answers.dead |= more.dead
        answers.silent |= more.silent
        answers.errors |= more.errors
        return answers

    def _note_bases(self, flight: _Flight, answers: Answers) -> None:
        """Delta: the snapshot each streamed node verified (its answer says), else none,
        and why not (the next version goes whole to it, and says so)."""
        delta, members, version = self._delta, self.members, flight.version
        assert delta is not None
        for w in (members.group.info.ranks if members.group is not None else flight.refs):
            answer = answers.values.get(w)
            base = answer.get("base") if isinstance(answer, dict) else None
            if w in answers.dead:
                why = f"its actor died while taking version {version}: {answers.dead[w]}"
            elif w in answers.silent:
                why = f"it did not answer version {version}: {answers.silent[w]}"
            elif w in answers.errors:
                why = f"it failed to take version {version}: {answers.errors[w]}"
            else:
                why = f"its answer to version {version} named no verified version"
            delta.remember(w, members.handles.get(w), base if isinstance(base, str) else None,
                           why)

    def _relayed(self, flight: _Flight, answers: Answers, deadline: Deadline) -> Answers:
        """Signal each follower once its relay answered (with the segments it names), and
        add the followers' answers; a follower whose relay failed did not get the version."""
        members, refs = self.members, {}
        for f, r in members.followers.items():
            answer = answers.values.get(r)
            if isinstance(answer, dict):  # a corrupted version is not relayed: not kept
                keep = f in flight.keep and bool(answer.get("relayed"))
                refs[f] = members.members[f]._weightsync_receive.remote(
                    flight.version, keep, answer["messages"].get(f, []), None)
            else:
                answers.errors[f] = WeightSyncError(
                    f"its node's relay, worker {r}, did not deliver version {flight.version}")
        if refs:
            more = members.answers(refs, deadline.remaining())
            answers.values |= more.values
            answers.dead |= more.dead
            answers.silent |= more.silent
            answers.errors |= more.errors
        return answers

    def whole_versions(self) -> dict[str, int]:
        """Delta: versions sent whole to a node since the start, by reason (see
        ``delta_stream.WHOLE_REASONS``); empty without ``delta``."""
        return {} if self._delta is None else dict(self._delta.whole_versions)

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Nothing more: the actors that took ``version`` answered ``wait_acked``."""

    def held_versions(self) -> dict[int, int]:
        return {w: self._versions.get(w, NO_VERSION) for w in sorted(self.members.connected)}

    def close(self) -> None:
        if self._delta is not None:
            self._delta.close()
        self.members.close()
        if self.local is not None:
            self.local.close()  # actors that mapped its segments keep them until they close
            self.local = None
