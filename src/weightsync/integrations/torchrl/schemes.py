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

    Args: as TorchRL's (``strategy``, ``sync``, ``per_worker_weights``), plus ``timeout``
    (seconds, every send) and ``connect_timeout`` (workers start). ``per_worker_weights=True``
    (also taken for ``init_on_sender(params_map=...)``/``device_map_fn=`` and for distinct
    policy factories) gives each worker its own stream of versions: one weightsync scheme
    per worker, so a send packs once per worker it updates."""

    _weightsync_class = ws.SharedMemWeightSyncScheme

    def __init__(self, strategy: str = "tensordict", sync: bool = True,
                 per_worker_weights: bool = False, *, timeout: float = 60.0,
                 connect_timeout: float = 300.0) -> None:
        super().__init__(strategy, sync, timeout=timeout, connect_timeout=connect_timeout)
        self.per_worker_weights = bool(per_worker_weights)


@register_weight_sync_backend(PROCESS_BACKEND)
class MultiProcessWeightSyncScheme(WeightsyncTorchRLScheme):
    """TorchRL's ``MultiProcessWeightSyncScheme`` on weightsync's byte streams: each worker
    gets the snapshot's raw bytes over a socket (no shared memory), applied at a batch start.

    Args: as TorchRL's (``strategy``, ``sync``), plus ``timeout`` and ``connect_timeout``.
    ``init_on_sender(params_map=...)``/``device_map_fn=`` and distinct policy factories give
    each worker its own stream of versions (one weightsync scheme per worker)."""

    _weightsync_class = ws.MultiProcessWeightSyncScheme
