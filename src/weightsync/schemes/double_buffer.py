"""VLLMDoubleBufferSyncScheme (seed 004): a trainer writes versions into a directory that
inference workers (vLLM engines or any process) read; see ``transports/directory.py``."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SenderLostError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.layout import Layout
from weightsync.core.liveness import process_dying
from weightsync.core.stats import SendRecord
from weightsync.core.strategy import WeightStrategy
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.schemes.base import WeightReceiver, WeightSender, WeightSyncScheme
from weightsync.transports.directory import (
    FORMAT,
    MANIFEST,
    SenderLock,
    SlotFile,
    ack_path,
    bucket_checksums,
    check_layout_matches,
    close_slots,
    file_layout,
    pack_with_checksums,
    read_json,
    remove_stale_temp_files,
    sender_alive,
    slot_path,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


class VLLMDoubleBufferSyncScheme(WeightSyncScheme):
    """Sync through a directory of two (or, under ``worker_ids`` isolation, a few more)
    preallocated safetensors slots and an atomically replaced manifest.

    ``directory``: /dev/shm for one host, a local disk, or a shared file system.
    ``dtype``: cast floating-point weights on the way (e.g. ``torch.bfloat16`` for inference).
    ``durable``: also fsync slot data before each commit (survives power loss, costs disk time);
    the manifest is always fsynced.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        num_workers: int = 1,
        *,
        timeout: float = 60.0,
        dtype: torch.dtype | None = None,
        durable: bool = False,
        poll_interval: float = 0.005,
        strategy: WeightStrategy | None = None,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        self.directory = Path(directory)
        self.num_workers = num_workers
        self.dtype = dtype
        self.durable = durable
        self.poll_interval = poll_interval

    def create_sender(self) -> VLLMDoubleBufferWeightSender:
        return VLLMDoubleBufferWeightSender(self)

    def create_receiver(self, worker_idx: int = 0) -> VLLMDoubleBufferWeightReceiver:
        return VLLMDoubleBufferWeightReceiver(self, worker_idx)


