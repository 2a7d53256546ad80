"""TorchRL's ``RayWeightSyncScheme`` on weightsync's Ray scheme, for ``RayCollector``.

The trainer's end is a weightsync Ray sender whose workers are the collector actors: each
call it makes on a worker actor runs, through TorchRL's ``cascade_execute``, on this scheme's
copy inside that actor (``_receiver_schemes[model_id]``). Actors on the trainer's node take
each version from its shared memory, actors on other nodes from the checksummed broadcast;
every actor applies a new version at its collector's batch start (``pre_collect_hook``); an
actor that is a multi-process collector applies it on delivery and forwards it to its
worker processes (``ray_inner.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torchrl.weight_update.weight_sync_schemes import register_weight_sync_backend

import weightsync as ws
from weightsync import RayWeightReceiver, RayWeightReceiverMixin
from weightsync.integrations.torchrl.adapter import WeightsyncTorchRLScheme
from weightsync.integrations.torchrl.collector_hooks import close_with
from weightsync.integrations.torchrl.ray_inner import (
    InnerForwarder,
    actor_policy,
    is_multi_process_collector,
)

logger = logging.getLogger(__name__)

#: the TorchRL backend name this scheme is registered under (``from_backend(name)``)
RAY_BACKEND = "weightsync-ray"

# the attribute of the scheme, inside a collector actor, that answers the sender's calls
_ACTOR_END = "actor_end"


class _Forwarded:
    """One method of the scheme's end inside a collector actor, called like an actor
    method (``.remote(...)``), through the collector's ``cascade_execute``."""

    def __init__(self, actor: Any, path: str) -> None:
        self._actor = actor
        self._path = path

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._actor.cascade_execute.remote(self._path, *args, **kwargs)


class CollectorActor:
    """A ``RayCollector`` collector actor as weightsync's Ray sender sees a worker actor:
    the four calls the sender makes on one (layout check, node-local offer, group join,
    delivery) are forwarded to the scheme's end inside it. ``actor`` is the Ray handle."""

    def __init__(self, actor: Any, model_id: str) -> None:
        if "." in model_id or "'" in model_id:
            raise ValueError(f"model id {model_id!r}: TorchRL's cascade_execute cannot address "
                             "a scheme whose model id holds '.' or a quote")
        self.actor = actor
        self._prefix = f"_receiver_schemes['{model_id}'].{_ACTOR_END}."

    def __repr__(self) -> str:
        return f"CollectorActor({self.actor!r})"

    @property
    def _weightsync_check(self) -> _Forwarded:
        return _Forwarded(self.actor, self._prefix + "_weightsync_check")

    @property
    def _weightsync_attach(self) -> _Forwarded:
        return _Forwarded(self.actor, self._prefix + "_weightsync_attach")

    @property
    def _weightsync_join(self) -> _Forwarded:
        return _Forwarded(self.actor, self._prefix + "_weightsync_join")

    @property
    def _weightsync_receive(self) -> _Forwarded:
        return _Forwarded(self.actor, self._prefix + "_weightsync_receive")


class _ActorEnd(RayWeightReceiverMixin):
    """Inside a collector actor: answers the sender's calls for one receiver;
    ``on_delivery`` (if given) runs after each delivery has been taken."""

    def __init__(self, receiver: RayWeightReceiver,
                 on_delivery: Callable[[], None] | None = None) -> None:
        self.weightsync_receiver = receiver
        self._on_delivery = on_delivery

    def _weightsync_receive(
        self, version: int, keep: bool, messages: list[dict[str, Any]] | None = None,
        delivery: dict[str, Any] | None = None,
    ) -> int | dict[str, Any]:
        held = super()._weightsync_receive(version, keep, messages, delivery)
        if self._on_delivery is not None:
            self._on_delivery()
        return held


