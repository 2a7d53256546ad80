"""A sharded trainer writing one directory: every rank writes its own shards straight into
the slot rank 0's plan names (a ``Shard(1)`` piece is one strided copy), summing its share
of each bucket checksum as it goes (:mod:`.partial_sums`), and its done record carries the
shares; rank 0 (:mod:`.sharded_lead`, the usual single writer: ``sender.lock``, the
manifest) adds them up and commits the manifest, so readers see a whole version as from
one writer. The round is the rank protocol's over the file board of :mod:`.ranks`. A failed
attempt replaces its slot file, so a stopped rank that wakes up later writes into an
unlinked file no reader opens. This module holds what every rank writes and the other
ranks' data plane."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.core.checksum import copy_shares
from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, describe_regions, write_pieces
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
from weightsync.transports.ranks.member import MemberWriter
from weightsync.transports.ranks.records import Hello, Plan

logger = logging.getLogger(__name__)


def after_part_written(rank: int, version: int) -> None:
    """Called between writing a rank's pieces and its record; tests replace it (in a rank's
    own process) to stop or kill a rank at exactly that point."""


class RankPart:
    """What one rank writes of one model: its pieces and their regions, and the bucket
    geometry its checksum shares are summed by (kept from ``known`` while the file layout
    holds)."""

    def __init__(self, pieces: list[ShardPiece], layout: Layout, dtype: torch.dtype | None,
                 known: RankPart | None) -> None:
        self.pieces = pieces
        self.regions = describe_regions(self.pieces)
        self.file_layout = file_layout(layout, dtype)
        same = known is not None and known.file_layout.fingerprint == self.file_layout.fingerprint
        self.geometry: BucketGeometry = known.geometry if known is not None and same else \
            BucketGeometry(self.file_layout)

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


class DirectoryPlane:
    """The directory's data plane on trainer rank ``rank >= 1``: writes its shards into the
    slot rank 0's plan names; never takes ``sender.lock`` or writes the manifest."""

    def __init__(self, directory: Path, board: MemberFiles, rank: int,
                 dtype: torch.dtype | None, durable: bool) -> None:
        self.directory, self.board, self.rank = directory, board, rank
        self.dtype, self.durable = dtype, durable
        self._slots: dict[int, SlotFile] = {}
        self._part: RankPart | None = None
        self.owner_pid = os.getpid()

    def start(self, deadline: Deadline) -> int:
        """Join at the newest committed version: this rank's first send is the next one."""
        return latest_committed(self.directory)

    def writer(self, pieces: list[ShardPiece], layout: Layout, deadline: Deadline
               ) -> Callable[[Plan], dict[str, Any]]:
        if os.getpid() != self.owner_pid:
            raise RuntimeError(f"this rank-{self.rank} sender of {self.directory} belongs to "
                               f"process {self.owner_pid}; create a sender in the child instead")
        part = self._part = RankPart(pieces, layout, self.dtype, self._part)

        def write(plan: Plan) -> dict[str, Any]:
            index = plan.detail.get("slot")
            if not isinstance(index, int):
                raise IntegrityError(f"{self.directory}/{PENDING} names no slot for version "
                                     f"{plan.version}")
            t0 = time.perf_counter()
            slot = current_slot(self._slots, slot_path(self.directory, index), index,
                                writable=True, named_by=PENDING)[0]  # reopened if replaced
            shares = part.write(slot)
            if self.durable:
                slot.flush()
            after_part_written(self.rank, plan.version)
            logger.debug("trainer rank %d wrote its part of version %d into slot %d in %.3f s",
                         self.rank, plan.version, index, time.perf_counter() - t0)
            return {"checksums": [str(c) for c in shares]}

        return write

    def failed(self, plan: Plan | None) -> None:
        """Nothing to undo: rank 0 replaces a slot a failed attempt may have written."""

    def close(self, hello: Hello | None) -> None:
        """Unmap the slots and withdraw this rank's hello (rank 0 then waits for a new one)."""
        close_slots(self._slots)
        if os.getpid() == self.owner_pid:
            self.board.withdraw()


def member_writer(directory: Path, *, rank: int, ranks: int, rank_key: str,
                  dtype: torch.dtype | None, durable: bool, mode: int,
                  poll_interval: float) -> MemberWriter:
    """Trainer rank ``rank >= 1`` of a sharded trainer writing ``directory``."""
    if not 1 <= rank < ranks:
        raise ValueError(f"a member writer is rank 1..{ranks - 1}, got {rank}")
    ensure_directory(directory, mode, create=True)
    board = MemberFiles(directory, mode, rank, poll_interval, rank_key)
    return MemberWriter(rank, board, DirectoryPlane(directory, board, rank, dtype, durable),
                        liveness=True, joined_at=latest_committed(directory))


def sum_shares(shares: Sequence[Sequence[int]], buckets: int, who: Sequence[str]) -> list[int]:
    """Every rank's shares added up, after checking each has one share per bucket."""
    for share, name in zip(shares, who, strict=True):
        if len(share) != buckets:
            raise IntegrityError(f"{name} sent {len(share)} checksum shares for {buckets} buckets")
    return combine(shares)
