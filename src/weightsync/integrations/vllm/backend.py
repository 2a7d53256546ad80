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

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from weightsync.core.checks import checked_int
from weightsync.core.deadline import checked_timeout, positive_timeout
from weightsync.integrations.vllm.extension import apply_exact, engine_directory
from weightsync.integrations.vllm.loading import EngineLoader, Pairs
from weightsync.integrations.vllm.plugin import register
from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
    VLLMDoubleBufferWeightSender,
)

logger = logging.getLogger(__name__)

BACKEND = "weightsync"


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``llm.init_weight_transfer_engine``: the trainer's directory."""

    directory: str
    timeout: float = 60.0
    num_workers: int | None = None

    def __post_init__(self) -> None:
        """Checked once, as vLLM parses the dict: a bad field is a ValueError naming it."""
        self.directory = engine_directory(self.directory)
        self.timeout = positive_timeout(self.timeout, "init_info timeout")
        if self.num_workers is not None:
            self.num_workers = checked_int(self.num_workers, "init_info num_workers", 1)


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``llm.update_weights``: the committed version every rank loads
    (None: the newest committed one, as each rank reads it)."""

    version: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        """Versions are ints (3.9 or True is refused, never truncated); timeouts finite."""
        if self.version is not None:
            self.version = checked_int(self.version, "update_info version")
        self.timeout = checked_timeout(self.timeout, "update_info timeout")


def _worker_index() -> int:
    """This process's rank among the engine's workers (0 outside a distributed group)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:  # no group initialised: a single worker
        return 0


class WeightSyncWeightTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """The worker side: each update loads one committed version from the directory,
    checked against the served model's layout, through vLLM's layerwise reload."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_idx = _worker_index()
        self.receiver: VLLMDoubleBufferWeightReceiver | None = None

    def _reload(self, pairs: Pairs) -> None:
        initialize_layerwise_reload(self.model)
        model: Any = self.model  # a vLLM model: load_weights takes (name, tensor) pairs
        model.load_weights(pairs)
        finalize_layerwise_reload(self.model, self.model_config)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        """Attach to the directory and load its newest committed version (so a layout that
        does not fit the served model fails here, with ``SchemaMismatchError``)."""
        self.shutdown()
        idx = self.worker_idx
        scheme = VLLMDoubleBufferSyncScheme(
            init_info.directory, num_workers=max(init_info.num_workers or idx + 1, idx + 1),
            timeout=init_info.timeout,
        )
        receiver = scheme.create_receiver(worker_idx=idx)
        loader = EngineLoader(self, f"vLLM worker {idx} ({init_info.directory})", reload=self._reload,
                              hf_config=getattr(self.model_config, "hf_config", None))
        receiver.register_loader(loader)
        receiver.connect(timeout=init_info.timeout)
        self.receiver = receiver
        logger.info("worker %d joined %s at version %d", idx, init_info.directory, receiver.version)

    def start_weight_update(self) -> None:
        """Nothing to prepare: each version is loaded whole inside ``update_weights``."""
        self._receiver()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load the named version (no device synchronisation is needed on CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        receiver = self._receiver()
        version = update_info.version
        if version is None:
            version = receiver.newest_committed()
            if version is None:
                return
        apply_exact(receiver, version, update_info.timeout)

    def finish_weight_update(self) -> None:
        """Nothing to finalise: the version was loaded and post-processed whole."""

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    @property
    def version(self) -> int:
        """The version this worker holds (-1 before ``init_weight_transfer_engine``)."""
        return -1 if self.receiver is None else self.receiver.version

    def _receiver(self) -> VLLMDoubleBufferWeightReceiver:
        if self.receiver is None:
            raise RuntimeError(
                f"vLLM worker {self.worker_idx}: call llm.init_weight_transfer_engine("
                "{'init_info': {'directory': ...}}) before updating weights"
            )
        return self.receiver


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer side: where to write, in which dtype (e.g. "bfloat16"), for how many workers."""

    backend: ClassVar[str] = BACKEND
    directory: str = ""
    dtype: str | None = None
    timeout: float = 60.0
    num_workers: int = 1


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """The trainer side: commits each round's weights to the directory (rank 0 writes; the
    other ranks only iterate the source for its collectives), then tells vLLM which version
    to load."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender: VLLMDoubleBufferWeightSender | None = None
        self.version = -1

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightSyncTrainerEngine:
        if source is None:
            raise ValueError("the weightsync trainer engine needs a WeightSource (e.g. ModuleSource)")
        if not init_info.directory:
            raise ValueError("WeightSyncTrainerInitInfo.directory is required")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        weights = engine._materialise()
        if engine.is_sender:
            dtype = getattr(torch, init_info.dtype) if init_info.dtype else None
            scheme = VLLMDoubleBufferSyncScheme(init_info.directory, num_workers=init_info.num_workers,
                                                timeout=init_info.timeout, dtype=dtype)
            engine.sender = scheme.create_sender()
            engine.sender.register_model(weights)
            engine.version = engine.sender.update_weights(weights)
            client.init_weight_transfer_engine({
                "directory": init_info.directory, "timeout": init_info.timeout,
                "num_workers": init_info.num_workers,
            })
        return engine

    def _materialise(self) -> dict[str, torch.Tensor]:
        assert self.source is not None
        return {name: tensor.detach() for name, tensor in self.source}

    def send_weights(self) -> None:
        """Commit this round's weights, then have every vLLM worker load that version."""
        weights = self._materialise()
        if not self.is_sender:
            return
        assert self.sender is not None
        self.version = self.sender.update_weights(weights)
        self.client.start_weight_update()
        self.client.update_weights({"version": self.version})
        self.client.finish_weight_update(weight_version=str(self.version))

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


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