@register_weight_sync_backend(RAY_BACKEND)
class RayWeightSyncScheme(WeightsyncTorchRLScheme):
    """TorchRL's ``RayWeightSyncScheme`` on weightsync's Ray scheme: collector actors on the
    trainer's node copy each version from its shared memory, actors on other nodes take it
    from one checksummed broadcast (gloo, or NCCL with ``backend="nccl"``); each actor
    applies a new version at its collector's next batch start.

    Args: as TorchRL's (``strategy``, ``backend``), plus ``timeout`` (seconds, every
    send), ``connect_timeout`` (the first update, which connects the actors), ``sync``
    (``False``: an update returns once the snapshot is taken), ``node_local`` and
    ``checksums`` (as for ``weightsync.RayWeightSyncScheme``)."""

    _process_local = (*WeightsyncTorchRLScheme._process_local, _ACTOR_END, "_inner")
    # a collector actor runs one call at a time: what a version still lacks comes with the
    # sender's next call on it, which cannot run while a batch start waits for it
    _wait_for_published = False
    # the same reason: a delivery lands between the actor's calls, and each batch start takes
    # it (an actor that is a multi-process collector applies and forwards it on delivery)
    _apply_when_idle = False
    _accepts_stateless_policy = True  # as TorchRL's RayWeightSyncScheme: nothing to sync
    _per_worker_capable = False  # one Ray scheme for every actor: the same versions

    def __init__(self, strategy: str = "tensordict", backend: str = "gloo", *,
                 sync: bool = True, timeout: float = 60.0, connect_timeout: float = 300.0,
                 node_local: bool = True, checksums: bool = True) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(strategy, sync, timeout=timeout, connect_timeout=connect_timeout)
        self.backend = backend
        self.node_local = bool(node_local)
        self.checksums = bool(checksums)
        self._actors: list[Any] = []
        self.actor_end: _ActorEnd | None = None
        self._inner: InnerForwarder | None = None  # an actor that is a multi-process collector

    # ============================================================== trainer side
    def _init_on_sender_impl(self, *, model_id: str | None = None, context: Any = None,
                             remote_collectors: Sequence[Any] | None = None,
                             num_workers: int | None = None, **kwargs: Any) -> None:
        actors = remote_collectors
        if actors is None and context is not None:
            actors = getattr(context, "remote_collectors", None)
        if not actors:
            raise ValueError(f"{type(self).__name__}: init_on_sender needs the collector actors "
                             "(a RayCollector as context=, or remote_collectors=)")
        self._actors = list(actors)
        if num_workers is None and not isinstance(getattr(context, "policy_device", None),
                                                  (list, tuple)):
            num_workers = len(self._actors)
        super()._init_on_sender_impl(model_id=model_id, context=context,
                                     num_workers=num_workers, **kwargs)
        if self._no_weights:
            return
        if len(self._worker_devices) != len(self._actors):
            raise ValueError(f"{type(self).__name__}: {len(self._actors)} collector actors but "
                             f"{len(self._worker_devices)} policy devices")

    def _new_weightsync_scheme(self, num_workers: int) -> ws.WeightSyncScheme:
        return ws.RayWeightSyncScheme(num_workers, backend=self.backend, timeout=self.timeout,
                                      node_local=self.node_local, checksums=self.checksums)

    def _new_sender(self, scheme: ws.WeightSyncScheme) -> ws.WeightSender:
        assert isinstance(scheme, ws.RayWeightSyncScheme)
        model_id = self.model_id or "policy"
        return scheme.create_sender([CollectorActor(a, model_id) for a in self._actors])

    # ============================================================== actor side
    def _init_on_receiver_impl(self, *, model_id: str | None = None, context: Any = None,
                               **kwargs: Any) -> None:
        multi = context is not None and is_multi_process_collector(context)
        if multi and kwargs.get("model") is None and not self._no_weights:
            kwargs["model"] = actor_policy(context, model_id or "policy")
        super()._init_on_receiver_impl(model_id=model_id, context=context, **kwargs)
        if self._no_weights:
            return  # the policy has no weights: no receiver, nothing to apply
        if multi:
            # its policy never runs here: apply on delivery, forward to its processes
            self._inner = InnerForwarder(context, self.model_id or "policy")
        idx = self.worker_idx
        if idx is None or self._ws is None:
            raise RuntimeError(f"{type(self).__name__}: a collector actor needs its worker_idx "
                               "and a scheme initialised on the trainer (init_on_sender)")
        # the receiver exists from now on: the trainer's connect() calls it (layout check,
        # group join, version 0) while the actor's own connect() has already returned
        receiver = self._ws.create_receiver(idx)
        assert isinstance(receiver, RayWeightReceiver)
        receiver.register_model(self._materialized_model(idx))
        self._receiver = receiver
        self.actor_end = _ActorEnd(receiver, self._apply_and_forward if self._inner else None)
        self._install_hook()
        if self.context is not None:
            close_with(self.context, self)

    def _setup_connection_and_weights_on_receiver_impl(self, *,
                                                       worker_idx: int | None = None) -> None:
        """Never waits: in a Ray actor that runs one call at a time, the sender's calls (the
        group join, version 0) run after this one returns. The first batch applies them."""
        if self._no_weights:
            return
        if self._receiver is None:
            raise RuntimeError(f"worker {self.worker_idx}: connect() before init_on_receiver()")
        if self._inner is not None:
            self._apply_and_forward()
        else:
            self.poll()

    def _install_hook(self) -> None:
        if self._inner is None:  # a multi-process collector's hook would run in its workers
            super()._install_hook()

    def _apply_and_forward(self) -> None:
        """In an actor that is a multi-process collector (between two of its Ray calls, so
        never mid-batch here): apply a delivered version now and forward it to the actor's
        worker processes. A failed forward is logged; the next version is forwarded anew."""
        inner, receiver = self._inner, self._receiver
        version = self.poll()
        if version is None or inner is None or receiver is None:
            return
        try:
            inner.forward(receiver.model, version)
        except Exception as exc:  # the actor keeps running; the trainer's next send retries
            logger.error("worker %s: version %d applied in the actor but not forwarded to its "
                         "worker processes: %s", self.worker_idx, version, exc)

    @property
    def path(self) -> str | None:
        """In a collector actor: ``"node-local"`` (the trainer's shared memory) or
        ``"broadcast"``, how versions reach it (None before the first one)."""
        receiver = self._receiver
        return receiver.path if isinstance(receiver, RayWeightReceiver) else None

    def poll(self) -> int | None:
        """Apply the newest delivered version if newer (never blocks). A version whose bytes
        fail their checksums, or a delivery that failed, is logged and skipped: the actor
        keeps collecting with the version it holds, and the next version applies normally."""
        try:
            return super().poll()
        except ws.WeightSyncError as exc:  # IntegrityError included
            logger.warning("worker %s keeps version %d: %s", self.worker_idx, self.version, exc)
            return None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_actors"] = []  # the trainer's handles: the actors do not need them
        return state
