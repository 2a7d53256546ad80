"""weightsync: keep many workers' weights in sync with one trainer, fast and tear-free.

Every public name loads on first use, so ``import weightsync`` (and ``weightsync --help``)
costs no torch import, and ``ray`` stays an optional extra."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_LAZY: dict[str, str] = {
    "IntegrityError": "weightsync.core.errors",
    "SchemaMismatchError": "weightsync.core.errors",
    "SenderLostError": "weightsync.core.errors",
    "WeightSyncError": "weightsync.core.errors",
    "WeightSyncTimeoutError": "weightsync.core.errors",
    "WorkerDroppedError": "weightsync.core.errors",
    "WorkerLostError": "weightsync.core.errors",
    "TrainerRankLostError": "weightsync.core.errors",
    "LocalShard": "weightsync.core.shards",
    "Layout": "weightsync.core.layout",
    "WeightStrategy": "weightsync.core.strategy",
    "WeightReceiver": "weightsync.schemes.receiver",
    "WeightSender": "weightsync.schemes.sender",
    "WeightSyncScheme": "weightsync.schemes.base",
    "VLLMDoubleBufferSyncScheme": "weightsync.schemes.double_buffer",
    "VLLMDoubleBufferWeightReceiver": "weightsync.schemes.double_buffer",
    "VLLMDoubleBufferWeightSender": "weightsync.schemes.double_buffer",
    "MultiProcessWeightSyncScheme": "weightsync.schemes.multiprocess",
    "SharedMemWeightSyncScheme": "weightsync.schemes.shared_mem",
    "NetWeightSyncScheme": "weightsync.schemes.net",
    "TransportBackend": "weightsync.transports.base",
    "MPTransport": "weightsync.transports.mp.transport",
    "SharedMemTransport": "weightsync.transports.shm.transport",
    "RayWeightSyncScheme": "weightsync.schemes.ray",
    "RayWeightSender": "weightsync.schemes.ray",
    "RayWeightReceiver": "weightsync.schemes.ray",
    "RayTransport": "weightsync.transports.ray.transport",
    "RayWeightReceiverMixin": "weightsync.schemes.ray_actor",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from weightsync.core.errors import (
        IntegrityError,
        SchemaMismatchError,
        SenderLostError,
        TrainerRankLostError,
        WeightSyncError,
        WeightSyncTimeoutError,
        WorkerDroppedError,
        WorkerLostError,
    )
    from weightsync.core.layout import Layout
    from weightsync.core.shards import LocalShard
    from weightsync.core.strategy import WeightStrategy
    from weightsync.schemes.base import WeightSyncScheme
    from weightsync.schemes.double_buffer import (
        VLLMDoubleBufferSyncScheme,
        VLLMDoubleBufferWeightReceiver,
        VLLMDoubleBufferWeightSender,
    )
    from weightsync.schemes.multiprocess import MultiProcessWeightSyncScheme
    from weightsync.schemes.net import NetWeightSyncScheme
    from weightsync.schemes.ray import RayWeightReceiver, RayWeightSender, RayWeightSyncScheme
    from weightsync.schemes.ray_actor import RayWeightReceiverMixin
    from weightsync.schemes.receiver import WeightReceiver
    from weightsync.schemes.sender import WeightSender
    from weightsync.schemes.shared_mem import SharedMemWeightSyncScheme
    from weightsync.transports.base import TransportBackend
    from weightsync.transports.mp.transport import MPTransport
    from weightsync.transports.ray.transport import RayTransport
    from weightsync.transports.shm.transport import SharedMemTransport


def __getattr__(name: str) -> Any:
    """Import the module behind ``name`` on first use and cache the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *_LAZY})


__all__ = [
    "IntegrityError",
    "Layout",
    "LocalShard",
    "MPTransport",
    "MultiProcessWeightSyncScheme",
    "NetWeightSyncScheme",
    "RayTransport",
    "RayWeightReceiver",
    "RayWeightReceiverMixin",
    "RayWeightSender",
    "RayWeightSyncScheme",
    "SchemaMismatchError",
    "SenderLostError",
    "SharedMemTransport",
    "SharedMemWeightSyncScheme",
    "TrainerRankLostError",
    "TransportBackend",
    "VLLMDoubleBufferSyncScheme",
    "VLLMDoubleBufferWeightReceiver",
    "VLLMDoubleBufferWeightSender",
    "WeightReceiver",
    "WeightSender",
    "WeightStrategy",
    "WeightSyncError",
    "WeightSyncScheme",
    "WeightSyncTimeoutError",
    "WorkerDroppedError",
    "WorkerLostError",
    "__version__",
]
