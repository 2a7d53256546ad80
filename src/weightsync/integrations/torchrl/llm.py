"""TorchRL's LLM weight sync on weightsync: ``VLLMDoubleBufferSyncScheme`` (the drop-in for
``torchrl.weight_update.llm.VLLMDoubleBufferSyncScheme``) and ``VLLMDoubleBufferWeightUpdater``
(for ``LLMCollector(weight_updater=...)``).

The trainer writes versions into weightsync's double-buffered directory (``remote_addr``);
the engine side drives a vLLM engine whose workers carry weightsync's extension
(``worker_extension_cls=EXTENSION_CLS``) through ``connect_engine`` / ``update_engine``:
pause, one version on every rank, prefix cache reset, ``weight_version`` label. A poll
returns False at once when nothing newer is committed and True only once every rank holds
the new version; a failure raises instead of being dropped."""

from __future__ import annotations

import asyncio
import logging
import os
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torchrl.collectors.weight_update import WeightUpdaterBase
from torchrl.weight_update.weight_sync_schemes import (
    WeightSyncScheme as TorchRLWeightSyncScheme,
)
from torchrl.weight_update.weight_sync_schemes import register_weight_sync_backend

import weightsync as ws
from weightsync.integrations.torchrl.collector_hooks import flat_weights
from weightsync.integrations.vllm.driver import connect_engine, engine_versions, update_engine
from weightsync.transports.directory.manifest import read_manifest

logger = logging.getLogger(__name__)

#: the TorchRL backend name the scheme is registered under (``from_backend(name, ...)``)
VLLM_DOUBLE_BUFFER_BACKEND = "weightsync-vllm-double-buffer"

#: TorchRL's config fields for this scheme (``VLLMDoubleBufferSyncSchemeConfig``)
_CONFIG_FIELDS = ("remote_addr", "local_addr", "num_threads", "strategy")


