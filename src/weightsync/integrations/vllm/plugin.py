"""The ``vllm.general_plugins`` entry point: registers weightsync as the weight-transfer
backend ``"weightsync"`` (worker and trainer side) in every vLLM process.

vLLM may run plugins more than once per process, so registering twice is a no-op. The
engine classes are registered by module path: vLLM imports them only when selected."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND = "weightsync"
_MODULE = "weightsync.integrations.vllm.backend"


def register() -> None:
    """Make ``WeightTransferConfig(backend="weightsync")`` available to vLLM."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, class_name in ((WeightTransferEngineFactory, "WeightSyncWeightTransferEngine"),
                                (WeightTransferTrainerFactory, "WeightSyncTrainerEngine")):
        try:
            factory.register_engine(BACKEND, _MODULE, class_name)
        except ValueError:  # already registered in this process
            continue
    logger.debug("registered the %r vLLM weight-transfer backend", BACKEND)
