"""A worker's end of the directory protocol: find a committed version, lock and verify its
slot, apply it (into the model, or through a loader such as vLLM's ``load_weights``),
acknowledge what was applied. It is the scheme's reader
(:class:`~weightsync.core.endpoints.WeightReader`): ``poll()`` never sleeps."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from weightsync.core.checksum import check_function
from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError, SchemaMismatchError, SenderLostError
from weightsync.core.layout import Layout
from weightsync.core.liveness import pid_scope
from weightsync.transports.directory.files import check_directory, write_json_atomic
from weightsync.transports.directory.manifest import (
    Ack,
    Commit,
    Manifest,
    ManifestCache,
    SlotFile,
    ack_path,
    bucket_checksums,
    close_slots,
    sender_alive,
    slot_path,
)
from weightsync.transports.directory.slots import current_slot

logger = logging.getLogger(__name__)

#: How long a reader trusts that the sender it saw alive still is (seconds).
ALIVE_RECHECK_S = 0.05
#: a poll retries at once (no sleep) when the manifest moved under it
POLL_ATTEMPTS = 3

#: applies a version from ``(name, tensor)`` pairs instead of a registered model
Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


def check_layout_matches(sent: Layout, local: dict[str, torch.Tensor], who: str) -> None:
    """Names and shapes must match; dtypes may differ (the copy casts, e.g. bf16 slots)."""
    sent.check_compatible(
        Layout.from_weights(local), self_name="the slot", other_name=who, ignore_dtype=True
    )


class DirectoryReader:
    """Reads committed versions of one directory for worker ``worker_idx``."""

    views_model = False

    def __init__(self, directory: Path, worker_idx: int, *, mode: int,
                 poll_interval: float = 0.005) -> None:
        self.directory = directory
        self.worker_idx = worker_idx
        self.mode = mode
        self.poll_interval = poll_interval
        self.loader: Loader | None = None
        self.expecting = f"committed weights in {directory}"
        self._layout_checked: tuple[str, tuple[tuple[Any, ...], ...]] | None = None
        self._checked = False
        self._slots: dict[int, SlotFile] = {}
        self._host = socket.gethostname()
        self._pin = False
        self._alive_at = float("-inf")
        self._manifests = ManifestCache(directory)
        self._ack_path = ack_path(directory, worker_idx)
        self._unwritten_ack: int | None = None  # applied, but its ack could not be written

    def manifest(self) -> Manifest | None:
        """The committed manifest; None while the directory or its manifest does not exist."""
        if not self._checked:
            try:
                check_directory(self.directory, self.mode)
            except FileNotFoundError:
                return None
            self._checked = True
        return self._manifests.read()

    def _slot(self, index: int) -> SlotFile:
        """The mapped slot ``index``, reopened if the file was replaced since."""
        slot, opened = current_slot(self._slots, slot_path(self.directory, index), index,
                                    writable=False, named_by="the manifest")
        if opened and self._pin:
            slot.register_with_cuda()
        return slot

    @contextlib.contextmanager
    def locked(self, commit: Commit) -> Iterator[SlotFile | None]:
        """The slot of ``commit`` under a shared lock, checked against the manifest read
        after locking (so the writer cannot reuse it while it is read) and verified by
        checksum; None if the slot is being written or the manifest no longer holds
        ``commit``'s version there. :class:`IntegrityError` if the bytes do not match."""
        slot = self._slot(commit.slot)
        if not slot.try_lock(exclusive=False):
            yield None
            return
        try:
            manifest = self._manifests.read()
            record = manifest.slots.get(commit.slot) if manifest else None
            if manifest is None or record is None or record.version != commit.version:
                yield None
                return
            self._verify(manifest, slot, commit)
            yield slot
        finally:
            slot.unlock()

    def _verify(self, manifest: Manifest, slot: SlotFile, commit: Commit) -> None:
        where = f"worker {self.worker_idx}, version {commit.version}, {slot.path}"
        check_function(manifest.checksum, f"{where}: the manifest")
        if manifest.fingerprint != slot.layout.fingerprint:
            raise IntegrityError(f"{where}: the slot's layout does not match the manifest")
        if os.fstat(slot.fd).st_size < slot.data.storage_offset() + slot.data.numel():
            raise IntegrityError(f"{where}: the slot file is truncated")
        expected = list(manifest.slots[commit.slot].checksums)
        actual = bucket_checksums(slot.layout, slot.data)
        if expected != actual:
            bad = next((i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b), "count")
            raise IntegrityError(f"{where}: checksum mismatch in bucket {bad}")

    def ack(self, version: int) -> None:
        """Record that this worker holds ``version`` (atomically, never through a symlink).
        The version is applied already: a file system that refuses the ack (full, read-only)
        is logged and the ack retried at the next poll, instead of failing the apply."""
        try:
            write_json_atomic(self._ack_path,
                              Ack(version, os.getpid(), self._host, pid_scope()).to_json(),
                              mode=self.mode, durable=False)
        except OSError as exc:
            if self._unwritten_ack != version:
                logger.warning("worker %d holds version %d but cannot acknowledge it in %s: %s "
                               "(retried at each poll; the trainer waits for it)",
                               self.worker_idx, version, self.directory, exc)
            self._unwritten_ack = version
        else:
            self._unwritten_ack = None

    def _report_mismatch(self, error: SchemaMismatchError) -> None:
        """Tell the trainer (in this worker's ack file) which key this worker refuses, so
        that its ``connect()`` names it instead of waiting for an ack that never comes."""
        said = {"message": str(error)[:2000]} | {
            name: str(value)[:500] for name in ("key", "expected", "got")
            if (value := getattr(error, name)) is not None}
        with contextlib.suppress(OSError):
            write_json_atomic(self._ack_path, Ack(-1, os.getpid(), self._host, pid_scope(),
                                                  said).to_json(), mode=self.mode, durable=False)

    def sender_alive(self) -> bool:
        """Whether a live sender holds the directory's lock; a positive answer is reused
        for :data:`ALIVE_RECHECK_S`, so a tight ``poll()`` loop costs no extra system calls."""
        now = time.monotonic()
        if now - self._alive_at < ALIVE_RECHECK_S:
            return True
        alive = sender_alive(self.directory)
        self._alive_at = now if alive else float("-inf")
        return alive

    def pin_for_cuda(self) -> None:
        """Page-lock every mapped slot (and those mapped later) for host-to-device copies."""
        self._pin = True
        for slot in self._slots.values():
            slot.register_with_cuda()

    # ------------------------------------------------------------------ as the scheme's reader
    def open(self, local: Layout | None, deadline: Deadline) -> None:
        """Nothing to join: versions are read from the directory, no live sender needed
        (the layout is checked against the slot at the first apply)."""

    def newer_available(self, version: int) -> bool:
        if self._unwritten_ack is not None:
            self.ack(self._unwritten_ack)
        manifest = self.manifest()
        return manifest is not None and manifest.for_worker(self.worker_idx).version > version

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        """Apply the newest version committed for this worker if newer than ``version``;
        while its slot is busy, retry until ``deadline`` (a poll: a few times at once)."""
        attempts = POLL_ATTEMPTS if deadline.timeout == 0 else None
        tried = 0
        while True:
            manifest = self.manifest()
            if manifest is None:
                return None
            commit = manifest.for_worker(self.worker_idx)
            if commit.version <= version:
                return None
            if self.apply_commit(commit, dest):
                return commit.version
            tried += 1
            if attempts is not None:
                if tried >= attempts:
                    return None
                continue
            if deadline.expired():
                return None
            time.sleep(deadline.slice(self.poll_interval))

    def apply_commit(self, commit: Commit, dest: dict[str, torch.Tensor]) -> bool:
        """Apply ``commit`` if its slot can be read now; False if it is busy or gone."""
        with self.locked(commit) as slot:
            if slot is None:
                return False
            if self.loader is not None:
                self.loader(slot.tensors())
                return True
            if any(t.is_cuda for t in dest.values()):
                self.pin_for_cuda()
            key = (slot.layout.fingerprint, tuple((name, *t.shape) for name, t in dest.items()))
            if self._layout_checked != key:
                try:
                    check_layout_matches(slot.layout, dest, f"worker {self.worker_idx}")
                except SchemaMismatchError as exc:
                    self._report_mismatch(exc)
                    raise
                self._layout_checked = key
            slot.layout.unpack(slot.buffers, dest)
            return True

    def wait(self, version: int, deadline: Deadline) -> None:
        time.sleep(deadline.slice(self.poll_interval))

    def check_sender(self, version: int) -> None:
        if not self.sender_alive():
            raise SenderLostError(
                f"worker {self.worker_idx} (at version {version}): no live sender holds "
                f"{self.directory}; the last committed version stays usable"
            )

    def close(self, dest: dict[str, torch.Tensor] | None = None) -> None:
        close_slots(self._slots)
