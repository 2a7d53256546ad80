"""A collector worker's end of ``WeightsyncTorchRLScheme``: ``init_on_receiver``, ``connect``,
and each new version applied at a batch start (or while idle); mixed into it in ``adapter.py``."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme
from torchrl.weight_update.utils import _resolve_model

import weightsync as ws
from weightsync.core.strategy import flat_tensors
from weightsync.integrations.torchrl.batch_gate import ApplyPoints
from weightsync.integrations.torchrl.collector_hooks import (
    close_with,
    materialize_meta_module,
    tag_policy_version,
    tracked_version,
)

logger = logging.getLogger(__name__)


def _published_beyond(receiver: ws.WeightReceiver) -> bool:
    """Whether the sender already published a newer version than the one this receiver
    holds (False for receivers that cannot tell)."""
    newer_published = getattr(receiver, "newer_published", None)
    return callable(newer_published) and bool(newer_published())


class _WorkerEnd(TorchRLWeightSyncScheme):
    """The worker-side methods of ``WeightsyncTorchRLScheme`` (state and settings: its
    ``__init__`` and class attributes, in ``adapter.py``)."""

    _wait_for_published: bool
    _apply_when_idle: bool
    timeout: float
    connect_timeout: float
    _ws: ws.WeightSyncScheme | None
    _streams: list[ws.WeightSyncScheme] | None
    _worker_devices: list[str]
    _local: bool
    _no_weights: bool
    _receiver: ws.WeightReceiver | None
    _apply_points: ApplyPoints | None

    def _init_on_receiver_impl(self, *, model_id: str | None = None, context: Any = None,
                               model: Any = None, worker_idx: int | None = None,
                               **kwargs: Any) -> None:
        self.model_id = model_id or "policy"
        if context is not None:
            if model is None:
                model = (context.get_model(self.model_id) if hasattr(context, "get_model")
                         else _resolve_model(context, self.model_id))
            worker_idx = getattr(context, "worker_idx", worker_idx)
            self.context = context
        if model is not None:
            self.model = model
        self.worker_idx = worker_idx

    def _setup_connection_and_weights_on_receiver_impl(self, *,
                                                       worker_idx: int | None = None) -> None:
        idx = self.worker_idx if worker_idx is None else worker_idx
        if idx is None:
            raise RuntimeError(f"{type(self).__name__}: connect() on a worker needs its worker_idx")
        if self._no_weights:
            self.worker_idx = idx
            return
        scheme, index = self._stream_of(idx)
        self.worker_idx = idx
        receiver = scheme.create_receiver(index)
        receiver.register_model(self._materialized_model(idx))
        try:
            receiver.connect(timeout=self.connect_timeout)
        except BaseException:
            receiver.close()
            raise
        self._receiver = receiver
        self._install_hook()
        self._tag_version(receiver.version)
        if self.context is not None:
            close_with(self.context, self)

    def _stream_of(self, idx: int) -> tuple[ws.WeightSyncScheme, int]:
        """The weightsync scheme worker ``idx`` receives from, and its index there."""
        if self._streams is not None:  # per-worker weights: its own scheme, as worker 0
            if not 0 <= idx < len(self._streams):
                raise RuntimeError(f"worker {idx}: the trainer set up per-worker weights for "
                                   f"{len(self._streams)} worker(s) only")
            return self._streams[idx], 0
        if self._ws is None:
            raise RuntimeError(
                f"worker {idx}: this scheme was never initialised on the trainer "
                "(init_on_sender) before it was handed to the worker")
        return self._ws, idx

    def _materialized_model(self, idx: int) -> Any:
        """The worker's model, with meta tensors (TorchRL ships policies to workers on the
        meta device) given real storage on the worker's policy device first."""
        model = self.model
        if model is None:
            raise RuntimeError(f"worker {idx}: no model to receive {self.model_id!r} into")
        if isinstance(model, torch.nn.Module):
            device = self._worker_devices[idx] if idx < len(self._worker_devices) else "cpu"
            synced = set(flat_tensors(model, what="the worker's policy"))
            materialize_meta_module(model, device, synced_names=synced, where=f"worker {idx}")
        return model  # register_model refuses whatever is still on the meta device

    @property  # type: ignore[override]
    def context(self) -> Any:
        return TorchRLWeightSyncScheme.context.fget(self)  # type: ignore[attr-defined]

    @context.setter
    def context(self, context: Any) -> None:
        TorchRLWeightSyncScheme.context.fset(self, context)  # type: ignore[attr-defined]
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and context is not None:  # the worker's collector, after connect()
            self._install_hook()
            self._tag_version(receiver.version)
            close_with(context, self)

    def _install_hook(self) -> None:
        """Apply new versions at the collector's batch boundary (its ``pre_collect_hook``, run
        in the thread that then runs the policy) and, in a worker idle between batches, as
        they arrive (``batch_gate.py``); without a collector, before each call of the policy
        (a forward pre-hook). Either way never while a step reads the weights."""
        if self._apply_points is None:
            scheme_ref = weakref.ref(self)

            def on_batch_start() -> None:
                scheme = scheme_ref()
                if scheme is not None:
                    scheme._on_batch_start()

            def poll() -> int | bool | None:
                scheme = scheme_ref()
                return False if scheme is None else scheme.poll()

            self._apply_points = ApplyPoints(
                on_batch_start, poll, idle=self._apply_when_idle and not self._local,
                name=f"{self.model_id}-{self.worker_idx}",
                apply_timeout=self.timeout + 5.0)  # a poll waits up to self.timeout
        self._apply_points.install(self.context, self.model)

    def _on_batch_start(self) -> None:
        if self._local:  # the collector bumped its own version: tag the first frame too
            version = tracked_version(self.context)
            if version is not None:
                tag_policy_version(self.context, version)
        else:
            self.poll()

    def poll(self) -> int | None:
        """Apply the newest delivered version if newer (never blocks); returns it or None."""
        receiver = self._receiver
        if receiver is None:
            return None
        self._follow_model(receiver)
        try:
            version = receiver.poll()
            if version is None and self._wait_for_published and _published_beyond(receiver):
                # shared memory: the version is published but its new slot's handle is still
                # on its way (poll never waits for it); it arrives within milliseconds
                version = receiver.receive(timeout=self.timeout)
        except ws.WorkerDroppedError as exc:
            # the live trainer gave up on this worker (it stalled): the next poll joins again
            logger.warning("worker %s keeps version %d for now: %s", self.worker_idx,
                           receiver.version, exc)
            return None
        except ws.SenderLostError as exc:
            # the trainer closed (collector shutdown) or died; TorchRL's own control pipe
            # ends this worker either way: keep the version held, stop asking
            logger.info("worker %s keeps version %d: %s", self.worker_idx, receiver.version, exc)
            self._receiver = None
            receiver.close()
            return None
        if version is not None:
            self._tag_version(version)
        return version

    def _follow_model(self, receiver: ws.WeightReceiver) -> None:
        """The collector may swap the policy for its own copy (e.g. on its device) after
        connect(): receive into that copy from then on, if it holds the same weights."""
        model = self.model
        if model is None or model is receiver.model:
            return
        names = set(flat_tensors(model, what="the worker's policy"))
        if names == set(flat_tensors(receiver.model, what="the worker's policy")):
            idx = self.worker_idx if self.worker_idx is not None else receiver.worker_idx
            receiver.register_model(self._materialized_model(idx))

    def receive(self, timeout: float | None = None) -> Any:
        """TorchRL's receive: apply a newer version if one is there (waiting up to
        ``timeout`` seconds when given); returns the applied weights or None."""
        receiver = self._receiver
        if receiver is None:
            raise RuntimeError(f"{type(self).__name__}: receive() before connect() on a worker")
        self._follow_model(receiver)
        version = receiver.receive(timeout) if timeout else receiver.poll()
        if version is None:
            return None
        self._tag_version(version)
        return flat_tensors(receiver.model, what="the worker's policy")

    def _tag_version(self, version: int) -> None:
        if self.context is not None:
            tag_policy_version(self.context, version)
