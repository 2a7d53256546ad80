"""The trainer's end of the directory protocol: slot pool, commits, and reading acks.

One writer per directory (it holds ``sender.lock``). A version is written into a slot no
manifest entry names and no reader has locked, then committed by replacing the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightsync.core.checksum import CHECKSUM_ID
from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.layout import Layout
from weightsync.core.liveness import judged_by_pid, process_dying
from weightsync.core.versions import NO_VERSION
from weightsync.transports.directory.files import (
    ensure_directory,
    remove_stale_temp_files,
    write_json_atomic,
)
from weightsync.transports.directory.manifest import (
    MANIFEST,
    Commit,
    Manifest,
    SenderLock,
    SlotFile,
    SlotRecord,
    ack_path,
    close_slots,
    file_layout,
    pack_with_checksums,
    read_ack,
    read_manifest,
    slot_path,
)
from weightsync.transports.directory.slots import TIES_KEY

logger = logging.getLogger(__name__)

_SLOT_NAME = "slot-{}.safetensors"


@dataclass
class Published:
    """What one commit did: its version, bytes and seconds per phase."""

    version: int
    nbytes: int
    phases: dict[str, float] = field(default_factory=dict)


class DirectoryWriter:
    """Creates (or checks) the directory, locks it, recovers its last commit, writes slots
    and commits manifests; reads the workers' acks."""

    def __init__(
        self, directory: Path, num_workers: int, *, dtype: torch.dtype | None, durable: bool,
        mode: int, poll_interval: float,
    ) -> None:
        self.directory = directory
        self.num_workers = num_workers
        self.dtype = dtype
        self.durable = durable
        self.mode = mode
        self.poll_interval = poll_interval
        ensure_directory(directory, mode, create=True)
        self._lock = SenderLock(directory, mode)
        self.owner_pid = os.getpid()
        self._slots: dict[int, SlotFile] = {}
        self._layout: Layout | None = None
        #: strings written into every slot's header beside the tensors (an adapter's config);
        #: set before the first commit, fixed after it
        self.slot_metadata: dict[str, str] = {}
        self._replaced: set[int] = set()  # slots of another config, created afresh
        self._pin_for_cuda = False
        try:
            removed = remove_stale_temp_files(directory)
            self._manifest = self._recover()
        except BaseException:
            self._lock.release()
            raise
        #: versions up to this one were published by an earlier sender
        self.recovered_version = self._manifest.latest.version if self._manifest else NO_VERSION
        self.published = self.recovered_version
        self.held: dict[int, int] = {}  # each worker's last acknowledged version
        if removed or self._manifest:
            logger.info("recovered %s at version %s (%d stale temp files removed)",
                        directory, self.published, removed)

    def _recover(self) -> Manifest | None:
        """Continue after a previous sender: keep its committed manifest and version
        numbers, so receivers holding version v take v+1 next, never an older number."""
        try:
            return read_manifest(self.directory)
        except IntegrityError as exc:
            logger.warning("%s; starting afresh in %s", exc, self.directory)
            return None

    # ------------------------------------------------------------------ slots
    def prepare(self, layout: Layout) -> None:
        """Map the slot pool for ``layout`` (once): slots 0 and 1, plus those the recovered
        manifest names; any other ``slot-N`` file is a stray and is removed."""
        if self._layout is not None:
            return
        target = file_layout(layout, self.dtype)
        self._pin_for_cuda = any(str(spec.device).startswith("cuda") for spec in layout.specs)
        if self._manifest is not None and self._manifest.fingerprint != target.fingerprint:
            self._manifest = None  # a different model: the old commits do not apply
        named = self._manifest.named_slots() if self._manifest else set()
        self._remove_strays(keep={0, 1} | named)
        for index in sorted({0, 1} | named):
            self._slots[index] = self._open_or_create(index, target)
        if self._manifest is not None and self._replaced & named:
            logger.info("slot(s) %s of %s held another adapter config: its commits are dropped",
                        sorted(self._replaced & named), self.directory)
            self._manifest = None
        self._layout = target

    def _remove_strays(self, keep: set[int]) -> None:
        with os.scandir(self.directory) as entries:
            for entry in entries:
                stem = entry.name.removeprefix("slot-").removesuffix(".safetensors")
                if entry.name == _SLOT_NAME.format(stem) and not (stem.isdigit() and int(stem) in keep):
                    os.unlink(entry.path)  # never follows a symlink
                    logger.info("removed %s: no manifest entry names it", entry.path)

    def _open_or_create(self, index: int, target: Layout) -> SlotFile:
        path = slot_path(self.directory, index)
        slot = None
        if os.path.lexists(path):
            try:
                slot = SlotFile.open(path, writable=True)
            except (IntegrityError, OSError, ValueError) as exc:
                logger.info("replacing %s: %s", path, exc)
        metadata = {**self.slot_metadata, "format": "pt", "producer": "weightsync",
                    "fingerprint": target.fingerprint}
        if slot is not None and slot.layout.fingerprint != target.fingerprint:
            slot.close()
            slot = None
        if slot is not None and _without_ties(slot.metadata) != metadata:
            slot.close()  # same tensors, another adapter config: its bytes mean something else
            slot = None
            self._replaced.add(index)
        if slot is None:
            slot = SlotFile.create(path, target, metadata, self.mode)
        if self._pin_for_cuda:
            slot.register_with_cuda()
        return slot

    def _acquire_slot(self, deadline: Deadline) -> tuple[int, SlotFile]:
        assert self._layout is not None
        while True:
            busy = self._manifest.busy_slots() if self._manifest else set()
            for index, slot in sorted(self._slots.items()):
                if index not in busy and slot.try_lock(exclusive=True):
                    return index, slot
            if len(self._slots) < self.num_workers + 2:
                index = next(i for i in range(len(self._slots) + 1) if i not in self._slots)
                self._slots[index] = self._open_or_create(index, self._layout)
                continue
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"every slot in {self.directory} is still being read after "
                    f"{deadline} (slow readers hold their shared locks)"
                )
            time.sleep(deadline.slice(self.poll_interval))

    # ------------------------------------------------------------------ commit
    def commit(
        self, weights: Mapping[str, torch.Tensor], layout: Layout, worker_ids: list[int],
        everyone: bool, deadline: Deadline,
    ) -> Published:
        """Write ``weights`` into a free slot and commit it as the next version for
        ``worker_ids`` (``everyone``: the new latest for all workers)."""
        if os.getpid() != self.owner_pid:
            raise RuntimeError(
                f"this sender of {self.directory} belongs to process {self.owner_pid}; a forked "
                "child cannot send through it (create a sender in the child instead)"
            )
        self.prepare(layout)
        assert self._layout is not None
        phases: dict[str, float] = {}
        t0 = time.perf_counter()
        index, slot = self._acquire_slot(deadline)
        try:  # the lock is held until the commit drops the slot's old record from the manifest
            checksums = self._fill(index, slot, weights, deadline)
            phases["write"] = time.perf_counter() - t0
            if self.durable:
                t1 = time.perf_counter()
                slot.flush()
                phases["flush"] = time.perf_counter() - t1
            version = self.published + 1
            t2 = time.perf_counter()
            manifest = self._next_manifest(Commit(version, index), checksums, worker_ids, everyone)
            write_json_atomic(self.directory / MANIFEST, manifest.to_json(), mode=self.mode)
            self._manifest = manifest
            phases["commit"] = time.perf_counter() - t2
        finally:
            slot.unlock()
        self.published = version
        return Published(version, self._layout.nbytes, phases)

    def _fill(self, index: int, slot: SlotFile, weights: Mapping[str, torch.Tensor],
              deadline: Deadline) -> list[int]:
        """Write the next version into ``slot`` (number ``index``, locked) and return its
        bucket checksums; a sharded trainer's rank 0 has the other ranks write too."""
        return pack_with_checksums(slot.layout, weights, slot.data)

    def _next_manifest(
        self, entry: Commit, checksums: list[int], ids: list[int], everyone: bool
    ) -> Manifest:
        assert self._layout is not None
        old = self._manifest
        workers = dict(old.workers) if old else {}
        if old is not None and not everyone:
            for w in range(self.num_workers):  # unnamed workers stay where they are
                workers.setdefault(w, old.latest)
        for w in ids:
            workers[w] = entry
        # slots not rewritten keep their versions, if their checksums are of this function
        slots = dict(old.slots) if old and old.checksum == CHECKSUM_ID else {}
        slots[entry.slot] = SlotRecord(entry.version, tuple(checksums))
        return Manifest(self._layout.fingerprint, entry, workers, slots,
                        os.getpid(), socket.gethostname())

    # ------------------------------------------------------------------ acks
    def wait_acks(self, version: int, worker_ids: list[int], deadline: Deadline,
                  held: dict[int, int], lost: dict[int, str] | None = None) -> None:
        """Block until every worker of ``worker_ids`` acknowledged ``version``
        (:func:`wait_for_acks`; ``lost``: see there)."""
        wait_for_acks(self.directory, version, worker_ids, deadline, held,
                      recovered_version=self.recovered_version, poll_interval=self.poll_interval,
                      lost=lost)

    # ------------------------------------------------------------------ as the scheme's writer
    needs_acks = True

    def start(self, deadline: Deadline) -> None:
        """Nothing to meet: workers read the directory whenever they look. A refusal left by
        a worker of an earlier sender (an ack naming a layout mismatch) is cleared: it was
        about that sender's weights."""
        for w in range(self.num_workers):
            with contextlib.suppress(IntegrityError, OSError):
                ack = read_ack(self.directory, w)
                if ack is not None and ack.mismatch is not None:
                    os.unlink(ack_path(self.directory, w))

    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> dict[int, str]:
        """Write and commit ``version`` for ``requested``; every worker can read it."""
        done = self.commit(flat, layout, requested, len(requested) == self.num_workers, deadline)
        assert done.version == version, (done.version, version)
        return self._known_dead(requested)

    def _known_dead(self, workers: list[int]) -> dict[int, str]:
        """The workers whose last ack (of this sender) names a process that died: they
        are not waited for (a restarted one acks again, from its new process)."""
        dead = {}
        for w in workers:
            with contextlib.suppress(IntegrityError, OSError):
                ack = read_ack(self.directory, w)
                if ack is not None and ack.version > self.recovered_version \
                        and judged_by_pid(ack.scope) and process_dying(ack.pid):
                    dead[w] = f"its process {ack.pid} died (its ack file in {self.directory})"
        return dead

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        """The commit was the delivery: workers find it in the manifest."""
        return {}

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: dict[int, str]) -> None:
        self.wait_acks(version, targets, deadline, self.held, lost)

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.wait_acks(version, list(range(self.num_workers)), deadline, self.held)

    def held_versions(self) -> dict[int, int]:
        """The versions the workers acknowledged, but for those whose process died (a
        worker listed here counts as back, and is reported lost again if it goes)."""
        dead = self._known_dead(list(self.held))
        return {w: v for w, v in self.held.items() if w not in dead}

    def close(self) -> None:
        close_slots(self._slots)
        self._lock.release()


