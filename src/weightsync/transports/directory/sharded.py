"""A sharded trainer writing one directory: every rank writes its own shards straight into
the slot, rank 0 commits once all have, and no collective runs on the user's process group.

Version ``n`` (the n-th ``send()`` of every rank):

1. Each rank ``r`` announces itself once in ``hello-<r>.json``: a fresh nonce, its pid, its
   global layout and the regions it writes. Rank 0 (the usual single writer: it holds
   ``sender.lock`` and owns the manifest) checks every hello against its own layout and runs
   :func:`~weightsync.core.shards.check_cover` before any byte is written; a disagreement
   fails the version naming rank and key.
2. Rank 0 takes a free slot as today (exclusive lock, so no reader reads it meanwhile) and
   writes ``pending.json``: version ``n``, the slot, a fresh attempt id, the nonces it checked.
3. Each rank waits (within its deadline) for a pending record of version ``>= n`` naming its
   nonce, maps the slot writable, copies its pieces to their global offsets (a ``Shard(1)``
   piece is one strided copy), sums its share of each bucket checksum as it goes
   (:mod:`.partial_sums`), then writes ``rank-<r>.json`` naming the attempt and its shares.
4. Rank 0 waits for every record of that attempt, adds the shares up to the bucket
   checksums and commits the manifest: readers see a whole version, as from one writer.
   The other ranks return once the manifest names version ``n``.

A rank that dies (its pid, judged in our pid namespace), restarts (a new nonce), closes (its
hello is gone) or stays silent past rank 0's deadline fails the attempt: rank 0 writes the
failure into ``pending.json``, every rank's ``send()`` raises
:class:`~weightsync.core.errors.TrainerRankLostError` naming it, readers keep the last
committed version, and rank 0 replaces the slot file, so a stopped rank that wakes up later
writes into an unlinked file no reader opens. A restarted rank joins the version after the
newest committed one (``joined_at``). This module holds what every rank does and the other
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

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    TrainerRankLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, describe_regions, local_pieces, write_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.directory.files import ensure_directory
from weightsync.transports.directory.manifest import (
    ManifestCache,
    SlotFile,
    close_slots,
    file_layout,
    read_manifest,
    sender_alive,
    slot_path,
)
from weightsync.transports.directory.partial_sums import BucketGeometry, combine, region_sums
from weightsync.transports.directory.ranks import (
    SCHEMA,
    ControlFiles,
    Failure,
    Hello,
    Pending,
    RankDone,
    hello_path,
    make_hello,
    rank_path,
)
from weightsync.transports.directory.slots import current_slot
from weightsync.transports.directory.writer import wait_for_acks

logger = logging.getLogger(__name__)


def check_rank(rank: int, ranks: int) -> int:
    """``rank`` if it is an int in ``0..ranks-1``; a ValueError saying so otherwise."""
    if type(rank) is not int or not 0 <= rank < ranks:
        raise ValueError(f"rank must be an int in 0..{ranks - 1} (trainer_ranks={ranks}), "
                         f"got {rank!r}")
    return rank


def after_part_written(rank: int, version: int) -> None:
    """Called between writing a rank's pieces and its record; tests replace it (in a rank's
    own process) to stop or kill a rank at exactly that point."""


def failure_error(failure: Failure, version: int) -> WeightSyncError:
    """The exception every rank raises for a failed attempt of ``version``."""
    message = f"version {version} was not committed: {failure.message}"
    if failure.kind == SCHEMA:
        return SchemaMismatchError(message)
    return TrainerRankLostError(message, rank=failure.rank)


class RankPart:
    """What one rank writes of one model: its pieces, their regions, its hello."""

    def __init__(self, rank: int, flat: Mapping[str, Any], layout: Layout, dtype: torch.dtype | None,
                 known: RankPart | None) -> None:
        self.pieces: list[ShardPiece] = local_pieces(flat, rank)
        self.regions = describe_regions(self.pieces)
        self.file_layout = file_layout(layout, dtype)
        same = known is not None and known.hello.fingerprint == layout.fingerprint \
            and known.regions == self.regions
        self.hello: Hello = known.hello if known is not None and same else make_hello(
            rank, layout.to_dict(), layout.fingerprint, self.regions)
        self.geometry: BucketGeometry = known.geometry if known is not None and same else \
            BucketGeometry(self.file_layout)
        self.changed = not same

    def write(self, slot: SlotFile) -> list[int]:
        """Copy the pieces into ``slot``; returns this rank's checksum share per bucket."""
        if slot.layout.fingerprint != self.file_layout.fingerprint:
            raise IntegrityError(f"{slot.path} holds another layout than this rank's model")
        views = slot.layout.tensor_views(slot.buffers)
        shares = [0] * len(slot.layout.buckets)
        for piece in self.pieces:  # summed right after writing, while still in cache
            write_pieces([piece], views)
            share = region_sums(self.geometry, slot.data, [(piece.name, piece.region)])
            shares = [(a + b) & 0xFFFFFFFFFFFFFFFF for a, b in zip(shares, share, strict=True)]
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
    0 names, then its record; never takes ``sender.lock`` or writes the manifest."""

    sharded = True
    needs_acks = True

    def __init__(self, directory: Path, num_workers: int, *, rank: int, ranks: int,
                 dtype: torch.dtype | None, durable: bool, mode: int, poll_interval: float) -> None:
        if not 1 <= rank < ranks:
            raise ValueError(f"a member writer is rank 1..{ranks - 1}, got {rank}")
        ensure_directory(directory, mode, create=True)
        self.directory, self.num_workers, self.rank, self.ranks = directory, num_workers, rank, ranks
        self.dtype, self.durable, self.poll_interval = dtype, durable, poll_interval
        self.files = ControlFiles(directory, mode)
        self._manifests = ManifestCache(directory)
        self.recovered_version = self.joined_at = self.published = latest_committed(directory)
        self.committed = NO_VERSION
        self.held: dict[int, int] = {}
        self._slots: dict[int, SlotFile] = {}
        self._part: RankPart | None = None
        self._raised: set[str] = set()  # failed attempts already raised here
        self._rank0_seen = False
        self.owner_pid = os.getpid()

    # ------------------------------------------------------------------ as the scheme's writer
    def start(self, deadline: Deadline) -> None:
        """Join at the newest committed version: this rank's first send is the next one."""
        self.recovered_version = self.joined_at = latest_committed(self.directory)

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Write this rank's part of ``version`` (or of a newer one rank 0 moved on to) and
        return once rank 0 committed it; ``committed`` says which."""
        if os.getpid() != self.owner_pid:
            raise RuntimeError(f"this rank-{self.rank} sender of {self.directory} belongs to "
                               f"process {self.owner_pid}; create a sender in the child instead")
        part = RankPart(self.rank, flat, layout, self.dtype, self._part)
        if part.changed:
            self.files.write(hello_path(self.directory, self.rank), part.hello)
            logger.info("trainer rank %d announced itself in %s (nonce %s)", self.rank,
                        self.directory, part.hello.nonce)
        self._part = part
        pending = self._wait_pending(part.hello.nonce, version, deadline)
        t0 = time.perf_counter()
        shares = part.write(self._slot(pending.slot))
        if self.durable:
            self._slots[pending.slot].flush()
        after_part_written(self.rank, pending.version)
        self.files.write(rank_path(self.directory, self.rank), RankDone(
            self.rank, part.hello.nonce, pending.version, pending.attempt, tuple(shares)))
        logger.debug("trainer rank %d wrote its part of version %d into slot %d in %.3f s",
                     self.rank, pending.version, pending.slot, time.perf_counter() - t0)
        self._wait_commit(pending, deadline)
        self.committed = self.published = pending.version
        return {}

    def _wait_pending(self, nonce: str, version: int, deadline: Deadline) -> Pending:
        """Rank 0's record of ``version`` (or newer) naming this rank's incarnation. A
        version already committed is never written again (this rank gave up on it, its
        deadline passed, and rank 0 committed it after all): the next one is."""
        while True:
            manifest = self._manifests.read()
            if manifest is not None and manifest.latest.version >= version:
                version = manifest.latest.version + 1
            pending = self.files.pending()
            if pending is not None and pending.nonces.get(self.rank) == nonce \
                    and pending.version >= version and pending.attempt not in self._raised:
                if pending.failed:
                    assert pending.failure is not None
                    self._raised.add(pending.attempt)
                    raise failure_error(pending.failure, pending.version)
                return pending
            self._check_rank0()
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"trainer rank {self.rank}: trainer rank 0 did not start version {version} "
                    f"in {self.directory} within {deadline}"
                    + ("" if self._rank0_seen else " (no rank 0 holds its sender.lock)"))
            time.sleep(deadline.slice(self.poll_interval))

    def _wait_commit(self, pending: Pending, deadline: Deadline) -> None:
        while True:
            manifest = self._manifests.read()
            if manifest is not None and manifest.latest.version >= pending.version:
                return
            now = self.files.pending()
            if now is None or now.attempt != pending.attempt or now.failed:
                failure = now.failure if now is not None else None
                if failure is not None and failure.attempt == pending.attempt:
                    self._raised.add(pending.attempt)
                    raise failure_error(failure, pending.version)
                manifest = self._manifests.read()
                if manifest is not None and manifest.latest.version >= pending.version:
                    return
                raise TrainerRankLostError(
                    f"trainer rank 0 abandoned version {pending.version} (attempt "
                    f"{pending.attempt}) without committing it", rank=0)
            try:
                self._check_rank0()
            except TrainerRankLostError:  # rank 0 may have committed it just before leaving
                manifest = self._manifests.read()
                if manifest is not None and manifest.latest.version >= pending.version:
                    return
                raise
            if deadline.expired():
                missing = [r for r in range(1, self.ranks) if (done := self.files.done(r)) is None
                           or done.attempt != pending.attempt]
                if missing:
                    raise TrainerRankLostError(
                        f"trainer rank {self.rank}: version {pending.version} was not committed "
                        f"within {deadline}: trainer rank(s) {missing} did not write their part",
                        rank=missing[0])
                raise WeightSyncTimeoutError(
                    f"trainer rank {self.rank}: trainer rank 0 did not commit version "
                    f"{pending.version} within {deadline} (every other rank wrote its part)")
            time.sleep(deadline.slice(self.poll_interval))

    def _check_rank0(self) -> None:
        if sender_alive(self.directory):
            self._rank0_seen = True
        elif self._rank0_seen:
            raise TrainerRankLostError(
                f"trainer rank {self.rank}: trainer rank 0 released {self.directory}/sender.lock "
                "(it died or closed); the last committed version stays", rank=0)

    def _slot(self, index: int) -> SlotFile:
        """Slot ``index`` mapped writable, reopened if rank 0 replaced the file since."""
        return current_slot(self._slots, slot_path(self.directory, index), index,
                            writable=True, named_by="pending.json")[0]

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
        if self._part is not None and os.getpid() == self.owner_pid:
            try:
                hello = self.files.hello(self.rank)
            except IntegrityError:
                return
            if hello is not None and hello.nonce == self._part.hello.nonce:
                self.files.remove(hello_path(self.directory, self.rank))


def sum_shares(shares: Sequence[Sequence[int]], buckets: int, who: Sequence[str]) -> list[int]:
    """Every rank's shares added up, after checking each has one share per bucket."""
    for share, name in zip(shares, who, strict=True):
        if len(share) != buckets:
            raise IntegrityError(f"{name} sent {len(share)} checksum shares for {buckets} buckets")
    return combine(shares)
