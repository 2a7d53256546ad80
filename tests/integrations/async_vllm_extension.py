"""The worker extension of the AsyncVLLM tests' engine: weightsync's methods plus TorchRL's
``load_weights_from_storage`` (what TorchRL's own double-buffer scheme calls), so both
schemes can be tried on one Ray-hosted engine. Imported inside the vLLM workers."""

from __future__ import annotations

from torchrl.modules.llm.backends.vllm.vllm_async import _AsyncvLLMWorker

from weightsync.integrations.vllm import WeightSyncWorkerExtension


class WeightSyncAndTorchRLExtension(WeightSyncWorkerExtension, _AsyncvLLMWorker):
    """weightsync's ``EXTENSION_CLS`` with TorchRL's ``_AsyncvLLMWorker`` method beside it."""


EXTENSION = f"{__name__}.{WeightSyncAndTorchRLExtension.__name__}"
