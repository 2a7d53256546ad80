"""TorchRL's LLM weight sync on weightsync: ``VLLMDoubleBufferSyncScheme`` (the drop-in for
``torchrl.weight_update.llm.VLLMDoubleBufferSyncScheme``) and ``VLLMDoubleBufferWeightUpdater``
(for ``LLMCollector(weight_updater=...)``).

The trainer writes versions into weightsync's double-buffered directory (``remote_addr``);
the engine side drives a vLLM engine whose workers carry weightsync's extension
(``worker_extension_cls=EXTENSION_CLS``) through ``connect_engine`` / ``update_engine``:
pause, one version on every rank, prefix cache reset, ``weight_version`` label. A poll
returns False at once when nothing newer is committed and True only once every rank holds
the new version; a failure raises instead of being dropped. The engines it drives are in
``llm_engines.py``, the collector's updater in ``llm_collector.py`` (both re-exported here)."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torchrl.weight_update.weight_sync_schemes import (
    WeightSyncScheme as TorchRLWeightSyncScheme,
)
from torchrl.weight_update.weight_sync_schemes import register_weight_sync_backend

import weightsync as ws
from weightsync.core.deadline import required_timeout
from weightsync.integrations.torchrl.collector_hooks import flat_weights
from weightsync.integrations.torchrl.llm_collector import (
    VLLMDoubleBufferWeightUpdater,
    follow_engine_version,
    stamp_version,
)
from weightsync.integrations.torchrl.llm_engines import (
    AsyncVLLMDriver,
    engine_driver,
    is_async_vllm,
)
from weightsync.integrations.vllm.driver import connect_engine, engine_versions, update_engine
from weightsync.transports.directory.manifest import read_manifest

__all__ = [
    "VLLM_DOUBLE_BUFFER_BACKEND",
    "AsyncVLLMDriver",
    "VLLMDoubleBufferSyncScheme",
    "VLLMDoubleBufferWeightReceiver",
    "VLLMDoubleBufferWeightSender",
    "VLLMDoubleBufferWeightUpdater",
    "engine_driver",
    "follow_engine_version",
    "is_async_vllm",
    "stamp_version",
]

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
        self.timeout = required_timeout(timeout, "timeout")
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

