"""A sharded trainer writing one directory: every rank writes its own shards straight into
the slot, rank 0 commits once all have, and no collective runs on the user's process group.

The coordination is the rank protocol (:mod:`weightsync.transports.ranks`) over the file
board of :mod:`.ranks`; what is the directory's is the data plane. Version ``n`` (the n-th
committed ``send()`` of every rank):

1. Each rank ``r`` announces itself in ``hello-<r>.json`` (a new incarnation per process and
   per model). Rank 0 (the usual single writer: it holds ``sender.lock`` and owns the
   manifest) checks every hello against its own layout and the cover before any byte is
   written; a disagreement fails the version naming rank and key.
2. Rank 0 takes a free slot as today (exclusive lock, so no reader reads it meanwhile) and
   posts the plan in ``pending.json``: version ``n``, the slot, a fresh attempt id, the
   incarnations it checked.
3. Each rank maps the slot writable, copies its pieces to their global offsets (a
   ``Shard(1)`` piece is one strided copy), sums its share of each bucket checksum as it
   goes (:mod:`.partial_sums`), then writes ``rank-<r>.json`` naming the attempt and its
   shares.
4. Rank 0 adds the shares up to the bucket checksums and commits the manifest: readers see
   a whole version, as from one writer. The other ranks return once the outcome says so.

A failed attempt replaces its slot file, so a stopped rank that wakes up later writes into
an unlinked file no reader opens. This module holds what every rank writes and the other
ranks' writer; rank 0's is in :mod:`.sharded_lead`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.core.checksum import copy_shares
from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, describe_regions, local_pieces, write_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.directory.files import ensure_directory
from weightsync.transports.directory.manifest import (
    SlotFile,
    close_slots,
    file_layout,
    read_manifest,
    slot_path,
)
from weightsync.transports.directory.partial_sums import BucketGeometry, combine, region_sums
from weightsync.transports.directory.ranks import PENDING, MemberFiles
from weightsync.transports.directory.slots import current_slot
from weightsync.transports.directory.writer import wait_for_acks
from weightsync.transports.ranks.liveness import process_detail
from weightsync.transports.ranks.member import RankMember
from weightsync.transports.ranks.records import Hello, Plan, new_id

logger = logging.getLogger(__name__)


def after_part_written(rank: int, version: int) -> None:
    """Called between writing a rank's pieces and its record; tests replace it (in a rank's
    own process) to stop or kill a rank at exactly that point."""


class RankPart:
    """What one rank writes of one model: its pieces, their regions, its hello."""

    def __init__(self, rank: int, flat: Mapping[str, Any], layout: Layout, dtype: torch.dtype | None,
                 known: RankPart | None) -> None:
        self.pieces: list[ShardPiece] = local_pieces(flat, rank)
        self.regions = describe_regions(self.pieces)
        self.file_layout = file_layout(layout, dtype)
        same = known is not None and known.hello.fingerprint == layout.fingerprint \
            and known.regions == self.regions
        self.hello: Hello = known.hello if known is not None and same else Hello(
            rank, new_id(), layout.to_dict(), layout.fingerprint, self.regions, process_detail())
        self.geometry: BucketGeometry = known.geometry if known is not None and same else \
            BucketGeometry(self.file_layout)
        self.changed = not same

    def write(self, slot: SlotFile) -> list[int]:
        """Copy the pieces into ``slot``; returns this rank's checksum share per bucket."""
        if slot.layout.fingerprint != self.file_layout.fingerprint:
            raise IntegrityError(f"{slot.path} holds another layout than this rank's model")
        views = slot.layout.tensor_views(slot.buffers)
        shares = [0] * len(slot.layout.buckets)
        whole_rows, owners = [], []
        for piece in self.pieces:
            target = views[piece.name][tuple(slice(lo, hi) for lo, hi in piece.region)]
            if target.is_contiguous():  # one byte range of its bucket: copied and summed at once
                index = self.geometry.bucket_of[piece.name]
                start = int(target.storage_offset()) * target.element_size() \
                    - int(slot.data.storage_offset()) - slot.layout.buckets[index].byte_offset
                whole_rows.append((piece.local.detach(), target, start))
                owners.append(index)
                continue
            write_pieces([piece], views)  # a column block: summed right after, while in cache
            share = region_sums(self.geometry, slot.data, [(piece.name, piece.region)])
            shares = [(a + b) & 0xFFFFFFFFFFFFFFFF for a, b in zip(shares, share, strict=True)]
        for index, value in zip(owners, copy_shares(whole_rows), strict=True):
            shares[index] = (shares[index] + value) & 0xFFFFFFFFFFFFFFFF
        return shares