def _without_ties(metadata: Mapping[str, str]) -> dict[str, str]:
    """A slot header's metadata minus what the layout itself writes there (its ties)."""
    return {k: v for k, v in metadata.items() if k != TIES_KEY}


def wait_for_acks(directory: Path, version: int, worker_ids: list[int], deadline: Deadline,
                  held: dict[int, int], *, recovered_version: int, poll_interval: float,
                  lost: dict[int, str] | None = None) -> None:
    """Block until every worker of ``worker_ids`` acknowledged ``version`` (``held`` gets
    each worker's acknowledged version as it is read).

    A worker whose ack names a dead process is lost if it acked a version of this sender;
    an ack left from before this sender started (``recovered_version`` or older) means "not
    connected yet", and that worker is waited for until the deadline. The pid is judged only when the ack was
    written in this process's pid namespace on this boot of this host (its ``pidns``):
    a worker in another container is waited for until the deadline instead. With ``lost``
    (a send), a dead worker is added to it and the others are still waited for (the sender
    names the lost ones once the others hold the version); without (``connect``), it is
    ``WorkerLostError`` at once."""
    dead: dict[int, str] = {} if lost is None else lost
    while True:
        slow, stale = [], {}
        for w in worker_ids:
            if w in dead:
                continue
            ack = read_ack(directory, w)
            held[w] = NO_VERSION if ack is None else ack.version
            if ack is not None and ack.mismatch is not None:
                said = ack.mismatch
                raise SchemaMismatchError(
                    f"worker {w} refused the weights: {said.get('message', '')}",
                    key=said.get("key"), expected=said.get("expected"), got=said.get("got"))
            if ack is not None and ack.version >= version:
                continue
            if ack is not None and judged_by_pid(ack.scope) and process_dying(ack.pid):
                if ack.version > recovered_version:
                    dead[w] = (f"its process {ack.pid} died before taking version {version} "
                               f"(its ack file in {directory})")
                    continue
                stale[w] = ack
            slow.append(w)
        if dead and lost is None:
            raise WorkerLostError.naming(dead, version)
        if not slow:
            return
        if deadline.expired():
            detail = "".join(
                f"; worker {w}'s last ack (version {a.version}) is from pid {a.pid}, which is "
                "gone: it has not restarted" for w, a in stale.items()
            )
            raise WeightSyncTimeoutError(
                f"worker(s) {slow} did not acknowledge version {version} in {directory} "
                f"within {deadline}{detail}", worker_ids=slow,
            )
        time.sleep(deadline.slice(poll_interval))
