"""weightsync: keep many workers' weights in sync with one trainer, fast and tear-free."""

from typing import Any

from weightsync.core import (
    IntegrityError,
    Layout,
    SchemaMismatchError,
    SenderLostError,
    WeightStrategy,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.schemes import (
    MultiProcessWeightSyncScheme,
    SharedMemWeightSyncScheme,
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
    VLLMDoubleBufferWeightSender,
    WeightReceiver,
    WeightSender,
    WeightSyncScheme,
)
from weightsync.transports import MPTransport, SharedMemTransport, TransportBackend

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Ray names load on first use, so that ``ray`` stays an optional extra."""
    if name in ("RayWeightSyncScheme", "RayWeightSender", "RayWeightReceiver"):
        from weightsync.schemes import ray as ray_scheme

        return getattr(ray_scheme, name)
    if name == "RayTransport":
        from weightsync.transports.ray import RayTransport

        return RayTransport
    if name == "RayWeightReceiverMixin":
        from weightsync.integrations.ray import RayWeightReceiverMixin

        return RayWeightReceiverMixin
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")

__all__ = [
    "IntegrityError",
    "Layout",
    "MPTransport",
    "MultiProcessWeightSyncScheme",
    "RayTransport",
    "RayWeightReceiver",
    "RayWeightReceiverMixin",
    "RayWeightSender",
    "RayWeightSyncScheme",
    "SchemaMismatchError",
    "SenderLostError",
    "SharedMemTransport",
    "SharedMemWeightSyncScheme",
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
    "WorkerLostError",
    "__version__",
]