@register_weight_sync_backend(VLLM_DOUBLE_BUFFER_BACKEND)
class VLLMDoubleBufferSyncScheme(TorchRLWeightSyncScheme):
    """TorchRL's ``VLLMDoubleBufferSyncScheme`` on weightsync's double-buffered directory.

    Args: as TorchRL's. ``remote_addr``: the directory the trainer writes (created 0700 if
    absent); ``local_addr``: where the engine reads it (another mount of the same directory;
    default ``remote_addr``); ``num_threads``: accepted for compatibility (slots are written
    and read by one thread each); ``strategy``: TorchRL's weight extraction strategy.
    Keyword-only extras: ``num_workers`` (ranks of the engine, tensor x data parallel;
    each acknowledges on its own), ``timeout`` (seconds for a send or an engine update)
    and ``dtype`` (cast floating-point weights on the way, e.g. ``torch.bfloat16``)."""

    def __init__(
        self,
        remote_addr: str | os.PathLike[str],
        local_addr: str | os.PathLike[str] | None = None,
        num_threads: int = 1,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
        *,
        num_workers: int = 1,
        timeout: float = 60.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        if remote_addr is None:
            raise ValueError("remote_addr (the weights directory) is required")
        super().__init__(strategy)
        if int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self.remote_addr = os.fspath(remote_addr)
        self.local_addr = os.fspath(local_addr) if local_addr is not None else self.remote_addr
        self.num_threads = int(num_threads)
        self.strategy_name = strategy
        self.num_workers = int(num_workers)
        self.timeout = float(timeout)
        self.dtype = dtype

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> VLLMDoubleBufferSyncScheme:
        """Build from TorchRL's ``VLLMDoubleBufferSyncSchemeConfig`` (or its dict / Hydra
        node): its ``remote_addr``, ``local_addr``, ``num_threads`` and ``strategy``."""
        if is_dataclass(config) and not isinstance(config, type):
            fields: Mapping[str, Any] = asdict(config)
        elif isinstance(config, Mapping):
            fields = config
        else:
            fields = {k: getattr(config, k) for k in _CONFIG_FIELDS if hasattr(config, k)}
        kwargs = {k: fields[k] for k in _CONFIG_FIELDS if k in fields}
        return cls(**{**kwargs, **overrides})

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(remote_addr={self.remote_addr!r}, "
                f"local_addr={self.local_addr!r}, num_workers={self.num_workers})")

    def weightsync_scheme(self, directory: str | None = None) -> ws.VLLMDoubleBufferSyncScheme:
        """The weightsync scheme on ``directory`` (default: the trainer's ``remote_addr``)."""
        return ws.VLLMDoubleBufferSyncScheme(directory or self.remote_addr,
                                             num_workers=self.num_workers,
                                             timeout=self.timeout, dtype=self.dtype)

    def create_transport(self, **kwargs: Any) -> ws.VLLMDoubleBufferSyncScheme:
        """TorchRL's abstract hook: the weightsync scheme that moves the bytes."""
        return self.weightsync_scheme()

    def create_sender(self) -> VLLMDoubleBufferWeightSender:
        """The trainer's end: ``register_model(model)``, then ``update_weights()``."""
        return VLLMDoubleBufferWeightSender(self)

    def create_receiver(self, vllm_engine: Any) -> VLLMDoubleBufferWeightReceiver:
        """The engine's end, for a ``vllm.LLM`` (or TorchRL ``AsyncVLLM``) whose workers
        carry ``weightsync.integrations.vllm.EXTENSION_CLS``."""
        return VLLMDoubleBufferWeightReceiver(self, vllm_engine)


def _trainer_module(model: Any) -> Any:
    """The module whose weights the engine serves: a TorchRL ``TransformersWrapper`` holds
    the transformers model in ``.model``, whose names are the ones vLLM loads."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module) and type(model).__name__ == "TransformersWrapper":
        return inner
    return model


class VLLMDoubleBufferWeightSender:
    """Writes versions of the trainer's model into the scheme's directory (weightsync's
    sender: a free slot, then an atomic commit). Keep it open while engines read; close it
    (or use it as a context manager) when training ends."""

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme) -> None:
        self._scheme = scheme
        self._model_ref: weakref.ReferenceType[Any] | None = None
        self._sender: ws.VLLMDoubleBufferWeightSender | None = None

    @property
    def version(self) -> int:
        """The newest version committed by this sender (-1 before the first)."""
        return -1 if self._sender is None else self._sender.version

    def register_model(self, model: Any) -> None:
        """Send ``model``'s weights at each ``update_weights()`` (held by weak reference,
        as TorchRL's sender holds it)."""
        module = _trainer_module(model)
        self._model_ref = weakref.ref(module)
        if self._sender is None:
            self._sender = self._scheme.weightsync_scheme().create_sender()
        self._sender.register_model(module)
        logger.info("trainer model registered for %s", self._scheme.remote_addr)

    def update_weights(self, weights: Any = None) -> int:
        """Commit the registered model's weights (or ``weights``: a module, TensorDict or
        state dict) as the next version; returns it without waiting for any engine."""
        if self._sender is None:
            raise RuntimeError("call register_model(model) before update_weights()")
        if self._model_ref is not None and self._model_ref() is None and weights is None:
            raise RuntimeError("the registered model was garbage-collected")
        if weights is not None:
            weights = flat_weights(_trainer_module(weights), "update_weights(weights=...)")
        return self._sender.update_weights(weights)

    def close(self) -> None:
        """Stop sending (engines keep the version they hold); safe to call twice."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def __enter__(self) -> VLLMDoubleBufferWeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_async_vllm(engine: Any) -> bool:
    """Whether ``engine`` is TorchRL's Ray-hosted ``AsyncVLLM``."""
    return type(engine).__name__ == "AsyncVLLM" and hasattr(engine, "actors")


class VLLMDoubleBufferWeightReceiver:
    """Brings a vLLM engine to the trainer's newest version. The first apply connects every
    worker to the directory (``connect_engine``); later ones run ``update_engine``."""

    def __init__(self, scheme: VLLMDoubleBufferSyncScheme, vllm_engine: Any) -> None:
        self._scheme = scheme
        self._directory = Path(scheme.local_addr).absolute()
        self._engine = engine_driver(vllm_engine)
        self._version = -1

    @property
    def version(self) -> int:
        """The version every rank of the engine holds (-1 before the first apply)."""
        return self._version

    def engine_versions(self) -> list[int]:
        """The version each rank holds, asked of the workers (-1: not connected)."""
        return engine_versions(self._engine)

    def poll_and_apply(self, timeout: float = 180.0) -> bool:
        """Load the newest committed version if it is newer than the engine's; True once
        every rank holds it, False at once if nothing newer is committed. Raises if a rank
        cannot load it (after realigning all ranks on one version)."""
        return self.apply_weights(timeout=timeout) is not None

    def apply_weights(self, weights: Any = None, inplace: bool = True, *,
                      timeout: float = 180.0) -> int | None:
        """Bring every rank to ``weights`` (a committed version number; default: the
        newest); returns the version loaded, or None if the engine holds it already.
        Tensors are not accepted: they reach the engine through the directory
        (``sender.update_weights(weights)``), so every rank loads the same checked bytes."""
        if not inplace:
            raise ValueError("vLLM engines load weights in place (inplace=False is impossible)")
        if weights is not None and not isinstance(weights, int):
            raise TypeError(
                "apply_weights takes a committed version number (or None for the newest), "
                f"got {type(weights).__name__}: commit tensors with "
                "scheme.create_sender().update_weights(weights) first")
        manifest = read_manifest(self._directory)
        if manifest is None:
            return None  # nothing committed yet
        if self._version < 0:
            held = connect_engine(self._engine, str(self._directory), timeout=timeout)
            self._version = held
            if weights is None or weights == held:
                return held
        version = update_engine(self._engine, weights, timeout=timeout)
        if version is not None:
            self._version = version
        return version


# ============================================================== engines
def engine_driver(engine: Any) -> Any:
    """What ``connect_engine`` / ``update_engine`` drive for ``engine``: a ``vllm.LLM``
    itself, TorchRL's ``AsyncVLLM`` through a driver that fans each call out to its
    Ray-hosted replicas."""
    if is_async_vllm(engine):
        return AsyncVLLMDriver(engine)
    missing = [m for m in ("collective_rpc", "reset_prefix_cache", "sleep", "wake_up")
               if not callable(getattr(engine, m, None))]
    if missing:
        raise TypeError(f"{type(engine).__name__} is not a vllm.LLM or TorchRL AsyncVLLM "
                        f"(it lacks {missing})")
    return engine


class AsyncVLLMDriver:
    """TorchRL's ``AsyncVLLM`` seen as one engine by ``connect_engine`` / ``update_engine``:
    each call runs on every Ray actor (replica), worker results in replica-major order.

    Worker calls go through the actors' ``collective_rpc_v1``; replica ``r``'s ranks
    acknowledge as ``r * ranks_per_replica + rank``. Pause, resume and the
    ``weight_version`` label are vLLM ``AsyncLLM`` calls run on each actor's own event loop
    (TorchRL's actors expose ``sleep(level)`` without vLLM's pause mode), so requests in
    flight drain on the old weights (``mode="wait"``) rather than being aborted."""

    def __init__(self, engine: Any, timeout: float = 300.0) -> None:
        import ray

        self._ray = ray
        self.engine = engine
        self.actors = list(engine.actors)
        if not self.actors:
            raise RuntimeError("the AsyncVLLM has no replica actors (not launched, or shut down)")
        args = engine.engine_args
        self.ranks_per_replica = (int(getattr(args, "tensor_parallel_size", 1) or 1)
                                  * int(getattr(args, "pipeline_parallel_size", 1) or 1)
                                  * int(getattr(args, "data_parallel_size", 1) or 1))
        self.timeout = float(timeout)

    @property
    def world_size(self) -> int:
        """All ranks of all replicas: each acknowledges versions under its own index."""
        return len(self.actors) * self.ranks_per_replica

    def _all(self, method: str, *args: Any) -> list[Any]:
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        return list(self._ray.get(refs, timeout=self.timeout))

    def _engine_all(self, method: str, **kwargs: Any) -> list[Any]:
        """``await actor.engine.<method>(**kwargs)`` (vLLM's ``AsyncLLM``) on every replica,
        on the event loop its engine runs on; each replica's result."""
        refs = [actor.__ray_call__.remote(_run_on_engine_loop, method, kwargs, self.timeout)
                for actor in self.actors]
        return list(self._ray.get(refs, timeout=self.timeout + 10.0))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Run ``method`` on every worker of every replica; ranks are made engine-wide (and
        a ``connect`` tells each replica's workers the ranks before theirs)."""
        connect = method == "weightsync_call" and bool(args) and args[0] == "connect"
        refs = []
        for replica, actor in enumerate(self.actors):
            call_args = args
            if connect:  # ("connect", directory, worker_idx, timeout, num_workers[, offset])
                call_args = (*args[:5], *[None] * (5 - len(args)),
                             replica * self.ranks_per_replica)
            refs.append(actor.collective_rpc_v1.remote(method, None, call_args, None))
        out: list[Any] = []
        for replica, results in enumerate(self._ray.get(refs, timeout=self.timeout)):
            for result in results:
                if isinstance(result, dict) and "rank" in result:
                    rank = replica * self.ranks_per_replica + int(result["rank"])
                    result = {**result, "rank": rank}
                out.append(result)
        return out

    def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache; warns where vLLM reports it only partly
        cleared (blocks still held by requests in flight)."""
        for replica, cleared in enumerate(self._all("reset_prefix_cache")):
            if cleared is False:
                logger.warning("AsyncVLLM replica %d: prefix cache not fully reset", replica)

    def sleep(self, level: int = 0, mode: str = "wait") -> None:
        """vLLM's pause on every replica (``level=0``: stop scheduling, keep the KV cache;
        ``mode``: drain requests in flight, or abort them)."""
        self._engine_all("sleep", level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume every replica (``tags=["scheduling"]`` after a ``level=0`` pause)."""
        self._all("wake_up", tags)

    def update_weight_version(self, version: str) -> None:
        """Label every replica's engine with ``version`` (vLLM's ``weight_version``)."""
        self._engine_all("update_weight_version", new_version=version)

    def get_weight_version(self) -> list[str]:
        """Each replica's ``weight_version`` label."""
        return [str(v) for v in self._engine_all("get_weight_version")]


def _engine_loop(engine: Any) -> asyncio.AbstractEventLoop | None:
    """The event loop a vLLM ``AsyncLLM`` runs its tasks on (its output handler's, else its
    engine-core client's: started by the first request or RPC); None before either."""
    core = getattr(getattr(engine, "engine_core", None), "resources", None)
    for task in (getattr(engine, "output_handler", None), getattr(core, "output_queue_task", None)):
        if isinstance(task, asyncio.Future):
            return task.get_loop()
    return None


def _run_on_engine_loop(actor: Any, method: str, kwargs: dict[str, Any], timeout: float) -> Any:
    """Inside a replica actor (``__ray_call__``, which Ray runs off the actor's event loop):
    ``await actor.engine.<method>(**kwargs)`` on the engine's loop; its result."""
    loop = _engine_loop(actor.engine)
    if loop is None:
        raise RuntimeError("this AsyncVLLM replica's engine has no event loop yet "
                           "(no request or RPC reached it)")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("called on the engine's own event loop: it cannot wait for itself")
    future = asyncio.run_coroutine_threadsafe(getattr(actor.engine, method)(**kwargs), loop)
    return future.result(timeout)


# ============================================================== collector
with warnings.catch_warnings():  # TorchRL deprecates subclassing; LLMCollector still needs it
    warnings.simplefilter("ignore", DeprecationWarning)

    class VLLMDoubleBufferWeightUpdater(WeightUpdaterBase):
        """``LLMCollector(weight_updater=...)`` on the scheme: ``update_policy_weights_()``
        brings the engine to the trainer's newest committed version, and the collector's
        ``policy_version`` (``track_policy_version=True``) is the version the engine holds,
        stamped before each batch so every frame names the version that generated it.

        ``update_policy_weights_(weights)`` first commits ``weights`` (needs ``sender=``)."""

        def __init__(self, scheme: VLLMDoubleBufferSyncScheme, vllm_engine: Any, *,
                     sender: VLLMDoubleBufferWeightSender | None = None,
                     timeout: float | None = None) -> None:
            self.scheme = scheme
            self.receiver = scheme.create_receiver(vllm_engine)
            self.sender = sender
            self.timeout = scheme.timeout if timeout is None else float(timeout)

        @property
        def version(self) -> int:
            """The version the engine holds (-1 before the first update)."""
            return self.receiver.version

        def _push_weights(self, *, policy_or_weights: Any = None,
                          worker_ids: Any = None) -> None:
            if policy_or_weights is not None:
                if self.sender is None:
                    raise ValueError(
                        "update_policy_weights_(weights) commits them first: build the "
                        "updater with sender=scheme.create_sender() (or commit with the "
                        "sender and call update_policy_weights_() with no argument)")
                self.sender.update_weights(policy_or_weights)
            self._sync_weights_with_worker(server_weights=None)

        def _sync_weights_with_worker(self, *, worker_id: Any = None,
                                      server_weights: Any = None) -> None:
            version = self.receiver.apply_weights(timeout=self.timeout)
            if version is not None:
                logger.info("LLMCollector engine now holds version %d", version)
            for collector in self.collectors or []:
                if collector is not None:
                    stamp_version(collector, self.receiver.version)

        def register_collector(self, collector: Any) -> None:
            """Register ``collector``; its version tracker follows the engine's version
            (not a count of updates), stamped before each of its batches."""
            super().register_collector(collector)
            follow_engine_version(collector, self)


def stamp_version(collector: Any, version: int) -> None:
    """Make ``collector``'s ``PolicyVersion`` read ``version``, the frame it will collect
    next included: that one was stamped by the env step that ended the previous batch."""
    tracker = getattr(collector, "policy_version_tracker", None)
    if tracker is None or version < 0 or not hasattr(tracker, "version"):
        return
    as_int = getattr(tracker, "version_type", int) in (int, "int")
    tracker.version = int(version) if as_int else str(version)
    shuttle = getattr(collector, "_shuttle", None)
    if as_int and shuttle is not None and "policy_version" in shuttle:
        held = shuttle.get("policy_version")
        shuttle.set("policy_version", torch.full_like(held, int(version)))


def follow_engine_version(collector: Any, updater: VLLMDoubleBufferWeightUpdater) -> None:
    """Replace ``collector``'s per-update counter with the engine's version: its
    ``increment_version`` (run after every ``update_policy_weights_``, even one that
    loaded nothing) and each batch start now stamp the version the engine holds."""
    ref = weakref.ref(updater)

    def increment_version() -> None:
        owner = ref()
        if owner is not None:
            stamp_version(collector, owner.version)

    collector.increment_version = increment_version
    original = collector.iterator

    def iterator() -> Iterator[Any]:
        batches = original()
        while True:
            owner = ref()
            if owner is not None:
                stamp_version(collector, owner.version)
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    collector.iterator = iterator
