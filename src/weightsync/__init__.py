"""weightsync: keep many workers' weights in sync with one trainer, fast and tear-free."""

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

__all__ = [
    "IntegrityError",
    "Layout",
    "MPTransport",
    "MultiProcessWeightSyncScheme",
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
