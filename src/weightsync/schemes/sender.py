"""The trainer's end of every scheme: the send lifecycle, written once.

A :class:`WeightSender` is handed its transport's :class:`~weightsync.core.endpoints.WeightWriter`
and owns what every transport shares: the registered model and its layout, version numbers,
one deadline per public call (from its start to its return), the pending ``send_async``,
per-send stats, and turning workers the writer lost into one ``WorkerLostError``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from weightsync.core.deadline import Deadline, human_duration
from weightsync.core.endpoints import Losses, WeightWriter, as_sharded
from weightsync.core.errors import WeightSyncError, WorkerLostError
from weightsync.core.fork_safety import track_for_fork
from weightsync.core.layout import Layout
from weightsync.core.own_tensors import OwnTensors
from weightsync.core.shards import global_layout, sharded_flat
from weightsync.core.stats import SendRecord, SendStats
from weightsync.core.strategy import flat_tensors
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.schemes.closing import Closable, SyncSettings

if TYPE_CHECKING:
    from collections.abc import Mapping

logger = logging.getLogger(__name__)

#: a send that takes longer than this is logged at INFO (others at DEBUG)
SLOW_SEND_SECONDS = 1.0


@dataclass
class PendingSend:
    """A version published (``send_async`` returned) whose delivery is not confirmed yet."""

    version: int
    named: bool  # the caller passed worker_ids
    targets: list[int]
    lost: Losses
    nbytes: int
    phases: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None


class WeightSender(Closable):
    """Trainer side: publishes versions of one model's weights to the workers through
    ``writer``. Created by ``scheme.create_sender()``."""

    def __init__(self, scheme: SyncSettings, writer: WeightWriter,
                 num_workers: int, resumed_version: int = NO_VERSION) -> None:
        self.scheme = scheme
        self.writer = writer
        self._table = VersionTable(num_workers, published=resumed_version)
        self._model: Any = None
        self._own: OwnTensors | None = None  # a module's tensors, walked once and kept
        self._layout: Layout | None = None
        self._stats = SendStats()
        self._reported: set[int] = set()  # lost and already reported (not raised again)
        self._pending: PendingSend | None = None
        self._started = False
        self._sent_any = False
        self._closed = False
        self._forked_copy = False
        self._owner_pid = os.getpid()
        #: one rank of a sharded trainer: the model holds DTensors / LocalShards, and the
        #: layout is the global one (``core/shards.py``)
        self._ranks = as_sharded(writer)
        self._sharded = self._ranks is not None
        track_for_fork(self)

    # ------------------------------------------------------------------ model
    def register_model(self, model: Any) -> None:
        """The source of the weights: an ``nn.Module``, ``TensorDictBase`` or mapping."""
        flat = self._flat(model, "register_model")
        if not flat:
            raise ValueError("register_model: the model has no parameters or buffers to sync")
        layout = global_layout(flat) if self._sharded else Layout.from_weights(flat)
        if self._layout is not None and layout.fingerprint != self._layout.fingerprint:
            self._layout.check_compatible(layout, self_name="the model registered first",
                                          other_name="the new model")
        self._model = model
        self._own = OwnTensors(model) if isinstance(model, torch.nn.Module) and not self._sharded \
            else None
        self._layout = layout

    def _flat(self, source: Any, what: str) -> dict[str, Any]:
        return sharded_flat(source, what=what) if self._sharded else flat_tensors(source, what=what)

    @property
    def layout(self) -> Layout | None:
        return self._layout

    def _weights_to_send(self, weights: Any) -> Mapping[str, torch.Tensor]:
        """Flat weights for one send, checked against the layout (nothing written yet)."""
        if weights is None:
            if self._model is None:
                raise RuntimeError("nothing to send: call register_model(model) or pass weights=")
            if self._own is not None:  # only read: ``.data`` costs less than ``detach()``
                flat = {name: t.data if getattr(t, "requires_grad", False) else t
                        for name, t in self._own.get().items()}
            else:
                flat = self._flat(self._model, "the registered model")
        else:
            flat = self._flat(weights, "send(weights=...)")
            if self._layout is None:
                self._layout = global_layout(flat) if self._sharded else Layout.from_weights(flat)
        assert self._layout is not None
        if self._sharded:
            self._layout.check_compatible(global_layout(flat), self_name="the registered model",
                                          other_name="the weights sent")
        else:
            self._layout.check_weights(flat)
        return flat

    # ------------------------------------------------------------------ API
    @property
    def version(self) -> int:
        """The newest version published (-1 before the first)."""
        return self._table.published

    def worker_lag(self) -> dict[int, int]:
        """How many versions each connected worker is behind."""
        return {w: self.version - v for w, v in self.writer.held_versions().items()
                if v > NO_VERSION}

    def stats(self) -> dict[str, Any]:
        """Per-send figures: bytes, seconds per phase, per-worker lag."""
        summary = self._stats.summary(self.worker_lag())
        summary["version"] = self.version
        summary["layout_nbytes"] = self._layout.nbytes if self._layout else 0
        # a transport that counts what crossed its medium per version says so here
        figures = getattr(self.writer, "version_figures", None)
        if summary["last"] is not None and callable(figures):
            summary["last"] |= figures(summary["last"]["version"])
        return summary

    def _deadline(self, timeout: float | None) -> Deadline:
        """The one deadline of a public call: ``timeout``, or the scheme's default."""
        return Deadline(self.scheme.timeout if timeout is None else timeout)

    def connect(self, timeout: float | None = None) -> int:
        """Block until every worker holds the current version (publishing version 0 if this
        sender has published nothing yet); returns that version."""
        return self._connect(self._deadline(timeout))

    def _connect(self, deadline: Deadline) -> int:
        self._check_open()
        self._start_writer(deadline)
        if not self._sent_any:
            self._publish(self._weights_to_send(None), None, deadline, self._table.published + 1)
            pending, self._pending = self._pending, None
            assert pending is not None
            if pending.error is not None:
                raise pending.error
            if self.writer.needs_acks:  # those not there yet are waited for just below
                try:
                    self.writer.wait_acked(pending.targets, pending.version, deadline,
                                           pending.lost)
                except BaseException:
                    self._uncount_failed(pending.version)
                    raise
            self._record(pending)
        self.writer.wait_joined(self._table.published, deadline)
        return self._table.published

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None,
             timeout: float | None = None) -> int:
        """Snapshot the weights now, deliver them, and return the new version; ``timeout``
        (default: the scheme's) bounds the whole call."""
        deadline = self._deadline(timeout)
        self._start_send(weights, worker_ids, deadline)
        return self._finish_send(deadline)

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None,
                   timeout: float | None = None) -> None:
        """Snapshot the weights now and start delivering them; finish with ``wait_async``.
        ``timeout`` bounds this call (publishing may wait for a slot a slow reader holds)."""
        self._start_send(weights, worker_ids, self._deadline(timeout))

    def wait_async(self, timeout: float | None = None) -> int:
        """Block until the pending ``send_async`` is delivered; returns its version."""
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        return self._finish_send(self._deadline(timeout))

    def update_weights(self, weights: Any = None) -> int:
        """Alias of :meth:`send` (the vLLM-style senders' name)."""
        return self.send(weights)

    # ------------------------------------------------------------------ lifecycle
    def _start_writer(self, deadline: Deadline) -> None:
        if not self._started:
            self.writer.start(deadline)
            self._started = True
            # a rank that joins a sharded trainer late takes the versions already committed
            if self._ranks is not None and self._ranks.joined_at > self._table.published:
                self._table.published = self._ranks.joined_at

    def _start_send(self, weights: Any, worker_ids: int | list[int] | None,
                    deadline: Deadline) -> None:
        self._check_open()
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        if self._table.published == NO_VERSION:
            self._connect(deadline)
        requested = self._table.check_worker_ids(worker_ids)
        flat = self._weights_to_send(weights)
        self._publish(flat, requested if worker_ids is not None else None, deadline,
                      self._table.published + 1)

    def _publish(self, flat: Mapping[str, torch.Tensor], named: list[int] | None,
                 deadline: Deadline, version: int) -> None:
        """Publish ``version`` to ``named`` (None: everyone) and start delivering it."""
        assert self._layout is not None
        requested = named if named is not None else list(range(self._table.num_workers))
        t0 = time.perf_counter()
        unreachable = self.writer.publish(flat, self._layout, requested, version, deadline)
        if self._ranks is not None:  # a rank that fell behind wrote the others' version
            version = self._ranks.committed
        if self._reported:  # those reported lost that are back again
            self._reported.difference_update(self.writer.held_versions())
        targets = [w for w in requested if w not in unreachable]
        # already reported, and not asked for by name: not raised again
        lost = dict(unreachable) if named is not None else {
            w: why for w, why in unreachable.items() if w not in self._reported}
        self._table.published = version
        self._sent_any = True
        pending = PendingSend(version, named is not None, targets, lost, self._layout.nbytes)
        pending.phases["publish"] = time.perf_counter() - t0
        self._pending = pending
        t1 = time.perf_counter()
        try:
            lost.update(self.writer.deliver(targets, version, deadline))
        except BaseException as exc:  # raised by wait_async, within its own deadline
            pending.error = exc
        pending.phases["deliver"] = time.perf_counter() - t1

    def _finish_send(self, deadline: Deadline) -> int:
        pending = self._pending
        assert pending is not None
        try:
            if self._closed:
                raise WeightSyncError(
                    f"the sender was closed while version {pending.version} was being sent"
                )
            if pending.error is not None:
                raise pending.error
            if self.writer.needs_acks:
                t0 = time.perf_counter()
                self.writer.wait_acked(pending.targets, pending.version, deadline, pending.lost)
                pending.phases["ack"] = time.perf_counter() - t0
        except BaseException:
            self._uncount_failed(pending.version)
            raise
        finally:
            self._pending = None
        self._record(pending)
        if pending.lost:
            self._reported.update(pending.lost)
            raise WorkerLostError.naming(pending.lost, pending.version)
        return pending.version

    def _uncount_failed(self, version: int) -> None:
        """A sharded trainer's version that failed after it was published (the ranks did
        not all commit it) is not counted: the next committed version takes its number."""
        if self._ranks is not None and self._ranks.committed < version:
            self._table.published = self._ranks.committed
            self._sent_any = self._ranks.committed != NO_VERSION

    def _record(self, pending: PendingSend) -> None:
        self._stats.add(SendRecord(pending.version, tuple(pending.targets), pending.nbytes,
                                   pending.phases))
        elapsed = time.perf_counter() - pending.started
        level = logging.INFO if elapsed > SLOW_SEND_SECONDS else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(level, "version %d sent to worker(s) %s in %s%s", pending.version,
                       pending.targets, human_duration(elapsed),
                       " (slow)" if level == logging.INFO else "")

    def _check_open(self) -> None:
        if self._forked_copy:
            raise RuntimeError(
                f"this sender belongs to process {self._owner_pid}; a forked child cannot "
                "send through it (create a sender in the child instead)")
        if self._closed:
            raise RuntimeError("this sender is closed")

    def close(self) -> None:
        """Release the transport and the model (its memory, a GPU's included, is the
        caller's again); the workers learn that the sender left."""
        if self._closed:
            return
        self._closed = True
        self.writer.close()
        self._model = self._own = None

