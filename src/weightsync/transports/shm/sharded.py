"""SharedMem for a sharded trainer: every rank writes its own shards into the slot, at
their global offsets, and a version is committed once all have written; no rank gathers
the model and nothing runs on the trainer's process group.

The coordination is the rank protocol (:mod:`weightsync.transports.ranks`) over its socket
board, with SharedMem's slot messages (:mod:`.ranks`); what is SharedMem's is the data plane. Rank 0
(:class:`RankZeroWriter`) is the usual SharedMem writer (workers connect to it, it owns the
control block and the slot pool): for version n it meets the ranks, takes a free slot, posts
the plan naming it, writes its own part, waits for every rank's done and only then
publishes the slot, whole (a reader never follows a sharded pack piece by piece). A slot is
handed to the ranks before it is sealed against writes (``memfd``), so they map it writable
and workers never can; a rank that joins again gets fresh slots (the old ones are retired
once free). Other ranks (:class:`RankWriter`) write where the plan says, within their own
``send()``: the n-th committed send of every rank is version n.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import TrainerRankLostError
from weightsync.core.layout import Layout
from weightsync.core.shards import describe_regions, local_pieces, write_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.memory.memfd import Segment
from weightsync.transports.ranks.lead import RankLead
from weightsync.transports.ranks.member import RankMember
from weightsync.transports.ranks.records import Hello, Plan, new_id
from weightsync.transports.shm.endpoints import SharedMemWriter
from weightsync.transports.shm.ranks import SlotHub, SlotLink
from weightsync.transports.shm.slots import DEFAULT_MODEL_ID, _Slot

logger = logging.getLogger(__name__)


class RankZeroWriter:
    """Rank 0 of a sharded trainer: the SharedMem writer the workers know, plus the ranks."""

    needs_acks = False
    sharded = True
    rank = 0
    joined_at = NO_VERSION

    def __init__(self, address: str, token: str, rank_key: str, uid: int, num_workers: int,
                 max_slots: int | None, trainer_ranks: int) -> None:
        self.inner = SharedMemWriter(address, token, uid, num_workers, max_slots)
        self.hub = SlotHub(address, rank_key, uid, trainer_ranks)
        self.lead = RankLead(self.hub, trainer_ranks)
        self.committed = NO_VERSION
        #: slot index -> {rank: the connection that mapped it writable}
        self._mapped: dict[int, dict[int, int]] = {}
        self._views: dict[int, dict[str, Any]] = {}  # slot index -> global-shaped views
        self._answers_by = Deadline(10.0)  # the ranks' deadline in the send under way

    def start(self, deadline: Deadline) -> None:
        self.hub.start()
        self.inner.start(deadline)

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        inner, lead = self.inner, self.lead
        inner.members.check_hub()
        pieces = local_pieces(flat, 0)
        self._answers_by = deadline.ahead()

        def fill(slot: _Slot) -> None:
            plan = lead.begin(version, {"slot": slot.index})
            views = self._views.get(slot.index)
            if views is None:
                views = self._views[slot.index] = layout.tensor_views(slot.buffers)
            write_pieces(pieces, views)
            lead.wait_done(plan, deadline)

        try:
            lead.meet(layout, describe_regions(pieces), version, deadline)
            with inner.members.joining:
                reachable, lost = inner.members.reachable(requested)
                inner.slots.publish_whole(
                    DEFAULT_MODEL_ID, layout, [w for w, _ in reachable], version, deadline,
                    fill, self._hand_out, self._usable)
        except BaseException as exc:
            lead.fail(version, exc)
            raise
        lead.commit()
        self.committed = version
        return lost

    # ------------------------------------------------------------------ slots
    def _hand_out(self, slot: _Slot) -> None:
        """A new slot, still unsealed: every rank maps it writable before anyone seals it."""
        seg = slot.segments["cpu"]
        self._mapped[slot.index] = self.hub.hand_out(slot.index, seg.fd, seg.nbytes,
                                                     self._answers_by)
        self._views.pop(slot.index, None)

    def _usable(self, slot: _Slot) -> bool:
        """Mapped writable by every rank's current connection; if not, it is retired (the
        ranks let their mappings go too)."""
        mapped = self._mapped.get(slot.index, {})
        if all(mapped.get(r) == serial for r, serial in self.hub.serials().items()):
            return True
        self.hub.retire(slot.index)
        self._mapped.pop(slot.index, None)
        self._views.pop(slot.index, None)
        return False

    # ------------------------------------------------------------------ the rest as SharedMem
    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        return self.inner.deliver(targets, version, deadline)

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Nothing to wait for: publishing is delivery."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.inner.wait_joined(version, deadline)

    def held_versions(self) -> dict[int, int]:
        return self.inner.held_versions()

    def close(self) -> None:
        self.hub.close()
        self.inner.close()


class RankWriter:
    """Rank ``rank`` > 0 of a sharded trainer: writes its shards where rank 0's plan says."""

    needs_acks = False
    sharded = True

    def __init__(self, address: str, rank_key: str, uid: int, rank: int) -> None:
        self.rank = rank
        self.link = SlotLink(address, rank_key, uid, rank, self._map_slot, self._retire)
        self.member = RankMember(self.link, rank)
        self.committed = NO_VERSION
        self._layout: Layout | None = None
        self._segments: dict[int, Segment] = {}
        self._views: dict[int, dict[str, Any]] = {}

    @property
    def joined_at(self) -> int:
        return self.link.joined_at

    def start(self, deadline: Deadline) -> None:
        self.link.open(deadline)

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        pieces = local_pieces(flat, self.rank)
        regions = describe_regions(pieces)
        if self._layout is None or self._layout.fingerprint != layout.fingerprint:
            self._views.clear()  # slots mapped for another layout: views made anew
        self._layout = layout
        known = self.member.hello
        if known is None or known.fingerprint != layout.fingerprint or known.regions != regions:
            self.member.announce(Hello(self.rank, new_id(), layout.to_dict(), layout.fingerprint,
                                       regions))

        def write(plan: Plan) -> dict[str, Any]:
            index = plan.detail.get("slot")
            views = self._slot_views(index) if isinstance(index, int) else None
            if views is None:
                raise TrainerRankLostError(f"trainer rank {self.rank}: rank 0 planned slot "
                                           f"{index!r}, which it never handed out", rank=0)
            write_pieces(pieces, views)
            return {}

        self.committed = self.member.take_part(write, version, deadline)
        return {}

    def _slot_views(self, index: int) -> dict[str, Any] | None:
        views = self._views.get(index)
        seg = self._segments.get(index)
        if views is None and seg is not None and seg.tensor is not None \
                and self._layout is not None:
            views = self._views[index] = self._layout.tensor_views({"cpu": seg.tensor})
        return views

    def _map_slot(self, index: int, nbytes: int, fds: list[int]) -> None:
        if not fds:
            raise TrainerRankLostError(f"trainer rank {self.rank}: slot {index} came without "
                                       "its segment", rank=0)
        self._retire(index)
        self._segments[index] = Segment.attach(fds[0], nbytes, writable=True)

    def _retire(self, index: int) -> None:
        self._views.pop(index, None)
        old = self._segments.pop(index, None)
        if old is not None:
            old.close()

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        return {}

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Rank 0 confirms the version to the workers."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Rank 0's ``connect()`` waits for the workers; this rank's ends at the commit."""

    def held_versions(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        self.link.close()
        self._views.clear()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
