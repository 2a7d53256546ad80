"""weightsync as a vLLM weight-transfer backend (``WeightTransferConfig(backend="weightsync")``).

Registered by the ``vllm.general_plugins`` entry point (``plugin.register``), which vLLM runs
in every one of its processes. The worker side (``WeightSyncWeightTransferEngine``,
``worker_engine``) loads versions from a ``VLLMDoubleBufferSyncScheme`` directory or, on
the network path, from its host's staging directory; the trainer side
(``WeightSyncTrainerEngine``, ``trainer_engine``) writes or publishes them and drives
vLLM's calls::

    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="weightsync"))
    llm.init_weight_transfer_engine({"init_info": {"directory": "/dev/shm/policy"}})
    # per update, after sender.update_weights() returned version v in the trainer:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": v}})
    llm.finish_weight_update(weight_version=str(v))

This module gathers the backend's public names where users import them. Importing it (or
``trainer_config``, where ``WeightSyncTrainerInitInfo`` lives) registers the backend with
vLLM's factories (``plugin.register``, idempotent), so a trainer process that is not a
vLLM process finds ``WeightTransferTrainerFactory.trainer_init``'s ``weightsync`` engine as
soon as it imports ``WeightSyncTrainerInitInfo``.
"""

from __future__ import annotations

from weightsync.integrations.vllm.offline_client import OfflineLLMClient
from weightsync.integrations.vllm.plugin import BACKEND, register
from weightsync.integrations.vllm.trainer_config import RANK_KEY_ENV, WeightSyncTrainerInitInfo
from weightsync.integrations.vllm.trainer_engine import WeightSyncTrainerEngine
from weightsync.integrations.vllm.worker_config import WeightSyncInitInfo, WeightSyncUpdateInfo
from weightsync.integrations.vllm.worker_engine import WeightSyncWeightTransferEngine
from weightsync.serving.sessions import ENDED_SESSIONS, ONE_TRAINER, checked_session

__all__ = [
    "BACKEND",
    "ENDED_SESSIONS",
    "ONE_TRAINER",
    "RANK_KEY_ENV",
    "OfflineLLMClient",
    "WeightSyncInitInfo",
    "WeightSyncTrainerEngine",
    "WeightSyncTrainerInitInfo",
    "WeightSyncUpdateInfo",
    "WeightSyncWeightTransferEngine",
    "checked_session",
    "register",
]

register()  # vLLM runs its plugins only in its own processes: a trainer's needs this
