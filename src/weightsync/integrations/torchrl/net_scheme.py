"""TorchRL's collectors on weightsync's network scheme: ``NetWeightSyncScheme`` for
collector workers on any host that reaches the trainer's address (TorchRL's distributed
collectors, or several machines without Ray), and on this host too."""

from __future__ import annotations

import torch
from torchrl.weight_update.weight_sync_schemes import register_weight_sync_backend

import weightsync as ws
from weightsync.integrations.torchrl.adapter import WeightsyncTorchRLScheme
from weightsync.schemes.net import DEFAULT_ADDRESS

#: the TorchRL backend name this scheme is registered under (``from_backend(name)``)
NET_BACKEND = "weightsync-net"


@register_weight_sync_backend(NET_BACKEND)
class NetWeightSyncScheme(WeightsyncTorchRLScheme):
    """A TorchRL ``WeightSyncScheme`` on :class:`weightsync.NetWeightSyncScheme`: the
    trainer listens at ``address`` (``HOST:PORT``; port 0: one chosen when the collector
    sets the scheme up), each worker host fetches each version once (``dtype``-cast,
    ``delta`` against the version it holds, authenticated), and each worker applies it
    whole at a batch start.

    Args: ``address``, ``dtype``, ``delta`` as weightsync's scheme; ``strategy``, ``sync``,
    ``timeout`` and ``connect_timeout`` as the other weightsync TorchRL schemes. One stream
    of versions for all workers: per-worker weights (``params_map``, ``device_map_fn``,
    distinct policy factories) need one port each, and are refused."""

    _weightsync_class = ws.NetWeightSyncScheme
    _per_worker_capable = False

    def __init__(self, address: str = DEFAULT_ADDRESS, strategy: str = "tensordict",
                 sync: bool = True, *, dtype: torch.dtype | None = None, delta: bool = False,
                 timeout: float = 60.0, connect_timeout: float = 300.0) -> None:
        super().__init__(strategy, sync, timeout=timeout, connect_timeout=connect_timeout)
        self.address = address
        self.dtype = dtype
        self.delta = bool(delta)

    def _new_weightsync_scheme(self, num_workers: int) -> ws.WeightSyncScheme:
        return ws.NetWeightSyncScheme(num_workers, self.address, dtype=self.dtype,
                                      delta=self.delta, timeout=self.timeout)
