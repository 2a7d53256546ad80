"""The trainer's end of ``WeightsyncTorchRLScheme``: ``init_on_sender`` (one weightsync scheme
for all workers, or one per worker), ``connect`` and ``send``; mixed into it in ``adapter.py``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme
from torchrl.weight_update.utils import _resolve_model

import weightsync as ws
from weightsync.integrations.torchrl.collector_hooks import (
    close_with,
    flat_weights,
    holds_weights,
    is_weights_container,
    model_in_collector,
    worker_indices,
)
from weightsync.integrations.torchrl.per_worker import (
    DeviceMapFn,
    PerWorkerSenders,
    distinct_factories,
    is_per_worker_dict,
)

logger = logging.getLogger(__name__)


def _trainer_policy(collector: Any, model_id: str) -> Any:
    """The model ``collector`` holds on the trainer under ``model_id``, or None (a
    collector given only policy factories)."""
    try:
        return _resolve_model(collector, model_id)
    except (AttributeError, KeyError):
        return None


class _TrainerEnd(TorchRLWeightSyncScheme):
    """The trainer-side methods of ``WeightsyncTorchRLScheme`` (state and settings: its
    ``__init__`` and class attributes, in ``adapter.py``)."""

    _weightsync_class: Callable[..., ws.WeightSyncScheme]
    _accepts_stateless_policy: bool
    _per_worker_capable: bool
    per_worker_weights: bool
    sync: bool
    timeout: float
    connect_timeout: float
    _ws: ws.WeightSyncScheme | None
    _streams: list[ws.WeightSyncScheme] | None
    _per_worker: PerWorkerSenders | None
    _worker_devices: list[str]
    _local: bool
    _no_weights: bool
    _sender: ws.WeightSender | None
    _pending_async: bool

    def _init_on_sender_impl(self, *, model_id: str | None = None, context: Any = None,
                             weights: Any = None, model: Any = None, params_map: Any = None,
                             devices: list[Any] | None = None, device_map_fn: Any = None,
                             num_workers: int | None = None, ctx: Any = None,
                             **kwargs: Any) -> None:
        factories = (distinct_factories(context) if context is not None
                     and (model_id or "policy") == "policy" and model is None
                     and weights is None else None)
        if factories is not None and _trainer_policy(context, "policy") is not None:
            factories = None  # the trainer holds the policy: its weights go to every worker
        if (params_map is not None or device_map_fn is not None or self.per_worker_weights
                or factories is not None):
            if not self._per_worker_capable:
                raise ValueError(
                    f"{type(self).__name__}: per-worker weights (params_map, device_map_fn, "
                    "distinct policy factories) are not supported by this scheme; every "
                    "worker receives the same versions (use worker_ids= for a subset)")
            self._init_per_worker(model_id=model_id, context=context, weights=weights,
                                  model=model, params_map=params_map, devices=devices,
                                  device_map_fn=device_map_fn, num_workers=num_workers,
                                  factories=factories)
            return
        self.model_id = model_id or "policy"
        if context is not None:
            self.context = context
            if model is None and weights is None:
                model = model_in_collector(context, self.model_id)
            collector_devices = getattr(context, "policy_device", None)
            if isinstance(collector_devices, (list, tuple)):
                devices = list(collector_devices)
            elif not hasattr(context, "num_workers"):
                self._local = True  # a single-process Collector: nothing to transport
                self._install_hook()
        source = model if model is not None else weights
        if source is None:
            raise ValueError(f"{type(self).__name__}: init_on_sender needs a model, weights "
                             "or a collector (context=) that holds the model")
        if model is not None:
            self.model = model
        if not holds_weights(source):
            if not (self._local or self._accepts_stateless_policy
                    or is_weights_container(source)):
                raise TypeError(
                    f"{type(self).__name__} requires an nn.Module policy, got "
                    f"{type(source).__name__}: a policy without weights (e.g. RandomPolicy) "
                    "needs no weight sync scheme (TorchRL's process schemes refuse it too)")
            self._no_weights = True  # nothing to sync (TorchRL's schemes send nothing either)
            logger.info("%s for %r: the policy has no weights, nothing to sync",
                        type(self).__name__, self.model_id)
            return
        if self._local:
            return
        if devices is not None:
            num_workers = len(devices)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{type(self).__name__}: cannot tell how many workers there are; "
                             "pass num_workers= or devices=")
        self._worker_devices = [str(torch.device(d)) if d is not None else "cpu"
                                for d in (devices or [None] * num_workers)]
        self._ws = self._new_weightsync_scheme(num_workers)
        self._sender = self._new_sender(self._ws)
        self._sender.register_model(
            source if isinstance(source, torch.nn.Module) else flat_weights(source, "weights"))
        if context is not None:
            close_with(context, self)
        logger.info("%s for %r: sender ready for %d worker(s)", type(self).__name__,
                    self.model_id, num_workers)

    def _init_per_worker(self, *, model_id: str | None, context: Any, weights: Any,
                         model: Any, params_map: Any, devices: list[Any] | None,
                         device_map_fn: DeviceMapFn | None, num_workers: int | None,
                         factories: list[Callable[[], Any]] | None) -> None:
        """Each worker its own weightsync scheme (for one worker): its own versions, its
        own layout. Worker ``i``'s weights: ``params_map[i]``, else its factory's policy
        (distinct factories), else the model/weights; through ``device_map_fn`` if given."""
        name = type(self).__name__
        self.per_worker_weights = True
        self.model_id = model_id or "policy"
        sources: list[Any]
        if params_map is not None:
            if any(x is not None for x in (context, model, weights, devices, device_map_fn)):
                raise ValueError(f"{name}: params_map comes alone (as with TorchRL): no "
                                 "context, model, weights, devices or device_map_fn beside it")
            if (not isinstance(params_map, dict) or not params_map
                    or sorted(params_map) != list(range(len(params_map)))):
                raise ValueError(f"{name}: params_map must map every worker index 0..N-1 to "
                                 "that worker's weights")
            if num_workers is not None and num_workers != len(params_map):
                raise ValueError(f"{name}: num_workers={num_workers} but params_map has "
                                 f"{len(params_map)} workers")
            sources = [params_map[i] for i in range(len(params_map))]
        else:
            if context is not None:
                self.context = context
                collector_devices = getattr(context, "policy_device", None)
                if isinstance(collector_devices, (list, tuple)):
                    devices = list(collector_devices)
                if factories is None and model is None and weights is None:
                    model = model_in_collector(context, self.model_id)
            if devices is not None:
                num_workers = len(devices)
            if factories is not None:
                sources = [factory() for factory in factories]
            else:
                source = model if model is not None else weights
                if source is None:
                    raise ValueError(f"{name}: init_on_sender needs params_map, a model, "
                                     "weights or a collector (context=) that holds the model")
                if not isinstance(num_workers, int) or num_workers < 1:
                    raise ValueError(f"{name}: cannot tell how many workers there are; "
                                     "pass num_workers= or devices=")
                sources = [source] * num_workers
            if model is not None:
                self.model = model
        for idx, source in enumerate(sources):
            if not holds_weights(source):
                raise TypeError(f"{name}: worker {idx}'s policy ({type(source).__name__}) "
                                "holds no weights to sync")
        self._streams = [self._new_weightsync_scheme(1) for _ in sources]
        self._per_worker = PerWorkerSenders(self._streams, sources, self._new_sender,
                                            device_map_fn=device_map_fn)
        self._worker_devices = ([str(torch.device(d)) if d is not None else "cpu"
                                 for d in devices] if devices is not None
                                else self._per_worker.devices)
        if context is not None:
            close_with(context, self)
        logger.info("%s for %r: per-worker weights, one sender for each of %d worker(s)",
                    name, self.model_id, len(sources))

    def _new_weightsync_scheme(self, num_workers: int) -> ws.WeightSyncScheme:
        """The weightsync scheme for ``num_workers`` workers (made once, on the trainer)."""
        return self._weightsync_class(num_workers, timeout=self.timeout)

    def _new_sender(self, scheme: ws.WeightSyncScheme) -> ws.WeightSender:
        """The trainer's end of ``scheme``."""
        return scheme.create_sender()

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                     weights: Any = None) -> None:
        if self._local or self._no_weights:
            return
        if self._per_worker is not None:
            if weights is not None:
                raise ValueError(f"{type(self).__name__}: connect(weights=...) with per-worker "
                                 "weights: give each worker's weights to init_on_sender")
            self._per_worker.connect(self.connect_timeout)
            return
        sender = self._require_sender()
        if weights is not None:
            sender.register_model(flat_weights(weights, "connect(weights=...)"))
        sender.connect(timeout=self.connect_timeout)
        if weights is not None and self._model_ref is not None:
            sender.register_model(self.model)

    def send(self, weights: Any = None, worker_ids: int | list[int] | Any = None) -> None:
        """Snapshot the weights (the registered model's, or ``weights``) and deliver them to
        ``worker_ids`` (all by default); each takes them at the start of its next batch.

        ``sync=True`` returns once delivered; ``sync=False`` once the snapshot is taken (the
        next ``send`` or ``shutdown`` waits for it). A dead worker raises ``WorkerLostError``
        naming it; the others still get the version."""
        if not self.initialized_on_sender or not self.synchronized_on_sender:
            raise RuntimeError(f"{type(self).__name__}: send() needs init_on_sender() and "
                               "connect() first (the collector calls both)")
        per_worker_dict = is_per_worker_dict(weights)
        if per_worker_dict and self._per_worker is None:
            raise ValueError(
                "per-worker weights ({worker_idx: weights}) need per-worker streams: "
                f"{type(self).__name__}(per_worker_weights=True) or init_on_sender(params_map="
                "...); or send the same weights to a subset with worker_ids=")
        if isinstance(weights, str):
            weights = _resolve_model(self.context, weights)
        if self._no_weights:
            if weights is not None and holds_weights(weights):
                raise ValueError(f"{type(self).__name__}: weights sent for {self.model_id!r}, "
                                 "whose policy has no weights to receive them")
            return
        if self._local:
            self._send_local(weights)
            return
        if self._per_worker is not None:
            self._send_per_worker(self._per_worker, weights, worker_ids, per_worker_dict)
            return
        sender = self._require_sender()
        flat = None if weights is None else flat_weights(weights, "update_policy_weights_")
        targets = worker_indices(worker_ids, self._worker_devices)
        self._finish_async()
        if self.sync:
            sender.send(flat, worker_ids=targets, timeout=self.timeout)
        else:
            sender.send_async(flat, worker_ids=targets)
            self._pending_async = True

    def _send_per_worker(self, streams: PerWorkerSenders, weights: Any, worker_ids: Any,
                         per_worker_dict: bool) -> None:
        """Each target worker gets its own weights: ``weights[i]`` (a per-worker dict), the
        weights given, or (None) its own source."""
        targets = worker_indices(worker_ids, self._worker_devices)
        if per_worker_dict:
            given = dict(weights)
            if targets is not None:
                missing = [i for i in targets if i not in given]
                if missing:
                    raise ValueError(f"worker_ids names worker(s) {missing}, which the "
                                     "per-worker weights dict has no weights for")
                given = {i: given[i] for i in targets}
        else:
            ids = targets if targets is not None else range(streams.num_workers)
            given = {i: weights for i in ids}
        streams.send(given, named=per_worker_dict or targets is not None, sync=self.sync,
                     timeout=self.timeout)

    def _send_local(self, weights: Any) -> None:
        """Single-process Collector: the policy lives here, between batches; copy explicit
        weights into it (the collector's own copy when it cast the policy to a device)."""
        context = self.context
        target = context.get_model(self.model_id) if hasattr(context, "get_model") else None
        if weights is None:
            original = getattr(context, "_orig_policy", None)
            if original is None or original is target:
                return
            weights = original
        if target is not None:
            ws.WeightStrategy().apply_weights(target, flat_weights(weights, "weights"))

    def _finish_async(self) -> None:
        if self._per_worker is not None:
            self._per_worker.finish(self.timeout)
        if self._sender is not None:
            self._finish_async_of(self._sender)

    def _finish_async_of(self, sender: ws.WeightSender) -> None:
        if self._pending_async:
            self._pending_async = False
            sender.wait_async(timeout=self.timeout)

    def _require_sender(self) -> ws.WeightSender:
        if self._sender is None:
            raise RuntimeError(f"{type(self).__name__}: init_on_sender() was not called here")
        return self._sender