class VLLMDoubleBufferWeightSender(WeightSender):
    """Writes each version into a free slot, then commits it with an atomic manifest."""

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme) -> None:
        super().__init__(scheme)
        self.scheme: VLLMDoubleBufferSyncScheme = scheme
        self.directory = scheme.directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = SenderLock(self.directory)
        removed = remove_stale_temp_files(self.directory)
        self._table = VersionTable(scheme.num_workers)
        self._slots: dict[int, SlotFile] = {}
        self._file_layout: Layout | None = None
        self._pending: tuple[int, list[int], float] | None = None
        self._manifest = self._recover()
        if removed or self._manifest:
            logger.info("recovered %s at version %s (%d stale temp files removed)",
                        self.directory, self._table.published, removed)

    def _recover(self) -> dict[str, Any] | None:
        """Continue after a previous sender: keep its committed manifest and version
        numbers, so receivers holding version v take v+1 next, never an older number."""
        try:
            manifest = read_json(self.directory / MANIFEST)
        except IntegrityError:
            logger.warning("unreadable manifest in %s: starting afresh", self.directory)
            return None
        if manifest is None or manifest.get("format") != FORMAT:
            return None
        self._table.published = int(manifest["latest"]["version"])
        return manifest

    # ------------------------------------------------------------------ slots
    def _prepare_slots(self, layout: Layout) -> None:
        if self._file_layout is not None:
            return
        target = file_layout(layout, self.scheme.dtype)
        metadata = {"format": "pt", "producer": "weightsync", "fingerprint": target.fingerprint}
        index = 0
        while slot_path(self.directory, index).exists() or index < 2:
            path = slot_path(self.directory, index)
            slot = None
            if path.exists():
                with contextlib.suppress(IntegrityError, OSError, ValueError):
                    slot = SlotFile.open(path, writable=True)
                    if slot.layout.fingerprint != target.fingerprint:
                        slot.close()
                        slot = None
            if slot is None:
                slot = SlotFile.create(path, target, metadata)
            self._slots[index] = slot
            index += 1
        if self._manifest is not None and self._manifest.get("fingerprint") != target.fingerprint:
            self._manifest = None  # a different model: the old commits do not apply
        self._file_layout = target

    def _busy_slots(self, manifest: dict[str, Any] | None) -> set[int]:
        if manifest is None:
            return set()
        busy = {int(manifest["latest"]["slot"])}
        busy.update(int(e["slot"]) for e in manifest.get("workers", {}).values())
        return busy

    def _acquire_slot(self, deadline: Deadline) -> SlotFile:
        assert self._file_layout is not None
        while True:
            busy = self._busy_slots(self._manifest)
            for index, slot in sorted(self._slots.items()):
                if index not in busy and slot.try_lock(exclusive=True):
                    return slot
            if len(self._slots) < self.scheme.num_workers + 2:
                index = max(self._slots) + 1
                metadata = {"format": "pt", "producer": "weightsync",
                            "fingerprint": self._file_layout.fingerprint}
                slot = SlotFile.create(slot_path(self.directory, index), self._file_layout, metadata)
                self._slots[index] = slot
                continue
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"every slot in {self.directory} is still being read after "
                    f"{deadline.timeout}s (slow readers hold their shared locks)"
                )
            time.sleep(self.scheme.poll_interval)

    # ------------------------------------------------------------------ commit
    def update_weights(self, weights: Any = None) -> int:  # type: ignore[override]
        """Write ``weights`` (default: the registered model's) as the next version and
        commit it; returns at once, without waiting for any worker (seed 004)."""
        return self._commit(weights, None, Deadline(self.scheme.timeout))

    def _commit(self, weights: Any, worker_ids: int | list[int] | None, deadline: Deadline) -> int:
        if self._closed:
            raise RuntimeError("this sender is closed")
        flat = self._weights_to_send(weights)
        ids = self._table.check_worker_ids(worker_ids)
        assert self._layout is not None
        self._prepare_slots(self._layout)
        phases: dict[str, float] = {}
        t0 = time.perf_counter()
        slot = self._acquire_slot(deadline)
        try:
            checksums = pack_with_checksums(slot.layout, flat, slot.data)
            phases["write"] = time.perf_counter() - t0
            if self.scheme.durable:
                t1 = time.perf_counter()
                slot.flush()
                phases["flush"] = time.perf_counter() - t1
        finally:
            slot.unlock()
        slot_index = next(i for i, s in self._slots.items() if s is slot)
        version = self._table.published + 1
        t2 = time.perf_counter()
        self._manifest = self._next_manifest(version, slot_index, checksums, ids, worker_ids is None)
        write_json_atomic(self.directory / MANIFEST, self._manifest, durable=True)
        phases["commit"] = time.perf_counter() - t2
        self._table.published = version
        self._stats.add(SendRecord(version, tuple(ids), self._file_layout.nbytes if self._file_layout
                                   else 0, phases))
        return version

    def _next_manifest(
        self, version: int, slot: int, checksums: list[int], ids: list[int], everyone: bool
    ) -> dict[str, Any]:
        assert self._file_layout is not None
        old = self._manifest
        workers = dict(old.get("workers", {})) if old else {}
        entry = {"version": version, "slot": slot}
        if old is not None and not everyone:
            for w in range(self.scheme.num_workers):  # unnamed workers stay where they are
                workers.setdefault(str(w), dict(old["latest"]))
        for w in ids:
            workers[str(w)] = entry
        slots = {k: v for k, v in (old.get("slots", {}) if old else {}).items()
                 if int(k) in {int(e["slot"]) for e in workers.values()}}
        slots[str(slot)] = {"version": version, "checksums": [str(c) for c in checksums]}
        return {
            "format": FORMAT, "fingerprint": self._file_layout.fingerprint,
            "latest": entry, "workers": workers, "slots": slots,
            "sender": {"pid": os.getpid(), "host": socket.gethostname()},
            "committed_at": time.time(),
        }

    # ------------------------------------------------------------------ acks
    def _read_ack(self, worker_idx: int) -> dict[str, Any] | None:
        try:
            return read_json(ack_path(self.directory, worker_idx))
        except IntegrityError:
            return None  # being replaced right now: read again next round

    def _wait_acks(self, version: int, ids: list[int], deadline: Deadline) -> None:
        host = socket.gethostname()
        while True:
            slow, lost = [], []
            for w in ids:
                ack = self._read_ack(w)
                held = NO_VERSION if ack is None else int(ack.get("version", NO_VERSION))
                self._table.workers[w].version = held
                if held >= version:
                    continue
                if ack is not None and ack.get("host") == host and process_dying(int(ack["pid"])):
                    lost.append(w)
                else:
                    slow.append(w)
            if lost:
                raise WorkerLostError(
                    f"worker(s) {lost} died before taking version {version} (their ack files "
                    f"name a dead process on this host)", worker_ids=lost, version=version,
                )
            if not slow:
                return
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker(s) {slow} did not acknowledge version {version} within "
                    f"{deadline.timeout}s", worker_ids=slow,
                )
            time.sleep(self.scheme.poll_interval)

    # ------------------------------------------------------------------ API
    @property
    def version(self) -> int:
        return self._table.published

    def worker_lag(self) -> dict[int, int]:
        return {w: self.version - s.version for w, s in self._table.workers.items()
                if s.version > NO_VERSION}

    def connect(self, timeout: float | None = None) -> int:
        """Commit the current weights if this sender has not yet, then wait until every
        worker acknowledged the newest version."""
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        if self._stats.sends == 0:
            self._commit(None, None, deadline)
        self._wait_acks(self.version, list(range(self.scheme.num_workers)), deadline)
        return self.version

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        deadline = Deadline(self.scheme.timeout)
        ids = self._table.check_worker_ids(worker_ids)
        version = self._commit(weights, worker_ids, deadline)
        self._pending = (version, ids, time.perf_counter())

    def wait_async(self, timeout: float | None = None) -> int:
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        version, ids, _started = self._pending
        try:
            self._wait_acks(version, ids, Deadline(self.scheme.timeout if timeout is None else timeout))
        finally:
            self._pending = None
        return version

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            close_slots(self._slots)
            self._lock.release()


