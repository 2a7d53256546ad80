"""VLLMDoubleBufferSyncScheme: a trainer writes versions into a directory that
inference workers (vLLM engines or any process) read.

The scheme holds the public API and one deadline per call; the protocol (manifest, slots,
acks, checksums, file safety) belongs to the directory transport (``transports/directory*``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import checked_timeout
from weightsync.core.errors import WeightSyncError, WeightSyncTimeoutError
from weightsync.core.strategy import WeightStrategy
from weightsync.schemes.base import WeightSyncScheme
from weightsync.schemes.local import check_num_workers
from weightsync.schemes.lora import LoraAdapter, check_adapter_name
from weightsync.schemes.ranks import (
    checked_rank_key,
    checked_trainer_ranks,
    new_rank_key,
    trainer_rank,
)
from weightsync.schemes.receiver import WeightReceiver
from weightsync.schemes.sender import WeightSender
from weightsync.transports.directory.files import DEFAULT_FILE_MODE, check_file_mode
from weightsync.transports.directory.manifest import Commit
from weightsync.transports.directory.ranks import shared_rank_key
from weightsync.transports.directory.reader import DirectoryReader, Loader, check_layout_matches
from weightsync.transports.directory.sharded import member_writer
from weightsync.transports.directory.sharded_lead import DirectoryLeadWriter
from weightsync.transports.directory.writer import DirectoryWriter
from weightsync.transports.ranks.member import MemberWriter

logger = logging.getLogger(__name__)

__all__ = ["Loader", "VLLMDoubleBufferSyncScheme", "VLLMDoubleBufferWeightReceiver",
           "VLLMDoubleBufferWeightSender", "check_layout_matches"]


@dataclass(frozen=True)
class DirectoryConfig:
    """Where versions are written and how; validated once, never changed."""

    directory: Path
    num_workers: int
    dtype: torch.dtype | None
    durable: bool
    poll_interval: float
    mode: int
    trainer_ranks: int = 1
    adapter: str | None = None
    #: what the ranks' records prove (never pickled to workers: ``schemes/ranks.py``)
    rank_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        check_num_workers(self.num_workers)
        checked_trainer_ranks(self.trainer_ranks)
        if self.adapter is not None:
            check_adapter_name(self.adapter)
            if self.trainer_ranks != 1:
                raise ValueError("adapter= needs an unsharded trainer (trainer_ranks=1): an "
                                 "adapter is small enough for one rank to write")
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(
                f"dtype must be a floating-point torch.dtype or None, got {self.dtype!r}")
        if not checked_timeout(self.poll_interval, "poll_interval"):
            raise ValueError(f"poll_interval must be > 0 seconds, got {self.poll_interval!r}")
        check_file_mode(self.mode)


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
    ``trainer_ranks``: the number of ranks of a sharded trainer (FSDP2, DTensor tensor
    parallel, ``LocalShard`` blocks); each rank calls ``create_sender(rank=r)`` and writes
    its own shards into the slot, rank 0 commits (``docs/sharded.md``). Workers are unchanged.
    ``adapter``: send only a peft model's LoRA adapter, served under this name (``policy``:
    versions ``policy-v0``, ``policy-v1``...); ``register_model(peft_model)``; the engine
    loads it with ``weightsync.integrations.vllm.update_adapter`` (docs/vllm.md, LoRA).
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
        trainer_ranks: int = 1,
        adapter: str | None = None,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        # absolute: the scheme is pickled to workers whose working directory may differ
        config = DirectoryConfig(Path(directory).absolute(), num_workers, dtype, bool(durable),
                                 poll_interval, mode, trainer_ranks, adapter)
        if config.trainer_ranks > 1:  # the directory's own key: ranks that each make this
            # scheme again (torchrun) agree on it; validated arguments first, then the file
            config = replace(config, rank_key=shared_rank_key(config.directory, config.mode,
                                                              new_rank_key))
        self.config = config

    directory = property(lambda self: self.config.directory)
    num_workers = property(lambda self: self.config.num_workers)
    dtype = property(lambda self: self.config.dtype)
    durable = property(lambda self: self.config.durable)
    poll_interval = property(lambda self: self.config.poll_interval)
    mode = property(lambda self: self.config.mode)
    trainer_ranks = property(lambda self: self.config.trainer_ranks)
    adapter = property(lambda self: self.config.adapter)

    def create_sender(self, rank: int | None = None) -> VLLMDoubleBufferWeightSender:
        """The sender of trainer rank ``rank`` (``0..trainer_ranks-1``; None: 0 for an
        unsharded trainer, else this process's torch.distributed rank). A sharded trainer's
        ranks need the rank key: this scheme, pickled, or one made again of the same
        directory (the key is the directory's ``rank-key`` file), not the copy
        :meth:`for_workers` makes."""
        return VLLMDoubleBufferWeightSender(self, rank)

    def create_receiver(self, worker_idx: int = 0) -> VLLMDoubleBufferWeightReceiver:
        return VLLMDoubleBufferWeightReceiver(self, worker_idx)


class VLLMDoubleBufferWeightSender(WeightSender):
    """Writes each version into a free slot, then commits it with an atomic manifest."""

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme, rank: int | None = 0) -> None:
        c = scheme.config
        rank = trainer_rank(rank, c.trainer_ranks)
        writer: DirectoryWriter | MemberWriter
        if c.trainer_ranks == 1:
            writer = DirectoryWriter(c.directory, c.num_workers, dtype=c.dtype, durable=c.durable,
                                     mode=c.mode, poll_interval=c.poll_interval)
        elif rank == 0:
            writer = DirectoryLeadWriter(c.directory, c.num_workers, ranks=c.trainer_ranks,
                                         rank_key=checked_rank_key(c.rank_key, scheme),
                                         dtype=c.dtype, durable=c.durable, mode=c.mode,
                                         poll_interval=c.poll_interval)
        else:
            writer = member_writer(c.directory, rank=rank, ranks=c.trainer_ranks,
                                   rank_key=checked_rank_key(c.rank_key, scheme),
                                   dtype=c.dtype, durable=c.durable, mode=c.mode,
                                   poll_interval=c.poll_interval)
        super().__init__(scheme, writer, c.num_workers, resumed_version=writer.published)
        self.scheme: VLLMDoubleBufferSyncScheme = scheme
        self.directory = c.directory
        #: this sender's trainer rank (0 unless the scheme has ``trainer_ranks > 1``)
        self.rank = rank
        self._adapter: LoraAdapter | None = None

    def register_model(self, model: Any) -> None:
        """The source of the weights; with the scheme's ``adapter``, a peft model whose
        active LoRA adapter alone travels (its base must not change after ``connect()``)."""
        if self.scheme.adapter is None:
            super().register_model(model)
            return
        adapter = LoraAdapter(model, self.scheme.adapter)
        if self._adapter is not None and adapter.metadata() != self._adapter.metadata():
            raise ValueError(f"adapter={adapter.name!r}: the model registered now has another "
                             "adapter config than the first; use a new directory for it")
        super().register_model(adapter.tensors(guard=False))
        self._adapter = adapter
        assert isinstance(self.writer, DirectoryWriter)
        self.writer.slot_metadata = adapter.metadata()

    @property
    def lora_adapter(self) -> LoraAdapter | None:
        """The registered adapter (``adapter=`` schemes), None before ``register_model``."""
        return self._adapter

    def _weights_to_send(self, weights: Any) -> Any:
        if weights is None and self._adapter is not None:
            weights = self._adapter.tensors()  # raises if the base changed: nothing written
        return super()._weights_to_send(weights)

    def update_weights(self, weights: Any = None, timeout: float | None = None) -> int:
        """Write ``weights`` (default: the registered model's) as the next version and
        commit it; returns at once, without waiting for any worker: an engine often applies a
        version only when the training loop calls it, so waiting here could deadlock.
        ``timeout`` (default: the scheme's) bounds the call (a sharded trainer's ranks wait
        for each other within it)."""
        deadline = self._deadline(timeout)
        self._check_open()
        self._start_writer(deadline)
        waiting = self._pending  # a send_async() whose acks wait_async() still collects
        self._publish(self._weights_to_send(weights), None, deadline, self.version + 1)
        committed, self._pending = self._pending, waiting
        assert committed is not None
        self._record(committed)
        return committed.version


class VLLMDoubleBufferWeightReceiver(WeightReceiver):
    """Reads the newest committed version for its worker and applies it, either in place to
    a model or by streaming ``(name, tensor)`` pairs to a loader (vLLM's ``load_weights``).

    The model's tensors are looked up again at each apply, so a model changed after
    ``register_model`` (``load_state_dict(assign=True)``, a replaced submodule) gets the
    version it reports."""

    reader: DirectoryReader

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme, worker_idx: int) -> None:
        c = scheme.config
        reader = DirectoryReader(c.directory, worker_idx, mode=c.mode,
                                 poll_interval=c.poll_interval)
        super().__init__(scheme, worker_idx, reader)
        self.scheme: VLLMDoubleBufferSyncScheme = scheme
        self.directory = c.directory

    def register_loader(self, loader: Loader) -> None:
        """Apply versions by calling ``loader(iterable of (name, tensor))`` instead of
        copying into a registered model (vLLM: ``model.load_weights``)."""
        if not callable(loader):
            raise TypeError(f"loader must be callable, got {type(loader).__name__}")
        self.reader.loader = loader

    def _destination(self) -> dict[str, torch.Tensor]:
        if self.reader.loader is not None and self._model is None:
            return {}  # the loader takes the tensors
        return super()._destination()

    def newest_committed(self) -> int | None:
        """The newest version committed for this worker (read from the manifest, nothing
        applied); None if nothing is committed yet."""
        manifest = self.reader.manifest()
        return None if manifest is None else manifest.for_worker(self.worker_idx).version

    def apply_version(self, version: int, timeout: float | None = None) -> int:
        """Apply exactly ``version``, verified by checksum, waiting up to ``timeout`` while
        its slot is being read-locked away; returns it. Raises :class:`WeightSyncError` if no
        slot holds that version (not committed yet, or already overwritten)."""
        deadline = self._deadline(timeout)
        while True:
            manifest = self.reader.manifest()
            index = None if manifest is None else manifest.slot_holding(version)
            if index is None or manifest is None:
                held = sorted(r.version for r in manifest.slots.values()) if manifest else []
                raise WeightSyncError(
                    f"worker {self.worker_idx}: version {version} is not in any slot of "
                    f"{self.directory} (the slots hold versions {held}); it was overwritten or "
                    f"never committed, and this worker keeps version {self._version}"
                )
            with self._apply_lock:
                self._check_open()
                applied = self.reader.apply_commit(Commit(version, index), self._destination())
                if applied:
                    return self._applied(version)
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: could not read version {version} from "
                    f"{self.directory} within {deadline} (its slot stayed locked)"
                )
            time.sleep(deadline.slice(self.scheme.poll_interval))
