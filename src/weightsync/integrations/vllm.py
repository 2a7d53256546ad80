"""A vLLM worker extension that keeps an engine's weights in sync through a directory.

Use it through vLLM's documented extension points::

    llm = LLM(model=..., worker_extension_cls="weightsync.integrations.vllm.WeightSyncWorkerExtension")
    llm.collective_rpc("weightsync_connect", args=("/dev/shm/policy",))   # each worker: version 0
    ...                                                                   # trainer: sender.update_weights()
    llm.collective_rpc("weightsync_update")                               # apply the newest version

Each call streams ``(name, tensor)`` pairs from the committed slot into the model's
``load_weights``, which vLLM implements per architecture (fusing q/k/v, sharding for
tensor parallelism). Nothing here imports vLLM: the class is mixed into vLLM's worker.
"""

from __future__ import annotations

from typing import Any

from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
)


def _engine_model(worker: Any) -> Any:
    """The ``nn.Module`` a vLLM worker serves (``model_runner.model`` or ``get_model()``)."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None and runner is not None and hasattr(runner, "get_model"):
        model = runner.get_model()
    if model is None or not hasattr(model, "load_weights"):
        raise RuntimeError(
            "WeightSyncWorkerExtension needs a vLLM worker whose model_runner.model has "
            "load_weights(weights)"
        )
    return model


class WeightSyncWorkerExtension:
    """Methods added to each vLLM worker; call them with ``llm.collective_rpc(name, ...)``."""

    _weightsync_receiver: VLLMDoubleBufferWeightReceiver | None = None

    def weightsync_connect(
        self, directory: str, worker_idx: int | None = None, timeout: float = 60.0,
        num_workers: int | None = None,
    ) -> int:
        """Attach to ``directory`` and load the newest committed version; returns it.

        ``worker_idx`` defaults to this worker's rank, so each tensor-parallel rank acks on
        its own."""
        idx = int(getattr(self, "rank", 0) if worker_idx is None else worker_idx)
        scheme = VLLMDoubleBufferSyncScheme(
            directory, num_workers=max(num_workers or idx + 1, idx + 1), timeout=timeout
        )
        receiver = scheme.create_receiver(worker_idx=idx)
        receiver.register_loader(_engine_model(self).load_weights)
        version = receiver.connect(timeout=timeout)
        self._weightsync_receiver = receiver
        return version

    def weightsync_update(self, timeout: float | None = None) -> int | None:
        """Load the newest committed version if newer (``timeout``: wait up to that long for
        one); returns the version loaded, or None."""
        receiver = self._weightsync_receiver
        if receiver is None:
            raise RuntimeError("call weightsync_connect first (through collective_rpc)")
        return receiver.poll() if timeout is None else receiver.receive(timeout)

    def weightsync_version(self) -> int:
        """The version this worker's engine holds (-1 before connect)."""
        receiver = self._weightsync_receiver
        return -1 if receiver is None else receiver.version
