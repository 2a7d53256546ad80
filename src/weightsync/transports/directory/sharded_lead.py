"""Rank 0 of a sharded trainer writing a directory: the single writer of today (sender lock,
slot pool, manifest) that also checks the other ranks' layouts, names the slot of each
version in ``pending.json``, waits for every rank's record and commits the manifest with
the checksums their shares add up to. The protocol is described in :mod:`.sharded`."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    TrainerRankLostError,
    WeightSyncTimeoutError,
)
from weightsync.core.layout import Layout
from weightsync.core.shards import check_cover
from weightsync.core.versions import NO_VERSION
from weightsync.transports.directory import sharded
from weightsync.transports.directory.manifest import SlotFile, slot_path
from weightsync.transports.directory.ranks import (
    LOST,
    PENDING,
    SCHEMA,
    ControlFiles,
    Failure,
    Hello,
    Pending,
    RankDone,
    new_nonce,
)
from weightsync.transports.directory.sharded import RankPart, sum_shares
from weightsync.transports.directory.writer import DirectoryWriter

logger = logging.getLogger(__name__)


class ShardedLeadWriter(DirectoryWriter):
    """Trainer rank 0 of ``ranks``: a :class:`DirectoryWriter` whose slots every rank fills."""

    sharded = True

    def __init__(self, directory: Path, num_workers: int, *, ranks: int,
                 dtype: torch.dtype | None, durable: bool, mode: int, poll_interval: float) -> None:
        super().__init__(directory, num_workers, dtype=dtype, durable=durable, mode=mode,
                         poll_interval=poll_interval)
        self.ranks = ranks
        self.files = ControlFiles(directory, mode)
        self.joined_at = self.published
        self.committed = NO_VERSION
        self._part: RankPart | None = None
        self._nonces: dict[int, str] = {}  # the rank incarnations whose layouts were checked
        self._checked_for = ""  # ...against this layout fingerprint
        self._last_failure: Failure | None = None
        self._written: int | None = None  # a slot the other ranks may have written into

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Check the ranks, then write and commit ``version`` with them."""
        self._part = RankPart(0, flat, layout, self.dtype, self._part)
        self._meet(layout, version, deadline)
        try:
            done = self.commit(flat, layout, requested, len(requested) == self.num_workers,
                               deadline)
        except BaseException:
            if self._written is not None:
                self._replace_slot(self._written)
            raise
        self.committed = done.version
        logger.debug("version %d committed by %d trainer ranks (%s)", done.version, self.ranks,
                     {k: round(v, 4) for k, v in done.phases.items()})
        return {}

    # ------------------------------------------------------------------ meeting the ranks
    def _hellos(self, version: int, deadline: Deadline) -> dict[int, Hello]:
        """Every other rank's hello from a live process, waiting for those not there yet."""
        while True:
            hellos: dict[int, Hello] = {}
            for rank in range(1, self.ranks):
                hello = self.files.hello(rank)
                if hello is not None and not hello.dead():
                    hellos[rank] = hello
            missing = [r for r in range(1, self.ranks) if r not in hellos]
            if not missing:
                return hellos
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"trainer rank(s) {missing} did not join version {version} in "
                    f"{self.directory} within {deadline} (no hello from a live process: not "
                    "started, dead, or closed)")
            time.sleep(deadline.slice(self.poll_interval))

    def _meet(self, layout: Layout, version: int, deadline: Deadline) -> None:
        """Check, before any byte is written, that every rank registered the same global
        layout and that their regions tile each tensor exactly once."""
        assert self._part is not None
        hellos = self._hellos(version, deadline)
        nonces = {rank: hello.nonce for rank, hello in hellos.items()}
        if nonces == self._nonces and self._checked_for == layout.fingerprint \
                and not self._part.changed:
            return
        try:
            for rank, hello in sorted(hellos.items()):
                self._check_layout(layout, rank, hello)
            check_cover(layout, {0: self._part.regions,
                                 **{rank: hello.regions for rank, hello in hellos.items()}})
        except SchemaMismatchError as exc:
            attempt = new_nonce()
            rank = getattr(exc, "rank", next(iter(sorted(hellos)), 0))
            self._last_failure = Failure(attempt, rank, SCHEMA, str(exc))
            self.files.write(self.directory / PENDING,
                             Pending(version, -1, attempt, nonces, self._last_failure))
            raise
        self._nonces, self._checked_for = nonces, layout.fingerprint
        logger.info("trainer ranks 0..%d agree on the layout %s of %s", self.ranks - 1,
                    layout.fingerprint, self.directory)

    @staticmethod
    def _check_layout(layout: Layout, rank: int, hello: Hello) -> None:
        if hello.fingerprint == layout.fingerprint:
            return
        try:
            theirs = Layout.from_dict(hello.layout)
        except ValueError as exc:
            raise IntegrityError(f"hello-{rank}.json: {exc}") from None
        try:
            layout.check_compatible(theirs, self_name="trainer rank 0's model",
                                    other_name=f"trainer rank {rank}'s model")
        except SchemaMismatchError as exc:
            error = SchemaMismatchError(f"trainer rank {rank} registered another model: {exc}",
                                        key=exc.key, expected=exc.expected, got=exc.got)
            error.rank = rank  # type: ignore[attr-defined]
            raise error from None
        error = SchemaMismatchError(f"trainer rank {rank} registered the same tensors in "
                                    "another order than trainer rank 0")
        error.rank = rank  # type: ignore[attr-defined]
        raise error

    # ------------------------------------------------------------------ writing a version
    def _fill(self, index: int, slot: SlotFile, weights: Mapping[str, torch.Tensor],
              deadline: Deadline) -> list[int]:
        """Name the slot in ``pending.json``, write rank 0's part, and wait for the others';
        returns the bucket checksums their shares add up to."""
        assert self._part is not None
        version = self.published + 1
        pending = Pending(version, index, new_nonce(), dict(self._nonces), self._last_failure)
        self.files.write(self.directory / PENDING, pending)
        self._written = index
        shares = [self._part.write(slot)]
        sharded.after_part_written(0, version)  # a test hook
        records = self._wait_ranks(pending, deadline)
        checksums = sum_shares(shares + [r.checksums for r in records],
                               len(slot.layout.buckets),
                               ["trainer rank 0", *(f"trainer rank {r.rank}" for r in records)])
        self._written = None
        return checksums

    def _wait_ranks(self, pending: Pending, deadline: Deadline) -> list[RankDone]:
        """Each other rank's record of ``pending``'s attempt; a rank lost meanwhile fails it."""
        done: dict[int, RankDone] = {}
        while True:
            for rank in range(1, self.ranks):
                if rank in done:
                    continue
                record = self.files.done(rank)
                if record is not None and record.attempt == pending.attempt \
                        and record.nonce == pending.nonces[rank]:
                    done[rank] = record
                    continue
                why = self._lost(rank, pending.nonces[rank])
                if why:
                    self._fail(pending, rank, why)
            if len(done) == self.ranks - 1:
                return [done[r] for r in sorted(done)]
            if deadline.expired():
                silent = [r for r in range(1, self.ranks) if r not in done]
                self._fail(pending, silent[0],
                           f"trainer rank(s) {silent} did not write their part within {deadline} "
                           "(stopped, hung, or too slow)")
            time.sleep(deadline.slice(self.poll_interval))

    def _lost(self, rank: int, nonce: str) -> str:
        """Why rank ``rank`` (incarnation ``nonce``) cannot finish, or '' while it may."""
        try:
            hello = self.files.hello(rank)
        except IntegrityError as exc:
            return f"its hello file is unreadable ({exc})"
        if hello is None:
            return f"trainer rank {rank} closed (its hello file is gone)"
        if hello.nonce != nonce:
            return f"trainer rank {rank} restarted (pid {hello.pid} on {hello.host})"
        if hello.dead():
            return f"{hello.who} died"
        return ""

    def _fail(self, pending: Pending, rank: int, why: str) -> None:
        """Record that ``pending``'s attempt failed because of ``rank``, and raise."""
        self._last_failure = Failure(pending.attempt, rank, LOST, why)
        self.files.write(self.directory / PENDING,
                         Pending(pending.version, pending.slot, pending.attempt, pending.nonces,
                                 self._last_failure))
        self._nonces = {}  # check the ranks again before the next attempt
        logger.warning("version %d in %s failed: %s", pending.version, self.directory, why)
        raise TrainerRankLostError(
            f"version {pending.version} was not committed: {why}; the workers keep version "
            f"{self.published}", rank=rank)

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
