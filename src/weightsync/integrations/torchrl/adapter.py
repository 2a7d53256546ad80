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
from weightsync.integrations.torchrl.batch_gate import ApplyPoints
from weightsync.integrations.torchrl.collector_hooks import (
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
    _process_local: tuple[str, ...] = ("_sender", "_receiver", "_apply_points", "_per_worker")
    #: whether a batch start waits (up to ``timeout``) for a version already published whose
    #: bytes are still on their way: only where they come while this thread waits
    _wait_for_published: bool = True
    #: whether a worker idle between batches applies a version as it arrives (a background
    #: applier gated by the batch hooks), not only at its next batch start
    _apply_when_idle: bool = True
    #: whether a policy that is no module (TorchRL's ``RandomPolicy``) is taken, with nothing
    #: to sync (TorchRL's Ray scheme), or refused (TorchRL's process schemes refuse it)
    _accepts_stateless_policy: bool = False
    #: whether each worker may have its own weights (``params_map``, ``device_map_fn``,
    #: distinct policy factories, per-worker weight dicts): one weightsync scheme per worker
    _per_worker_capable: bool = True
    #: TorchRL's flag: each worker its own weights (set by the schemes that take it)
    per_worker_weights: bool = False

    def __init__(self, strategy: str = "tensordict", sync: bool = True, *,
                 timeout: float = 60.0, connect_timeout: float = 300.0) -> None:
        super().__init__(strategy)
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout=} {connect_timeout=}")
        self.sync = sync
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self._ws: ws.WeightSyncScheme | None = None   # picklable: travels to the workers
        self._streams: list[ws.WeightSyncScheme] | None = None  # per-worker: one per worker
        self._per_worker: PerWorkerSenders | None = None  # the trainer's ends of _streams
        self._worker_devices: list[str] = []
        self._local = False                            # a single-process Collector
        self._no_weights = False                       # a policy without tensors: no-op sync
        self._sender: ws.WeightSender | None = None
        self._pending_async = False
        self._receiver: ws.WeightReceiver | None = None
        self._apply_points: ApplyPoints | None = None  # where this worker applies versions

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync={self.sync}, weightsync={self._ws!r})"

    @property
    def weightsync_scheme(self) -> ws.WeightSyncScheme | None:
        """The weightsync scheme underneath (``None`` before ``init_on_sender``, and with
        per-worker weights: see ``weightsync_schemes``)."""
        return self._ws

    @property
    def weightsync_schemes(self) -> list[ws.WeightSyncScheme]:
        """With per-worker weights, worker ``i``'s own weightsync scheme (one worker each);
        otherwise the one scheme all workers share (empty before ``init_on_sender``)."""
        if self._streams is not None:
            return list(self._streams)
        return [self._ws] if self._ws is not None else []

    @property
    def worker_versions(self) -> dict[int, int]:
        """On the trainer, the newest version sent to each worker (with per-worker weights
        each worker counts its own; otherwise every worker shares the scheme's count)."""
        if self._per_worker is not None:
            return self._per_worker.versions
        return {idx: self.version for idx in range(len(self._worker_devices))}

    @property
    def is_receiver(self) -> bool:
        """Whether this end is a worker's (a receiver) rather than the trainer's."""
        return self._receiver is not None

    @property
    def version(self) -> int:
        """The version this end holds: the newest sent (trainer) or applied (worker)."""
        if self._per_worker is not None:  # the newest any worker was sent
            return max(self._per_worker.versions.values(), default=-1)
        end = self._sender if self._sender is not None else self._receiver
        return end.version if end is not None else -1

    # ============================================================== trainer side
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
        streams, self._per_worker = getattr(self, "_per_worker", None), None
        if streams is not None:
            streams.close(self.timeout)
        points, self._apply_points = getattr(self, "_apply_points", None), None
        if points is not None:  # first: its idle applier polls the receiver
            points.close()
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
        super().shutdown()
