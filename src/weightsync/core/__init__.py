"""The transport-free core: layout, versions, errors, strategy, deadlines and stats."""

from weightsync.core.deadline import Deadline
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
from weightsync.core.layout import BucketSpec, Layout, TensorSpec
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION, VersionTable, WorkerState

__all__ = [
    "NO_VERSION",
    "BucketSpec",
    "Deadline",
    "IntegrityError",
    "Layout",
    "SchemaMismatchError",
    "SenderLostError",
    "TensorSpec",
    "TrainerRankLostError",
    "VersionTable",
    "WeightStrategy",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WorkerDroppedError",
    "WorkerLostError",
    "WorkerState",
    "flat_tensors",
]
