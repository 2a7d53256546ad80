"""weightsync as a vLLM weight-transfer backend (``WeightTransferConfig(backend="weightsync")``).

Registered by the ``vllm.general_plugins`` entry point (``plugin.register``), which vLLM runs
in every one of its processes. The worker side (``WeightSyncWeightTransferEngine``) reads
versions from a ``VLLMDoubleBufferSyncScheme`` directory; the trainer side
(``WeightSyncTrainerEngine``) writes them and drives vLLM's calls::

    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="weightsync"))
    llm.init_weight_transfer_engine({"init_info": {"directory": "/dev/shm/policy"}})
    # per update, after sender.update_weights() returned version v in the trainer:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": v}})
    llm.finish_weight_update(weight_version=str(v))

This module imports vLLM; the rest of the package does not. Importing it registers the
backend with vLLM's factories (``plugin.register``, idempotent), so a trainer process that
is not a vLLM process finds ``WeightTransferTrainerFactory.trainer_init``'s ``weightsync``
engine as soon as it imports ``WeightSyncTrainerInitInfo``.
"""

from __future__ import annotations

from typing import Any

from weightsync.integrations.vllm.plugin import BACKEND, register  # noqa: F401 (re-exported)
from weightsync.integrations.vllm.trainer_config import (  # noqa: F401 (re-exported)
    RANK_KEY_ENV,
    WeightSyncTrainerInitInfo,
)
from weightsync.integrations.vllm.trainer_engine import WeightSyncTrainerEngine  # noqa: F401
from weightsync.integrations.vllm.worker_engine import (  # noqa: F401 (re-exported)
    WeightSyncInitInfo,
    WeightSyncUpdateInfo,
    WeightSyncWeightTransferEngine,
)
from weightsync.serving.sessions import ENDED_SESSIONS, ONE_TRAINER, checked_session  # noqa: F401


class OfflineLLMClient:
    """vLLM's four-call weight-sync client protocol over an in-process ``LLM``, with the
    steps an update needs around it: pause generation ("wait": requests in flight finish
    on the old weights), and after loading, reset the prefix cache, set the version label
    and resume."""

    def __init__(self, llm: Any, mode: str = "wait") -> None:
        self.llm = llm
        self.mode = mode

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.llm.reset_prefix_cache()

    def start_weight_update(self) -> None:
        self.llm.sleep(level=0, mode=self.mode)
        try:
            self.llm.start_weight_update()
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def update_weights(self, update_info: Any) -> None:
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        try:
            self.llm.finish_weight_update(weight_version=weight_version)
            self.llm.reset_prefix_cache()
        finally:
            self.llm.wake_up(tags=["scheduling"])


register()  # vLLM runs its plugins only in its own processes: a trainer's needs this
