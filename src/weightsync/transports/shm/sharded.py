"""SharedMem for a sharded trainer: every rank writes its own shards into the slot, at
their global offsets; no rank gathers the model and nothing runs on the trainer's process
group. The round is the rank protocol's (:mod:`weightsync.transports.ranks`) over its
socket board; SharedMem supplies the slots. Rank 0 (:class:`RankZeroWriter`) is the usual
SharedMem writer the workers know: the slot it takes is named in the plan, and it publishes
the slot whole once every rank is done. A slot is handed to the ranks before it is sealed
against writes (``memfd``), so they map it writable and workers never can; a rank that joins
again gets fresh slots (the old ones are retired once free). Other ranks
(:func:`rank_writer`) write where the plan says."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import TrainerRankLostError
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, describe_regions, local_pieces, write_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.memory.memfd import Segment
from weightsync.transports.ranks.lead import LeadRound, RankLead
from weightsync.transports.ranks.member import MemberWriter
from weightsync.transports.ranks.records import Hello, Plan
from weightsync.transports.shm.endpoints import SharedMemWriter
from weightsync.transports.shm.ranks import SlotHub, slot_link
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
        self.slots = SlotHub(address, rank_key, uid, trainer_ranks)
        self.hub = self.slots.board
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
        inner = self.inner
        inner.members.check_hub()
        pieces = local_pieces(flat, 0)
        self._answers_by = deadline.ahead()

        def body(round_: LeadRound) -> Losses:
            def fill(slot: _Slot) -> None:  # the slot chosen: the plan names it
                round_.write({"slot": slot.index},
                             lambda plan: write_pieces(pieces, self._slot_views(slot, layout)))

            with inner.members.joining:
                reachable, lost = inner.members.reachable(requested)
                inner.slots.publish_whole(
                    DEFAULT_MODEL_ID, layout, [w for w, _ in reachable], version, deadline,
                    fill, self._hand_out, self._usable)
            return lost

        lost = self.lead.run(version, deadline, lambda: (layout, describe_regions(pieces)), body)
        self.committed = version
        return lost

    def _slot_views(self, slot: _Slot, layout: Layout) -> dict[str, Any]:
        views = self._views.get(slot.index)
        if views is None:
            views = self._views[slot.index] = layout.tensor_views(slot.buffers)
        return views

    # ------------------------------------------------------------------ slots
    def _hand_out(self, slot: _Slot) -> None:
        """A new slot, still unsealed: every rank maps it writable before anyone seals it."""
        seg = slot.segments["cpu"]
        self._mapped[slot.index] = self.slots.hand_out(slot.index, seg.fd, seg.nbytes,
                                                     self._answers_by)
        self._views.pop(slot.index, None)

    def _usable(self, slot: _Slot) -> bool:
        """Mapped writable by every rank's current connection; if not, it is retired (the
        ranks let their mappings go too)."""
        mapped = self._mapped.get(slot.index, {})
        if all(mapped.get(r) == serial for r, serial in self.slots.serials().items()):
            return True
        self.slots.retire(slot.index)
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


class SlotPlane:
    """SharedMem's data plane on rank ``rank`` > 0: the slots rank 0 hands out, mapped
    writable as they come; a send writes its shards where the plan says."""

    def __init__(self, address: str, rank_key: str, uid: int, rank: int) -> None:
        self.rank = rank
        self.link = slot_link(address, rank_key, uid, rank, self._map_slot, self._retire)
        self._layout: Layout | None = None
        self._segments: dict[int, Segment] = {}
        self._views: dict[int, dict[str, Any]] = {}

    def start(self, deadline: Deadline) -> int:
        self.link.open(deadline)
        return self.link.joined_at

    def writer(self, pieces: list[ShardPiece], layout: Layout, deadline: Deadline
               ) -> Callable[[Plan], dict[str, Any]]:
        if self._layout is None or self._layout.fingerprint != layout.fingerprint:
            self._views.clear()  # slots mapped for another layout: views made anew
        self._layout = layout

        def write(plan: Plan) -> dict[str, Any]:
            index = plan.detail.get("slot")
            views = self._slot_views(index) if isinstance(index, int) else None
            if views is None:
                raise TrainerRankLostError(f"trainer rank {self.rank}: rank 0 planned slot "
                                           f"{index!r}, which it never handed out", rank=0)
            write_pieces(pieces, views)
            return {}

        return write

    def failed(self, plan: Plan | None) -> None:
        """Nothing to undo: rank 0 retires slots a failed rank may still write into."""

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

    def close(self, hello: Hello | None) -> None:
        self.link.close()
        self._views.clear()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


def rank_writer(address: str, rank_key: str, uid: int, rank: int) -> MemberWriter:
    """Rank ``rank`` > 0 of a sharded trainer on SharedMem: writes its shards where rank
    0's plan says."""
    plane = SlotPlane(address, rank_key, uid, rank)
    return MemberWriter(rank, plane.link, plane)
