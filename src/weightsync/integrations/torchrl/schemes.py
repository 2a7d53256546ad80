"""TorchRL's same-host schemes on weightsync: ``SharedMemWeightSyncScheme`` and
``MultiProcessWeightSyncScheme``, for collector workers on the trainer's host."""

from __future__ import annotations

from torchrl.weight_update.weight_sync_schemes import register_weight_sync_backend

import weightsync as ws
from weightsync.integrations.torchrl.adapter import WeightsyncTorchRLScheme

#: the TorchRL backend names these schemes are registered under (``from_backend(name)``)
SHARED_BACKEND = "weightsync-shared"
PROCESS_BACKEND = "weightsync-process"


@register_weight_sync_backend(SHARED_BACKEND)
class SharedMemWeightSyncScheme(WeightsyncTorchRLScheme):
    """TorchRL's ``SharedMemWeightSyncScheme`` on weightsync's shared memory: a send packs a
    snapshot once into a free shared slot, workers copy a whole version at a batch start.

    Args: as TorchRL's (``strategy``, ``sync``, ``per_worker_weights`` which must stay
    False), plus ``timeout`` (seconds, every send) and ``connect_timeout`` (workers start)."""

    _weightsync_class = ws.SharedMemWeightSyncScheme

    def __init__(self, strategy: str = "tensordict", sync: bool = True,
                 per_worker_weights: bool = False, *, timeout: float = 60.0,
                 connect_timeout: float = 300.0) -> None:
        if per_worker_weights:
            raise ValueError(
                "per_worker_weights=True is not supported by weightsync: every worker receives "
                "the same versions (use worker_ids= to update a subset)")
        super().__init__(strategy, sync, timeout=timeout, connect_timeout=connect_timeout)
        self.per_worker_weights = False


@register_weight_sync_backend(PROCESS_BACKEND)
class MultiProcessWeightSyncScheme(WeightsyncTorchRLScheme):
    """TorchRL's ``MultiProcessWeightSyncScheme`` on weightsync's byte streams: each worker
    gets the snapshot's raw bytes over a socket (no shared memory), applied at a batch start.

    Args: as TorchRL's (``strategy``, ``sync``), plus ``timeout`` and ``connect_timeout``."""

    _weightsync_class = ws.MultiProcessWeightSyncScheme
