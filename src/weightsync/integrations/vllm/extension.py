"""The vLLM worker extension: methods mixed into every vLLM worker (``worker_extension_cls``)
and called by name through ``llm.collective_rpc``. Nothing here imports vLLM."""

from __future__ import annotations

import logging
import os
from typing import Any

from weightsync.core.checks import checked_int
from weightsync.core.errors import WeightSyncError
from weightsync.integrations.vllm.loading import EngineLoader
from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
)

logger = logging.getLogger(__name__)

EXTENSION_CLS = "weightsync.integrations.vllm.WeightSyncWorkerExtension"


def worker_rank(worker: Any) -> int:
    """This worker's index among all of an engine's workers (data-parallel replicas
    included): the receiver index it acknowledges under."""
    rank = int(getattr(worker, "rank", 0) or 0)
    config = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    if config is None:
        return rank
    replica = int(getattr(config, "data_parallel_index", 0) or 0)
    return replica * int(getattr(config, "world_size", 1) or 1) + rank


def engine_directory(directory: object) -> str:
    """The trainer's directory as an engine worker is told it: an absolute path (a worker's
    working directory is not the trainer's, so a relative one would name another place)."""
    if not isinstance(directory, (str, os.PathLike)) or not os.path.isabs(os.fspath(directory)):
        raise ValueError(f"the weightsync directory must be an absolute path (engine workers do "
                         f"not share the trainer's working directory), got {directory!r}")
    return os.fspath(directory)


def connect_receiver(
    worker: Any, directory: str, worker_idx: int | None, timeout: float, num_workers: int | None,
    worker_offset: int = 0,
) -> VLLMDoubleBufferWeightReceiver:
    """A receiver for ``worker`` on ``directory`` that loads through vLLM's reload path,
    connected: it holds the newest committed version (or raises within ``timeout``).
    Its index is ``worker_idx``, else ``worker_offset`` plus the worker's rank."""
    if worker_idx is None:
        idx = checked_int(worker_offset, "worker_offset", 0) + worker_rank(worker)
    else:
        idx = checked_int(worker_idx, "worker_idx")
    count = idx + 1 if num_workers is None else checked_int(num_workers, "num_workers", 1)
    scheme = VLLMDoubleBufferSyncScheme(
        engine_directory(directory), num_workers=max(count, idx + 1), timeout=timeout
    )
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_loader(EngineLoader(worker, f"vLLM worker {idx} ({directory})"))
    receiver.connect(timeout=timeout)
    return receiver


def apply_exact(receiver: VLLMDoubleBufferWeightReceiver, version: int,
                timeout: float | None) -> int:
    """Make ``receiver`` hold exactly ``version``: a no-op if it does, else load that
    committed version (``WeightSyncError`` if it is no longer in a slot)."""
    version = checked_int(version, "version")
    if receiver.version == version:
        return version
    return int(receiver.apply_version(version, timeout=timeout))


class WeightSyncWorkerExtension:
    """Methods added to each vLLM worker; call them with ``llm.collective_rpc(name, ...)``.

    ``weightsync_connect(directory)`` joins a trainer's directory and loads its newest
    committed version; ``weightsync_update()`` loads the newest version if it is newer
    (returns it, or None). For an update that also pauses generation, resets the prefix
    cache, labels the engine's ``weight_version`` and keeps tensor-parallel ranks on one
    version, call ``weightsync.integrations.vllm.update_engine(llm)`` from the driver."""

    _weightsync_receiver: VLLMDoubleBufferWeightReceiver | None = None

    def _weightsync(self) -> VLLMDoubleBufferWeightReceiver:
        receiver = self._weightsync_receiver
        if receiver is None:
            raise RuntimeError(
                f"vLLM worker {worker_rank(self)}: call weightsync_connect first "
                "(llm.collective_rpc('weightsync_connect', args=(directory,)))"
            )
        return receiver

    def weightsync_connect(
        self, directory: str, worker_idx: int | None = None, timeout: float = 60.0,
        num_workers: int | None = None, worker_offset: int = 0,
    ) -> int:
        """Attach to ``directory`` and load the newest committed version; returns it.

        ``worker_idx`` defaults to this worker's rank plus ``worker_offset`` (the ranks of
        the engines before this one, when several engines read one directory), so each
        rank acknowledges on its own. A model whose layout differs from the slots' raises
        ``SchemaMismatchError`` naming the key; no committed version within ``timeout``
        raises ``WeightSyncTimeoutError``."""
        receiver = connect_receiver(self, directory, worker_idx, timeout, num_workers,
                                    worker_offset)
        if self._weightsync_receiver is not None:  # replaced only once the new one holds a version
            self._weightsync_receiver.close()
        self._weightsync_receiver = receiver
        return receiver.version

    def weightsync_update(self, timeout: float | None = None) -> int | None:
        """Load the newest committed version if newer (``timeout``: wait up to that long for
        one); returns the version loaded, or None."""
        receiver = self._weightsync()
        return receiver.poll() if timeout is None else receiver.receive(timeout)

    def weightsync_version(self) -> int:
        """The version this worker's engine holds (-1 before connect)."""
        receiver = self._weightsync_receiver
        return -1 if receiver is None else receiver.version

    def weightsync_newest(self) -> int | None:
        """The newest version committed for this worker, without loading it."""
        return self._weightsync().newest_committed()

    def weightsync_apply(self, version: int, timeout: float | None = None) -> int:
        """Hold exactly ``version`` (load it unless held already); raises
        ``WeightSyncError`` if it is no longer in a slot."""
        return apply_exact(self._weightsync(), version, timeout)

    def weightsync_call(self, method: str, *args: Any) -> dict[str, Any]:
        """Run ``weightsync_<method>(*args)`` and report the outcome as data, so the driver
        can raise weightsync's own exception types (vLLM forwards worker errors as text)."""
        if method not in {"connect", "update", "version", "newest", "apply"}:
            raise ValueError(f"unknown weightsync method {method!r}")
        rank = worker_rank(self)
        try:
            return {"rank": rank, "ok": getattr(self, f"weightsync_{method}")(*args)}
        except WeightSyncError as exc:
            logger.warning("vLLM worker %d: weightsync_%s failed: %s", rank, method, exc)
            return {"rank": rank, "error": type(exc).__name__, "message": str(exc),
                    "key": getattr(exc, "key", None)}
