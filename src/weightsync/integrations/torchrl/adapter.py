"""TorchRL's ``WeightSyncScheme`` interface driven by a weightsync scheme: the trainer's end
(``init_on_sender``, ``connect``, ``send``) and each collector worker's end
(``init_on_receiver``, ``connect``, a new version taken at each batch start). The concrete
schemes (``schemes.py`` for one host, ``ray_scheme.py`` for a Ray cluster) say which
weightsync scheme moves the bytes."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torchrl.weight_update import WeightSyncScheme as TorchRLWeightSyncScheme
from torchrl.weight_update.utils import _resolve_model

import weightsync as ws
from weightsync.core.strategy import flat_tensors
from weightsync.integrations.torchrl.collector_hooks import (
    chain_pre_collect_hook,
    close_with,
    flat_weights,
    holds_weights,
    is_weights_container,
    materialize_meta_module,
    model_in_collector,
    tag_policy_version,
    tracked_version,
    worker_indices,
)

logger = logging.getLogger(__name__)

def _published_beyond(receiver: ws.WeightReceiver) -> bool:
    """Whether the sender already published a newer version than the one this receiver
    holds (False for receivers that cannot tell)."""
    newer_published = getattr(receiver, "newer_published", None)
    return callable(newer_published) and bool(newer_published())


class WeightsyncTorchRLScheme(TorchRLWeightSyncScheme):
    """A TorchRL ``WeightSyncScheme`` whose bytes move through a weightsync scheme.

    The trainer's end is a weightsync sender (created by ``init_on_sender``); each collector
    worker's end a weightsync receiver (created by ``connect`` there). The picklable
    weightsync scheme travels to the workers inside this object."""

    _weightsync_class: Callable[..., ws.WeightSyncScheme]
    #: attributes that stay in the process that made them (never pickled to a worker)
    _process_local: tuple[str, ...] = ("_sender", "_receiver", "_hooked", "_hook_handle")
    #: whether a batch start waits (up to ``timeout``) for a version already published whose
    #: bytes are still on their way: only where they come while this thread waits
    _wait_for_published: bool = True
    #: whether a policy that is no module (TorchRL's ``RandomPolicy``) is taken, with nothing
    #: to sync (TorchRL's Ray scheme), or refused (TorchRL's process schemes refuse it)
    _accepts_stateless_policy: bool = False

    def __init__(self, strategy: str = "tensordict", sync: bool = True, *,
                 timeout: float = 60.0, connect_timeout: float = 300.0) -> None:
        super().__init__(strategy)
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout=} {connect_timeout=}")
        self.sync = sync
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self._ws: ws.WeightSyncScheme | None = None   # picklable: travels to the workers
        self._worker_devices: list[str] = []
        self._local = False                            # a single-process Collector
        self._no_weights = False                       # a policy without tensors: no-op sync
        self._sender: ws.WeightSender | None = None
        self._pending_async = False
        self._receiver: ws.WeightReceiver | None = None
        self._hooked: weakref.ReferenceType[Any] | None = None
        self._hook_handle: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync={self.sync}, weightsync={self._ws!r})"

    @property
    def weightsync_scheme(self) -> ws.WeightSyncScheme | None:
        """The weightsync scheme underneath (``None`` before ``init_on_sender``)."""
        return self._ws

    @property
    def is_receiver(self) -> bool:
        """Whether this end is a worker's (a receiver) rather than the trainer's."""
        return self._receiver is not None

    @property
    def version(self) -> int:
        """The version this end holds: the newest sent (trainer) or applied (worker)."""
        end = self._sender if self._sender is not None else self._receiver
        return end.version if end is not None else -1

    # ============================================================== trainer side
    def _init_on_sender_impl(self, *, model_id: str | None = None, context: Any = None,
                             weights: Any = None, model: Any = None, params_map: Any = None,
                             devices: list[Any] | None = None, device_map_fn: Any = None,
                             num_workers: int | None = None, ctx: Any = None,
                             **kwargs: Any) -> None:
        if params_map is not None or device_map_fn is not None:
            raise ValueError(
                f"{type(self).__name__}: params_map/device_map_fn give each worker its own "
                "weights, which weightsync does not do (every worker receives the same "
                "versions); pass model=/weights= with devices= or num_workers= instead"
            )
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
                    f"{type(self).__name__} needs an nn.Module policy, got "
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
        if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
            raise ValueError("per-worker weights ({worker_idx: weights}) are not supported: "
                             "send the same weights to a subset with worker_ids= instead")
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
        sender = self._require_sender()
        flat = None if weights is None else flat_weights(weights, "update_policy_weights_")
        targets = worker_indices(worker_ids, self._worker_devices)
        self._finish_async()
        if self.sync:
            sender.send(flat, worker_ids=targets, timeout=self.timeout)
        else:
            sender.send_async(flat, worker_ids=targets)
            self._pending_async = True

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

    # ============================================================== worker side
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
        if self._ws is None:
            raise RuntimeError(
                f"worker {idx}: this scheme was never initialised on the trainer "
                "(init_on_sender) before it was handed to the worker")
        self.worker_idx = idx
        receiver = self._ws.create_receiver(idx)
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
        in the thread that then runs the policy); without a collector, before each call of the
        policy (a forward pre-hook). Either way never while a step reads the weights."""
        context = self.context
        if context is not None and not (self._hooked is not None and self._hooked() is context):
            scheme_ref = weakref.ref(self)

            def on_batch_start() -> None:
                scheme = scheme_ref()
                if scheme is not None:
                    scheme._on_batch_start()

            if chain_pre_collect_hook(context, on_batch_start):
                self._hooked = weakref.ref(context)
                if self._hook_handle is not None:
                    self._hook_handle.remove()
                    self._hook_handle = None
                return
        if self._hooked is None and self._hook_handle is None and isinstance(self.model,
                                                                              torch.nn.Module):
            scheme_ref = weakref.ref(self)

            def forward_pre_hook(module: torch.nn.Module, args: Any) -> None:
                scheme = scheme_ref()
                if scheme is not None:
                    scheme.poll()

            self._hook_handle = self.model.register_forward_pre_hook(forward_pre_hook)

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
            receiver.register_model(self._materialized_model(receiver.worker_idx))

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

    # ============================================================== both
    def create_transport(self, **kwargs: Any) -> Any:
        """The weightsync end this scheme drives (TorchRL's abstract hook; not used by the
        collectors with this scheme)."""
        return self._sender if self._sender is not None else self._receiver

    def __getstate__(self) -> dict[str, Any]:
        # the ends stay where they were made (a forked child's copy of the sender is inert:
        # weightsync marks it closed there); workers create their own receiver
        state = super().__getstate__()
        for key in self._process_local:
            state[key] = None
        state["_pending_async"] = False
        return state

    def shutdown(self) -> None:
        """Close this end: the sender (trainer) or receiver (worker); safe to call twice."""
        sender, self._sender = getattr(self, "_sender", None), None
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if sender is not None:
            try:
                self._finish_async_of(sender)
            except ws.WeightSyncError as exc:  # e.g. RayCollector kills its actors first
                logger.warning("%s: the last update (sync=False) did not reach every worker "
                               "before shutdown: %s", type(self).__name__, exc)
            finally:
                sender.close()
        if receiver is not None:
            receiver.close()
        handle, self._hook_handle = getattr(self, "_hook_handle", None), None
        if handle is not None:
            handle.remove()
        super().shutdown()
