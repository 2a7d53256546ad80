"""VLLMDoubleBufferSyncScheme: a trainer writes versions into a directory that
inference workers (vLLM engines or any process) read.

The scheme holds the public API and one deadline per call; the protocol (manifest, slots,
acks, checksums, file safety) belongs to the directory transport (``transports/directory*``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import SenderLostError, WeightSyncError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.stats import SendRecord
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.schemes.base import WeightReceiver, WeightSender, WeightSyncScheme
from weightsync.transports.directory import Commit, SlotFile
from weightsync.transports.directory_files import DEFAULT_FILE_MODE, check_file_mode
from weightsync.transports.directory_reader import DirectoryReader
from weightsync.transports.directory_writer import DirectoryWriter

logger = logging.getLogger(__name__)

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]

_POLL_ATTEMPTS = 3  # a poll retries at once (no sleep) when the manifest moved under it


class VLLMDoubleBufferSyncScheme(WeightSyncScheme):
    """Sync through a directory of two (or, under ``worker_ids`` isolation, a few more)
    preallocated safetensors slots and an atomically replaced manifest.

    ``directory``: /dev/shm for one host, a local disk, or a shared file system; created
    (mode 0700) if absent; refused if another user owns it or may write to it.
    ``dtype``: cast floating-point weights on the way (e.g. ``torch.bfloat16`` for inference).
    ``durable``: also fsync slot data before each commit (survives power loss, costs disk time);
    the manifest is always fsynced.
    ``mode``: permissions of the files created (default 0o600: only this user reads the
    weights; 0o640 shares them read-only with the directory's group, 0o660 lets group members
    run the workers).
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
        mode: int = DEFAULT_FILE_MODE,
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
        self.mode = check_file_mode(mode)

    def deadline(self, timeout: float | None) -> Deadline:
        """The one deadline of a call: ``timeout``, or the scheme's default."""
        return Deadline(self.timeout if timeout is None else timeout)

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
        self._table = VersionTable(scheme.num_workers)
        self._pending: tuple[int, list[int]] | None = None
        self._writer = DirectoryWriter(
            scheme.directory, scheme.num_workers, dtype=scheme.dtype, durable=scheme.durable,
            mode=scheme.mode, poll_interval=scheme.poll_interval,
        )
        self._table.published = self._writer.published

    def _commit(self, weights: Any, worker_ids: int | list[int] | None, deadline: Deadline) -> int:
        if self._closed:
            raise RuntimeError("this sender is closed")
        flat = self._weights_to_send(weights)
        ids = self._table.check_worker_ids(worker_ids)
        assert self._layout is not None
        done = self._writer.commit(flat, self._layout, ids, worker_ids is None, deadline)
        self._table.published = done.version
        self._stats.add(SendRecord(done.version, tuple(ids), done.nbytes, done.phases))
        return done.version

    def _wait_acks(self, version: int, ids: list[int], deadline: Deadline) -> None:
        held: dict[int, int] = {}
        try:
            self._writer.wait_acks(version, ids, deadline, held)
        finally:
            for w, v in held.items():
                self._table.workers[w].version = v

    # ------------------------------------------------------------------ API
    @property
    def version(self) -> int:
        return self._table.published

    def worker_lag(self) -> dict[int, int]:
        return {w: self.version - s.version for w, s in self._table.workers.items()
                if s.version > NO_VERSION}

    def update_weights(self, weights: Any = None) -> int:  # type: ignore[override]
        """Write ``weights`` (default: the registered model's) as the next version and
        commit it; returns at once, without waiting for any worker: an engine often applies a
        version only when the training loop calls it, so waiting here could deadlock."""
        return self._commit(weights, None, self.scheme.deadline(None))

    def connect(self, timeout: float | None = None) -> int:
        """Commit the current weights if this sender has not yet, then wait until every
        worker acknowledged the newest version. A worker whose last ack names a process
        that is gone (left by an earlier run) is waited for until the deadline."""
        deadline = self.scheme.deadline(timeout)
        if self._stats.sends == 0:
            self._commit(None, None, deadline)
        self._wait_acks(self.version, list(range(self.scheme.num_workers)), deadline)
        return self.version

    def send(
        self, weights: Any = None, worker_ids: int | list[int] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Write, commit and wait for the named workers' acks, all within one ``timeout``."""
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        deadline = self.scheme.deadline(timeout)
        ids = self._table.check_worker_ids(worker_ids)
        version = self._commit(weights, worker_ids, deadline)
        self._wait_acks(version, ids, deadline)
        return version

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None,
                   timeout: float | None = None) -> None:
        """Write and commit now (within ``timeout``: slots may be held by slow readers);
        :meth:`wait_async` waits for the acks."""
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        ids = self._table.check_worker_ids(worker_ids)
        version = self._commit(weights, worker_ids, self.scheme.deadline(timeout))
        self._pending = (version, ids)

    def wait_async(self, timeout: float | None = None) -> int:
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        version, ids = self._pending
        try:
            self._wait_acks(version, ids, self.scheme.deadline(timeout))
        finally:
            self._pending = None
        return version

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()


