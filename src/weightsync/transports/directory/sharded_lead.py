"""Rank 0 of a sharded trainer writing a directory: the single writer (sender lock, slot
pool, manifest) whose round is :meth:`~weightsync.transports.ranks.lead.RankLead.run` over
the file board: the plan names the slot it took, and the manifest is committed with the
checksums the ranks' shares add up to (:mod:`.sharded`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.shards import local_pieces
from weightsync.core.versions import NO_VERSION
from weightsync.transports.directory import sharded
from weightsync.transports.directory.manifest import SlotFile, slot_path
from weightsync.transports.directory.ranks import LeadFiles
from weightsync.transports.directory.sharded import RankPart, sum_shares
from weightsync.transports.directory.writer import DirectoryWriter, Published
from weightsync.transports.ranks.lead import LeadRound, RankLead
from weightsync.transports.ranks.records import Plan

logger = logging.getLogger(__name__)


def _shares(detail: dict[str, Any], rank: int) -> list[int]:
    raw = detail.get("checksums")
    if not isinstance(raw, list) or not all(isinstance(s, str) and s.isdigit() for s in raw):
        raise IntegrityError(f"trainer rank {rank}'s done record: checksums must be a list of "
                             "digit strings")
    return [int(s) for s in raw]


class DirectoryLeadWriter(DirectoryWriter):
    """Trainer rank 0 of ``ranks``: a :class:`DirectoryWriter` whose slots every rank fills."""

    sharded = True

    def __init__(self, directory: Path, num_workers: int, *, ranks: int, rank_key: str,
                 dtype: torch.dtype | None, durable: bool, mode: int, poll_interval: float) -> None:
        super().__init__(directory, num_workers, dtype=dtype, durable=durable, mode=mode,
                         poll_interval=poll_interval)
        self.ranks = ranks
        self.lead = RankLead(LeadFiles(directory, mode, ranks, poll_interval, rank_key), ranks)
        self.joined_at = self.published
        self.committed = NO_VERSION
        self._part: RankPart | None = None
        self._round: LeadRound | None = None  # the round under way
        self._written: int | None = None  # a slot the other ranks may have written into

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Meet the ranks, then write and commit ``version`` with them."""
        part = self._part = RankPart(local_pieces(flat, 0), layout, self.dtype, self._part)

        def body(round_: LeadRound) -> Published:
            self._round = round_
            try:
                return self.commit(flat, layout, requested,
                                   len(requested) == self.num_workers, deadline)
            except BaseException:
                if self._written is not None:
                    self._replace_slot(self._written)
                raise
            finally:
                self._round = None

        done = self.lead.run(version, deadline, lambda: (layout, part.regions), body)
        self.committed = done.version
        logger.debug("version %d committed by %d trainer ranks (%s)", done.version, self.ranks,
                     {k: round(v, 4) for k, v in done.phases.items()})
        return {}

    def _fill(self, index: int, slot: SlotFile, weights: Mapping[str, torch.Tensor],
              deadline: Deadline) -> list[int]:
        """Post the plan naming the slot, write rank 0's part and wait for the others';
        returns the bucket checksums their shares add up to."""
        part, round_ = self._part, self._round
        assert part is not None and round_ is not None
        self._written = index

        def own(plan: Plan) -> list[int]:
            shares = part.write(slot)
            sharded.after_part_written(0, plan.version)  # a test hook
            return shares

        shares, dones = round_.write({"slot": index}, own)
        ranks = sorted(dones)
        checksums = sum_shares([shares] + [_shares(dones[r].detail, r) for r in ranks],
                               len(slot.layout.buckets),
                               ["trainer rank 0", *(f"trainer rank {r}" for r in ranks)])
        self._written = None
        return checksums

    def _replace_slot(self, index: int) -> None:
        """Give slot ``index`` a new file: a rank still writing into the old one (stopped,
        slow) writes into an unlinked file no reader will open."""
        self._written = None
        old = self._slots.pop(index, None)
        if old is not None:
            old.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot_path(self.directory, index))
        assert self._layout is not None
        self._slots[index] = self._open_or_create(index, self._layout)
        logger.info("replaced %s after a failed version", slot_path(self.directory, index))