def latest_committed(directory: Path) -> int:
    """The newest version the manifest of ``directory`` names (-1 if none or unreadable)."""
    try:
        manifest = read_manifest(directory)
    except IntegrityError:
        return NO_VERSION
    return NO_VERSION if manifest is None else manifest.latest.version


class ShardedMemberWriter:
    """Trainer rank ``rank >= 1`` of a sharded trainer: writes its shards into the slot rank
    0's plan names, then its done record; never takes ``sender.lock`` or writes the
    manifest."""

    sharded = True
    needs_acks = True

    def __init__(self, directory: Path, num_workers: int, *, rank: int, ranks: int,
                 rank_key: str, dtype: torch.dtype | None, durable: bool, mode: int,
                 poll_interval: float) -> None:
        if not 1 <= rank < ranks:
            raise ValueError(f"a member writer is rank 1..{ranks - 1}, got {rank}")
        ensure_directory(directory, mode, create=True)
        self.directory, self.num_workers, self.rank, self.ranks = directory, num_workers, rank, ranks
        self.dtype, self.durable, self.poll_interval = dtype, durable, poll_interval
        self.board = MemberFiles(directory, mode, rank, poll_interval, rank_key)
        self.member = RankMember(self.board, rank)
        self.recovered_version = self.joined_at = self.published = latest_committed(directory)
        self.committed = NO_VERSION
        self.held: dict[int, int] = {}
        self._slots: dict[int, SlotFile] = {}
        self._part: RankPart | None = None
        self.owner_pid = os.getpid()

    # ------------------------------------------------------------------ as the scheme's writer
    def start(self, deadline: Deadline) -> None:
        """Join at the newest committed version: this rank's first send is the next one."""
        self.recovered_version = self.joined_at = latest_committed(self.directory)

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Write this rank's part of the next attempt rank 0 plans for it and return once
        rank 0 committed it; ``committed`` says which version that was."""
        if os.getpid() != self.owner_pid:
            raise RuntimeError(f"this rank-{self.rank} sender of {self.directory} belongs to "
                               f"process {self.owner_pid}; create a sender in the child instead")
        part = self._part = RankPart(self.rank, flat, layout, self.dtype, self._part)
        self.member.announce(part.hello)

        def write(plan: Plan) -> dict[str, Any]:
            index = plan.detail.get("slot")
            if not isinstance(index, int):
                raise IntegrityError(f"{self.directory}/{PENDING} names no slot for version "
                                     f"{plan.version}")
            t0 = time.perf_counter()
            slot = self._slot(index)
            shares = part.write(slot)
            if self.durable:
                slot.flush()
            after_part_written(self.rank, plan.version)
            logger.debug("trainer rank %d wrote its part of version %d into slot %d in %.3f s",
                         self.rank, plan.version, index, time.perf_counter() - t0)
            return {"checksums": [str(c) for c in shares]}

        self.committed = self.published = self.member.take_part(write, version, deadline)
        return {}

    def _slot(self, index: int) -> SlotFile:
        """Slot ``index`` mapped writable, reopened if rank 0 replaced the file since."""
        return current_slot(self._slots, slot_path(self.directory, index), index,
                            writable=True, named_by=PENDING)[0]

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        return {}

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: dict[int, str]) -> None:
        wait_for_acks(self.directory, version, targets, deadline, self.held,
                      recovered_version=self.recovered_version, poll_interval=self.poll_interval)

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.wait_acked(list(range(self.num_workers)), version, deadline, {})

    def held_versions(self) -> dict[int, int]:
        return dict(self.held)

    def close(self) -> None:
        """Unmap the slots and withdraw this rank's hello (rank 0 then waits for a new one)."""
        close_slots(self._slots)
        if os.getpid() == self.owner_pid:
            self.board.withdraw()


def sum_shares(shares: Sequence[Sequence[int]], buckets: int, who: Sequence[str]) -> list[int]:
    """Every rank's shares added up, after checking each has one share per bucket."""
    for share, name in zip(shares, who, strict=True):
        if len(share) != buckets:
            raise IntegrityError(f"{name} sent {len(share)} checksum shares for {buckets} buckets")
    return combine(shares)
