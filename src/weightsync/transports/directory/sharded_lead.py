"""Rank 0 of a sharded trainer writing a directory: the single writer of today (sender lock,
slot pool, manifest) that is also the rank protocol's lead (:mod:`weightsync.transports.
ranks.lead`) over the file board: it meets the ranks, names the slot of each attempt in its
plan, waits for every rank's done and commits the manifest with the checksums their shares
add up to. The data plane is described in :mod:`.sharded`."""

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
from weightsync.core.versions import NO_VERSION
from weightsync.transports.directory import sharded
from weightsync.transports.directory.manifest import SlotFile, slot_path
from weightsync.transports.directory.ranks import LeadFiles
from weightsync.transports.directory.sharded import RankPart, sum_shares
from weightsync.transports.directory.writer import DirectoryWriter
from weightsync.transports.ranks.lead import RankLead

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
        self._deadline = Deadline(None)  # the send under way
        self._written: int | None = None  # a slot the other ranks may have written into

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Meet the ranks, then write and commit ``version`` with them."""
        self._part = RankPart(0, flat, layout, self.dtype, self._part)
        self._deadline = deadline
        try:
            self.lead.meet(layout, self._part.regions, version, deadline)
            done = self.commit(flat, layout, requested, len(requested) == self.num_workers,
                               deadline)
        except BaseException as exc:
            if self._written is not None:
                self._replace_slot(self._written)
            self.lead.fail(version, exc)
            raise
        self.lead.commit()
        self.committed = done.version
        logger.debug("version %d committed by %d trainer ranks (%s)", done.version, self.ranks,
                     {k: round(v, 4) for k, v in done.phases.items()})
        return {}

    def _fill(self, index: int, slot: SlotFile, weights: Mapping[str, torch.Tensor],
              deadline: Deadline) -> list[int]:
        """Post the plan naming the slot, write rank 0's part and wait for the others';
        returns the bucket checksums their shares add up to."""
        assert self._part is not None
        version = self.published + 1
        plan = self.lead.begin(version, {"slot": index})
        self._written = index
        shares = [self._part.write(slot)]
        sharded.after_part_written(0, version)  # a test hook
        dones = self.lead.wait_done(plan, deadline)
        ranks = sorted(dones)
        checksums = sum_shares(shares + [_shares(dones[r].detail, r) for r in ranks],
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