class VLLMDoubleBufferWeightReceiver(WeightReceiver):
    """Reads the newest committed version for its worker and applies it, either in place to
    a model or by streaming ``(name, tensor)`` pairs to a loader (vLLM's ``load_weights``)."""

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme, worker_idx: int) -> None:
        super().__init__(scheme, worker_idx)
        self.scheme: VLLMDoubleBufferSyncScheme = scheme
        self.directory = scheme.directory
        self._loader: Loader | None = None
        self._slots: dict[int, SlotFile] = {}
        self._checked_fingerprint: str | None = None

    def register_loader(self, loader: Loader) -> None:
        """Apply versions by calling ``loader(iterable of (name, tensor))`` instead of
        copying into a registered model (vLLM: ``model.load_weights``)."""
        if not callable(loader):
            raise TypeError(f"loader must be callable, got {type(loader).__name__}")
        self._loader = loader

    # ------------------------------------------------------------------ reading
    def _slot(self, index: int) -> SlotFile:
        path = slot_path(self.directory, index)
        slot = self._slots.get(index)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError as exc:
            raise IntegrityError(f"the manifest names {path.name}, which does not exist") from exc
        if slot is None or slot.inode != inode:
            if slot is not None:
                slot.close()
            slot = SlotFile.open(path)
            self._slots[index] = slot
        return slot

    def _entry(self, manifest: dict[str, Any]) -> tuple[int, int]:
        entry = manifest.get("workers", {}).get(str(self.worker_idx)) or manifest["latest"]
        return int(entry["version"]), int(entry["slot"])

    def _apply_newest(self) -> int | None:
        while True:
            manifest = read_json(self.directory / MANIFEST)
            if manifest is None:
                return None
            if manifest.get("format") != FORMAT:
                raise IntegrityError(f"{MANIFEST} has format {manifest.get('format')!r}")
            version, index = self._entry(manifest)
            if version <= self._version:
                return None
            slot = self._slot(index)
            if not slot.try_lock(exclusive=False):
                time.sleep(self.scheme.poll_interval)  # being rewritten: the manifest moved on
                continue
            try:
                again = read_json(self.directory / MANIFEST)
                if again is None or self._entry(again) != (version, index):
                    continue
                self._verify(again, slot, index, version)
                self._apply(slot)
            finally:
                slot.unlock()
            self._version = version
            self._write_ack()
            return version

    def _verify(self, manifest: dict[str, Any], slot: SlotFile, index: int, version: int) -> None:
        where = f"worker {self.worker_idx}, version {version}, {slot.path.name}"
        if manifest.get("fingerprint") != slot.layout.fingerprint:
            raise IntegrityError(f"{where}: the slot's layout does not match the manifest")
        expected_size = slot.data.numel()
        if os.fstat(slot.fd).st_size < slot.data.storage_offset() + expected_size:
            raise IntegrityError(f"{where}: the slot file is truncated")
        record = manifest.get("slots", {}).get(str(index), {})
        if int(record.get("version", -2)) != version:
            raise IntegrityError(f"{where}: the manifest's slot record is for another version")
        expected = [int(c) for c in record.get("checksums", [])]
        actual = bucket_checksums(slot.layout, slot.data)
        if expected != actual:
            bad = next(i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b) \
                if len(expected) == len(actual) else "count"
            raise IntegrityError(
                f"{where}: checksum mismatch in bucket {bad}; keeping version {self._version}"
            )

    def _apply(self, slot: SlotFile) -> None:
        if self._loader is not None:
            self._loader(slot.tensors())
            return
        dest = self._destination()
        if self._checked_fingerprint != slot.layout.fingerprint:
            check_layout_matches(slot.layout, dest, f"worker {self.worker_idx}")
            self._checked_fingerprint = slot.layout.fingerprint
        slot.layout.unpack(slot.buffers, dest)

    def _write_ack(self) -> None:
        write_json_atomic(
            ack_path(self.directory, self.worker_idx),
            {"version": self._version, "pid": os.getpid(), "host": socket.gethostname(),
             "at": time.time()},
            durable=False,
        )

    # ------------------------------------------------------------------ API
    def connect(self, timeout: float | None = None) -> int:
        """Wait for a committed version (no live sender needed), apply it, acknowledge it."""
        if self._loader is None:
            self._destination()
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        while True:
            applied = self._apply_newest()
            if applied is not None or self._version > NO_VERSION:
                return self._version
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: no committed weights in {self.directory} within "
                    f"{deadline.timeout}s"
                )
            time.sleep(self.scheme.poll_interval)

    def poll(self) -> int | None:
        applied = self._apply_newest()
        if applied is None and not sender_alive(self.directory):
            raise SenderLostError(
                f"worker {self.worker_idx} (at version {self._version}): no live sender holds "
                f"{self.directory}; the last committed version stays usable"
            )
        return applied

    def receive(self, timeout: float | None = 5.0) -> int | None:
        deadline = Deadline(timeout)
        while True:
            applied = self.poll()
            if applied is not None:
                return applied
            if deadline.expired():
                return None
            time.sleep(deadline.slice(self.scheme.poll_interval))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            close_slots(self._slots)
