"""TorchRL collectors on weightsync: switch with one import line.

``from weightsync.integrations.torchrl import SharedMemWeightSyncScheme`` (or
``MultiProcessWeightSyncScheme``, ``NetWeightSyncScheme`` for workers on other hosts, or
``RayWeightSyncScheme`` for ``RayCollector``) in place
of ``from torchrl.weight_update import ...``: same names and constructor arguments,
subclasses of TorchRL's ``WeightSyncScheme`` (so a collector's
``weight_sync_schemes={"policy": scheme}`` accepts them), running on weightsync's own
schemes (``VLLMDoubleBufferSyncScheme`` for TorchRL's LLM stack: see docs/torchrl-llm.md).
Workers take a new version only at the start of a batch, through the collector's
``pre_collect_hook``, so every batch is produced by one whole version and its
``policy_version`` entries name it. Needs the ``torchrl`` extra; see docs/torchrl.md.
"""

try:
    import torchrl.weight_update  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torchrl
    raise ImportError(
        "weightsync.integrations.torchrl needs TorchRL: pip install 'weightsync[torchrl]'"
    ) from exc

from weightsync.integrations.torchrl.adapter import WeightsyncTorchRLScheme
from weightsync.integrations.torchrl.collector_hooks import materialize_meta_module
from weightsync.integrations.torchrl.llm import (
    VLLM_DOUBLE_BUFFER_BACKEND,
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
    VLLMDoubleBufferWeightSender,
    VLLMDoubleBufferWeightUpdater,
)
from weightsync.integrations.torchrl.net_scheme import NET_BACKEND, NetWeightSyncScheme
from weightsync.integrations.torchrl.ray_scheme import RAY_BACKEND, RayWeightSyncScheme
from weightsync.integrations.torchrl.schemes import (
    PROCESS_BACKEND,
    SHARED_BACKEND,
    MultiProcessWeightSyncScheme,
    SharedMemWeightSyncScheme,
)

__all__ = [
    "NET_BACKEND",
    "PROCESS_BACKEND",
    "RAY_BACKEND",
    "SHARED_BACKEND",
    "VLLM_DOUBLE_BUFFER_BACKEND",
    "MultiProcessWeightSyncScheme",
    "NetWeightSyncScheme",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "VLLMDoubleBufferSyncScheme",
    "VLLMDoubleBufferWeightReceiver",
    "VLLMDoubleBufferWeightSender",
    "VLLMDoubleBufferWeightUpdater",
    "WeightsyncTorchRLScheme",
    "materialize_meta_module",
]

