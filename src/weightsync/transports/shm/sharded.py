"""SharedMem for a sharded trainer: every rank writes its own shards into the slot, at
their global offsets, and a version is committed once all have written; no rank gathers
the model and nothing runs on the trainer's process group.

Rank 0 (:class:`RankZeroWriter`) is the usual SharedMem writer (workers connect to it, it
owns the control block and the slot pool) plus a :class:`~.ranks.RankHub`. For version n it
takes a free slot, asks every rank to write it (``rank.write``), writes its own part,
waits for every ``rank.done`` and only then publishes the slot, whole (a reader never
follows a sharded pack piece by piece); then it tells the ranks ``rank.commit``. A slot
is handed to the ranks before it is sealed against writes (``memfd``), so they map it
writable and workers never can; a rank that joins again gets fresh slots (the old ones are
retired once free). Other ranks (:class:`RankWriter`) answer rank 0 within their own
``send()``: the n-th committed send of every rank is version n.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import SchemaMismatchError, TrainerRankLostError
from weightsync.core.layout import Layout
from weightsync.core.shards import (
    check_cover,
    describe_regions,
    local_pieces,
    write_pieces,
)
from weightsync.core.versions import NO_VERSION
from weightsync.transports.memory.memfd import Segment
from weightsync.transports.shm.endpoints import SharedMemWriter
from weightsync.transports.shm.ranks import RankHub, RankLink
from weightsync.transports.shm.slots import DEFAULT_MODEL_ID, _Slot

logger = logging.getLogger(__name__)

#: rank 0 gives up on the other ranks' answers this much before its own deadline (at most),
#: so that they hear which rank failed before theirs runs out
_FAILURE_MARGIN_S = 1.0


class RankZeroWriter:
    """Rank 0 of a sharded trainer: the SharedMem writer the workers know, plus the ranks."""

    needs_acks = False
    sharded = True
    rank = 0
    joined_at = NO_VERSION

    def __init__(self, address: str, token: str, uid: int, num_workers: int,
                 max_slots: int | None, trainer_ranks: int) -> None:
        self.inner = SharedMemWriter(address, token, uid, num_workers, max_slots)
        self.hub = RankHub(address, token, uid, trainer_ranks)
        self.committed = NO_VERSION
        self._seq = 0
        self._layout: Layout | None = None
        self._regions: dict[int, dict[str, list[int]]] = {}
        #: slot index -> {rank: generation of the connection that mapped it writable}
        self._mapped: dict[int, dict[int, int]] = {}
        self._views: dict[int, dict[str, Any]] = {}  # slot index -> global-shaped views
        self._answers_by = Deadline(10.0)  # the ranks' deadline in the send under way

    def start(self, deadline: Deadline) -> None:
        self.hub.start()
        self.inner.start(deadline)

    # ------------------------------------------------------------------ one version
    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        inner = self.inner
        inner.members.check_hub()
        ranks = sorted(self.hub.wait_all(deadline))
        pieces = local_pieces(flat, 0)
        self._check_layouts(layout, describe_regions(pieces), deadline)
        self._seq += 1
        seq = self._seq
        answers_by = self._answers_by = deadline.ahead(at_most=_FAILURE_MARGIN_S)

        def fill(slot: _Slot) -> None:
            lost = self.hub.tell({"t": "rank.write", "v": version, "slot": slot.index,
                                  "seq": seq})
            if lost:
                rank, why = next(iter(lost.items()))
                raise TrainerRankLostError(f"trainer rank {rank} {why}", rank=rank)
            views = self._views.get(slot.index)
            if views is None:
                views = self._views[slot.index] = layout.tensor_views(slot.buffers)
            write_pieces(pieces, views)
            self.hub.collect("rank.done", seq, ranks, answers_by,
                             f"writing its part of version {version}")

        with inner.members.joining:
            reachable, lost = inner.members.reachable(requested)
            try:
                inner.transport.publish_whole(
                    DEFAULT_MODEL_ID, layout, [w for w, _ in reachable], version, deadline,
                    fill, self._hand_out, self._usable)
            except BaseException as exc:
                self.hub.tell({"t": "rank.failed", "v": version, "seq": seq,
                               "rank": getattr(exc, "rank", 0), "why": str(exc)})
                raise
        self.committed = self.hub.committed = version
        self.hub.tell({"t": "rank.commit", "v": version, "seq": seq})
        return lost

    def _check_layouts(self, layout: Layout, own: dict[str, list[int]], deadline: Deadline) -> None:
        """Every rank registered the same global layout, and together they write each
        element once: checked for each connection before its first version is written."""
        if self._layout is not None and self._layout.fingerprint != layout.fingerprint:
            self._regions.clear()
        self._layout = layout
        self._regions[0] = own
        for rank, header in self.hub.read_layouts(deadline).items():
            try:
                theirs = Layout.from_dict(header.get("layout") or {})
                layout.check_compatible(theirs, self_name="trainer rank 0",
                                        other_name=f"trainer rank {rank}")
            except (SchemaMismatchError, ValueError) as exc:
                self._refuse(rank, exc)
                raise
            self._regions[rank] = dict(header.get("regions") or {})
        try:
            check_cover(layout, self._regions)
        except SchemaMismatchError as exc:
            for rank in list(self.hub.channels):
                self._refuse(rank, exc)
            raise
        self.hub.mark_checked(list(self._regions))

    def _refuse(self, rank: int, exc: Exception) -> None:
        self.hub.tell({"t": "rank.refused", "error": str(exc),
                       "key": getattr(exc, "key", None)}, ranks=[rank])
        self.hub.drop(rank)
        self._regions.pop(rank, None)

    # ------------------------------------------------------------------ slots
    def _hand_out(self, slot: _Slot) -> None:
        """A new slot, still unsealed: every rank maps it writable before anyone seals it."""
        seg = slot.segments["cpu"]
        self._seq += 1
        seq = self._seq
        lost = self.hub.tell({"t": "rank.slot", "index": slot.index, "nbytes": seg.nbytes,
                              "seq": seq}, fds=[seg.fd])
        if lost:
            rank, why = next(iter(lost.items()))
            raise TrainerRankLostError(f"trainer rank {rank} {why}", rank=rank)
        ranks = sorted(self.hub.channels)
        self.hub.collect("rank.mapped", seq, ranks, self._answers_by,
                         f"mapping slot {slot.index}")
        self._mapped[slot.index] = {r: self.hub.generation[r] for r in ranks}
        self._views.pop(slot.index, None)

    def _usable(self, slot: _Slot) -> bool:
        """Mapped writable by every rank's current connection; if not, it is retired (the
        ranks let their mappings go too)."""
        mapped = self._mapped.get(slot.index, {})
        if all(mapped.get(r) == g for r, g in self.hub.generation.items()
               if r in self.hub.channels):
            return True
        self.hub.tell({"t": "rank.retire", "index": slot.index})
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
    """Rank ``rank`` > 0 of a sharded trainer: writes its shards where rank 0 says."""

    needs_acks = False
    sharded = True

    def __init__(self, address: str, token: str, uid: int, rank: int) -> None:
        self.rank = rank
        self.link = RankLink(address, token, uid, rank)
        self.committed = NO_VERSION
        self._layout: Layout | None = None
        self._layout_sent = False
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
        self._layout = layout
        if not self._layout_sent:
            self.link.send({"t": "rank.layout", "layout": layout.to_dict(),
                            "regions": describe_regions(pieces)})
            self._layout_sent = True
        written: int | None = None  # the request this rank answered
        while True:
            message = self.link.recv(deadline, f"version {version}'s commit")
            header, kind = message.header, message.header.get("t")
            if kind == "rank.slot":
                self._map_slot(int(header["index"]), int(header["nbytes"]), message.fds)
                self.link.send({"t": "rank.mapped", "seq": header.get("seq")})
            elif kind == "rank.retire":
                self._views.pop(int(header["index"]), None)
                retired = self._segments.pop(int(header["index"]), None)
                if retired is not None:
                    retired.close()
            elif kind == "rank.write":
                index = int(header["slot"])
                if index not in self._views:
                    raise TrainerRankLostError(f"trainer rank {self.rank}: rank 0 asked for "
                                               f"slot {index}, which it never handed out", rank=0)
                write_pieces(pieces, self._views[index])
                written = int(header["seq"])
                self.link.send({"t": "rank.done", "seq": written})
            elif kind == "rank.commit" and written is not None and header.get("seq") == written:
                self.committed = int(header["v"])
                return {}
            elif kind == "rank.failed" and header.get("seq") == written:
                raise TrainerRankLostError(
                    f"trainer rank {self.rank}: version {header.get('v')} was not committed: "
                    f"{header.get('why')}", rank=int(header.get("rank", 0)))
            elif kind == "rank.refused":
                self.link.close()
                raise SchemaMismatchError(f"trainer rank {self.rank} was refused by rank 0: "
                                          f"{header.get('error')}", key=header.get("key"))

    def _map_slot(self, index: int, nbytes: int, fds: list[int]) -> None:
        if not fds:
            raise TrainerRankLostError(f"trainer rank {self.rank}: slot {index} came without "
                                       "its segment", rank=0)
        old = self._segments.pop(index, None)
        if old is not None:
            old.close()
        seg = self._segments[index] = Segment.attach(fds[0], nbytes, writable=True)
        assert seg.tensor is not None and self._layout is not None
        self._views[index] = self._layout.tensor_views({"cpu": seg.tensor})

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
