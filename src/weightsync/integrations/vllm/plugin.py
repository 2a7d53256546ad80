"""The ``vllm.general_plugins`` entry point: registers weightsync as the weight-transfer
backend ``"weightsync"`` (worker and trainer side) in every vLLM process.

vLLM may run plugins more than once per process, so registering twice is a no-op. The
engine classes are registered by module path: vLLM imports them only when selected."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

BACKEND = "weightsync"
#: each side's engine class, by module path (vLLM imports the module when it is selected)
_WORKER_ENGINE = ("weightsync.integrations.vllm.worker_engine", "WeightSyncWeightTransferEngine")
_TRAINER_ENGINE = ("weightsync.integrations.vllm.trainer_engine", "WeightSyncTrainerEngine")
#: the vLLM module that holds the weight-transfer factories
FACTORY_MODULE = "vllm.distributed.weight_transfer.factory"


def register() -> None:
    """Make ``WeightTransferConfig(backend="weightsync")`` available to vLLM."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(BACKEND, *_WORKER_ENGINE)
    with contextlib.suppress(ValueError):
        WeightTransferTrainerFactory.register_engine(BACKEND, *_TRAINER_ENGINE)
    logger.debug("registered the %r vLLM weight-transfer backend", BACKEND)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when vLLM's factory module is imported, it hands back that
    module's own spec with a loader that registers the backend right after the module ran
    (so importing weightsync before vLLM costs no vLLM import, and still registers)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != FACTORY_MODULE:
            return None
        remove_hook()
        spec = None
        for finder in list(sys.meta_path):  # the finder that would have found it (pip's
            find = getattr(finder, "find_spec", None)  # editable installs add their own)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                register()
            except Exception as exc:  # a vLLM without the factories: say why, import on
                logger.warning("could not register the %r vLLM weight-transfer backend: %s",
                               BACKEND, exc)

        loader.exec_module = exec_module
        return spec


def register_when_imported() -> None:
    """Register the backend now if vLLM's factories are imported, else as soon as they are
    (a finder on ``sys.meta_path`` that removes itself once it fired)."""
    if FACTORY_MODULE in sys.modules:
        register()
        return
    if not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


def remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterOnImport)]