class VLLMDoubleBufferWeightReceiver(WeightReceiver):
    """Reads the newest committed version for its worker and applies it, either in place to
    a model or by streaming ``(name, tensor)`` pairs to a loader (vLLM's ``load_weights``).

    The model's tensors are looked up again at each apply, so a model changed after
    ``register_model`` (``load_state_dict(assign=True)``, a replaced submodule) gets the
    version it reports."""

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme, worker_idx: int) -> None:
        super().__init__(scheme, worker_idx)
        self.scheme: VLLMDoubleBufferSyncScheme = scheme
        self.directory = scheme.directory
        self._loader: Loader | None = None
        self._reader = DirectoryReader(scheme.directory, worker_idx, mode=scheme.mode)
        self._apply_lock = threading.Lock()
        self._checked: tuple[str, tuple[tuple[Any, ...], ...]] | None = None

    def register_loader(self, loader: Loader) -> None:
        """Apply versions by calling ``loader(iterable of (name, tensor))`` instead of
        copying into a registered model (vLLM: ``model.load_weights``)."""
        if not callable(loader):
            raise TypeError(f"loader must be callable, got {type(loader).__name__}")
        self._loader = loader

    # ------------------------------------------------------------------ applying
    def _destination(self) -> dict[str, torch.Tensor]:
        """The registered model's tensors as they are now (not as they were at register)."""
        if self._model is None:
            return super()._destination()
        self._dest = flat_tensors(self._model, what=f"worker {self.worker_idx}'s model")
        return self._dest

    def _apply(self, slot: SlotFile) -> None:
        if self._loader is not None:
            self._loader(slot.tensors())
            return
        dest = self._destination()
        if any(t.is_cuda for t in dest.values()):
            self._reader.pin_for_cuda()
        key = (slot.layout.fingerprint, tuple((name, *t.shape) for name, t in dest.items()))
        if self._checked != key:
            check_layout_matches(slot.layout, dest, f"worker {self.worker_idx}")
            self._checked = key
        slot.layout.unpack(slot.buffers, dest)

    def _try_apply(self, commit: Commit) -> bool:
        """Apply ``commit`` if its slot can be read now; False if it is busy or gone.
        Holds the apply lock, so a ``close()`` from another thread never unmaps a slot
        that is being copied from."""
        with self._apply_lock:
            if self._closed:
                raise RuntimeError(f"worker {self.worker_idx}: this receiver is closed")
            with self._reader.locked(commit) as slot:
                if slot is None:
                    return False
                self._apply(slot)
            self._version = commit.version
            self._reader.ack(commit.version)
            return True

    def _apply_newest(self, deadline: Deadline, attempts: int | None = None) -> int | None:
        """Apply the newest version committed for this worker if newer than ours; keep
        trying while its slot is busy, until ``deadline`` or ``attempts`` run out."""
        tried = 0
        while True:
            manifest = self._reader.manifest()
            if manifest is None:
                return None
            commit = manifest.for_worker(self.worker_idx)
            if commit.version <= self._version:
                return None
            if self._try_apply(commit):
                return commit.version
            tried += 1
            if attempts is not None:  # poll: retry at once, a few times, never sleep
                if tried >= attempts:
                    return None
                continue
            if deadline.expired():
                return None
            time.sleep(deadline.slice(self.scheme.poll_interval))

    # ------------------------------------------------------------------ API
    def newest_committed(self) -> int | None:
        """The newest version committed for this worker (read from the manifest, nothing
        applied); None if nothing is committed yet."""
        manifest = self._reader.manifest()
        return None if manifest is None else manifest.for_worker(self.worker_idx).version

    def apply_version(self, version: int, timeout: float | None = None) -> int:
        """Apply exactly ``version``, verified by checksum, waiting up to ``timeout`` while
        its slot is being read-locked away; returns it. Raises :class:`WeightSyncError` if no
        slot holds that version (not committed yet, or already overwritten)."""
        if self._loader is None:
            self._destination()
        deadline = self.scheme.deadline(timeout)
        while True:
            manifest = self._reader.manifest()
            index = None if manifest is None else manifest.slot_holding(version)
            if index is None or manifest is None:
                held = sorted(r.version for r in manifest.slots.values()) if manifest else []
                raise WeightSyncError(
                    f"worker {self.worker_idx}: version {version} is not in any slot of "
                    f"{self.directory} (the slots hold versions {held}); it was overwritten or "
                    f"never committed, and this worker keeps version {self._version}"
                )
            if self._try_apply(Commit(version, index)):
                return version
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: could not read version {version} from "
                    f"{self.directory} within {deadline} (its slot stayed locked)"
                )
            time.sleep(deadline.slice(self.scheme.poll_interval))

    def connect(self, timeout: float | None = None) -> int:
        """Wait for a committed version (no live sender needed), apply it, acknowledge it."""
        if self._loader is None:
            self._destination()
        deadline = self.scheme.deadline(timeout)
        while True:
            self._apply_newest(deadline)
            if self._version > NO_VERSION:
                return self._version
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: no committed weights in {self.directory} within "
                    f"{deadline}"
                )
            time.sleep(deadline.slice(self.scheme.poll_interval))

    def poll(self) -> int | None:
        """Apply the newest committed version if newer; never waits (a busy slot: None)."""
        if self._closed:
            raise RuntimeError(f"worker {self.worker_idx}: this receiver is closed")
        applied = self._apply_newest(Deadline(0), attempts=_POLL_ATTEMPTS)
        if applied is None and not self._reader.sender_alive():
            raise SenderLostError(
                f"worker {self.worker_idx} (at version {self._version}): no live sender holds "
                f"{self.directory}; the last committed version stays usable"
            )
        return applied

    def receive(self, timeout: float | None = None) -> int | None:
        """Block up to ``timeout`` (default: the scheme's) for a newer version and apply it;
        None on timeout."""
        deadline = self.scheme.deadline(timeout)
        while True:
            applied = self.poll()
            if applied is not None:
                return applied
            if deadline.expired():
                return None
            time.sleep(deadline.slice(self.scheme.poll_interval))

    def close(self) -> None:
        """Stop; waits for an apply in progress in another thread, then unmaps the slots."""
        with self._apply_lock:
            if not self._closed:
                self._closed = True
                self._reader.close()


def check_layout_matches(sent: Layout, local: dict[str, torch.Tensor], who: str) -> None:
    """Names and shapes must match; dtypes may differ (the copy casts, e.g. bf16 slots)."""
    sent.check_compatible(
        Layout.from_weights(local), self_name="the slot", other_name=who, ignore_dtype=True
    )
