"""LoRA adapter versions into a vLLM engine: ``update_adapter(llm, directory)``.

A trainer with ``VLLMDoubleBufferSyncScheme(directory, adapter="policy")`` commits each
adapter version as an ordinary slot (peft's saved names, the config in the slot's header).
vLLM loads adapters from a directory path, and may load one again later (its CPU cache
evicts and reloads), so each version is copied, under the slot's read lock and verified by
checksum, into a private per-version directory (``adapter_model.safetensors`` +
``adapter_config.json``) that stays until that version is removed from the engine. The
trainer never waits for the engine: it writes other slots meanwhile.

Each version is served under its own name (``policy-v7``): vLLM keys its prefix cache by
adapter, so no block computed with another version is reused. Nothing here imports vLLM
until a request is built.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.core.checks import checked_int
from weightsync.core.deadline import Deadline, required_timeout
from weightsync.core.errors import WeightSyncError, WeightSyncTimeoutError
from weightsync.integrations.vllm.extension import engine_directory
from weightsync.serving.adapter_copy import stage_adapter
from weightsync.transports.directory.files import DEFAULT_FILE_MODE
from weightsync.transports.directory.reader import DirectoryReader

logger = logging.getLogger(__name__)

_POLL_S = 0.005


@dataclass
class _Loaded:
    """One adapter version registered in the engine, and the files it loads from."""

    directory: str
    version: int
    request: Any  # vllm.lora.request.LoRARequest
    path: Path


@dataclass
class _EngineAdapters:
    """What one engine holds: a reader per directory it was pointed at (its slots stay
    mapped), the loaded versions (oldest first) and the private directory their files
    live in."""

    files: Path
    readers: dict[tuple[str, int], DirectoryReader] = field(default_factory=dict)
    loaded: list[_Loaded] = field(default_factory=list)
    next_id: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reader(self, directory: str, worker_idx: int) -> DirectoryReader:
        """The reader of ``directory`` as worker ``worker_idx`` (versions loaded from
        another directory stay until a version of this one replaces them)."""
        key = (directory, worker_idx)
        if key not in self.readers:
            self.readers[key] = DirectoryReader(Path(directory), worker_idx,
                                                mode=DEFAULT_FILE_MODE)
        return self.readers[key]

    def serving(self, directory: str, version: int) -> _Loaded | None:
        newest = self.loaded[-1] if self.loaded else None
        if newest is not None and (newest.directory, newest.version) == (directory, version):
            return newest
        return None


_engines: weakref.WeakKeyDictionary[Any, _EngineAdapters] = weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def _files_root() -> str | None:
    """Where the per-version copies go: /dev/shm where there is one (RAM, like the slots)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _state(llm: Any) -> _EngineAdapters:
    with _engines_lock:
        state = _engines.get(llm)
        if state is None:
            files = Path(tempfile.mkdtemp(prefix="weightsync-lora-", dir=_files_root()))
            state = _engines[llm] = _EngineAdapters(files)
            weakref.finalize(llm, shutil.rmtree, files, True)  # also run at exit
        return state


def _lora_config(llm: Any) -> Any:
    engine = getattr(llm, "llm_engine", None)
    config = getattr(getattr(engine, "vllm_config", None), "lora_config", None)
    if config is None:
        raise RuntimeError("update_adapter needs an engine with LoRA enabled: "
                           "vllm.LLM(..., enable_lora=True, max_lora_rank=R)")
    return config


def update_adapter(llm: Any, directory: str, *, timeout: float = 60.0, keep: int = 1,
                   worker_idx: int = 0) -> Any:
    """Load the newest committed adapter version of ``directory`` into ``llm`` (a
    ``vllm.LLM(enable_lora=True, ...)``) and return the ``LoRARequest`` to generate with.

    The version is served as ``<adapter>-v<version>``; older versions are removed from the
    engine (so that no more than ``max_loras`` are ever registered; once the new one is
    loaded, only the newest ``keep`` stay) and their files deleted. A call when the engine
    already serves the newest version returns its request again. Waits up to ``timeout``
    for a first commit (``WeightSyncTimeoutError``); an adapter of a higher rank than the
    engine's ``max_lora_rank`` raises ``AdapterRankError`` before anything is copied or
    loaded. ``worker_idx``: the index this engine acknowledges under (the trainer's
    ``connect()`` waits for it)."""
    deadline = Deadline(required_timeout(timeout, "timeout"))
    keep = checked_int(keep, "keep", 1)
    lora_config = _lora_config(llm)
    max_loras = int(lora_config.max_loras)
    if keep > max_loras:
        raise ValueError(f"keep={keep} is more adapter versions than the engine's "
                         f"max_loras={max_loras}")
    directory = engine_directory(directory)
    worker_idx = checked_int(worker_idx, "worker_idx")
    state = _state(llm)
    with state.lock:
        reader = state.reader(directory, worker_idx)
        while True:
            manifest = reader.manifest()
            if manifest is not None:
                commit = manifest.for_worker(worker_idx)
                current = state.serving(directory, commit.version)
                if current is not None:
                    reader.ack(commit.version)
                    return current.request
                # named by the LoRA id too: one directory per load, never shared nor reused
                # (two trainers may both call their adapter "policy"); vLLM's prefix cache
                # keys on the path as well as the name, so no cached block crosses two loads
                staged = stage_adapter(reader, state.files, commit, int(lora_config.max_lora_rank),
                                       f"v{commit.version}.{state.next_id}")
                if staged is not None:
                    break
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"no adapter version could be read from {directory} within {deadline} "
                    + ("(nothing committed)" if manifest is None else "(its slot stayed locked)"))
            time.sleep(deadline.slice(_POLL_S))
        name, path = staged
        _evict(llm, state, keep=max_loras - 1)  # room for the new one: never above max_loras
        request = _lora_request(f"{name}-v{commit.version}", state.next_id, str(path))
        state.next_id += 1
        try:
            if not llm.llm_engine.add_lora(request):
                raise WeightSyncError(f"vLLM refused adapter {request.lora_name} from {path}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        state.loaded.append(_Loaded(directory, commit.version, request, path))
        _evict(llm, state, keep=keep)
        reader.ack(commit.version)
    logger.info("vLLM engine serves adapter %s (%d version(s) loaded)", request.lora_name,
                len(state.loaded))
    return request


def _lora_request(name: str, lora_id: int, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def _evict(llm: Any, state: _EngineAdapters, keep: int) -> None:
    """Remove all but the newest ``keep`` versions from the engine, then their files."""
    while len(state.loaded) > keep:
        old = state.loaded.pop(0)
        try:
            llm.llm_engine.remove_lora(old.request.lora_int_id)
        except Exception as exc:  # an engine shut down holds nothing; else say so
            logger.warning("could not remove adapter %s from the engine (%s); its files are "
                           "deleted", old.request.lora_name, exc)
        shutil.rmtree(old.path, ignore_errors=True)
        logger.debug("evicted adapter %s", old.request.lora_name)


def adapter_versions(llm: Any) -> list[int]:
    """The adapter versions ``update_adapter`` has loaded into ``llm``, oldest first."""
    state = _engines.get(llm)
    return [] if state is None else [entry.version for entry in state.loaded]
