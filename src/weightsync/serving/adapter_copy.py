"""One LoRA adapter version copied out of its double-buffer slot, under the slot's read lock
and verified by checksum, into the files a LoRA loader reads (peft's
``adapter_model.safetensors`` and ``adapter_config.json``), in a new directory of its own.
Used by the in-process engine's adapters and by a server host's adapter files alike.
Nothing here imports an inference engine."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

from weightsync.core.errors import AdapterRankError, WeightSyncError
from weightsync.schemes.lora import ADAPTER_CONFIG_KEY, ADAPTER_NAME_KEY, adapter_rank
from weightsync.transports.directory.files import fsync_directory, open_regular
from weightsync.transports.directory.manifest import Commit, SlotFile
from weightsync.transports.directory.reader import DirectoryReader

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def stage_adapter(reader: DirectoryReader, files: Path, commit: Commit, max_rank: int,
                  label: str) -> tuple[str, Path] | None:
    """Copy ``commit``'s slot, under its read lock and verified, into the new directory
    ``files/<adapter name>-<label>`` (kept as it is if it exists: one label, one version);
    returns (adapter name, directory), or None if the slot is busy or the version left it
    (the caller reads the manifest again). An adapter above ``max_rank`` raises
    ``AdapterRankError`` before anything is copied."""
    with reader.locked(commit) as slot:
        if slot is None:
            return None
        name, config = _adapter_of(slot, commit.version)
        rank = adapter_rank(config)
        if rank > max_rank:
            raise AdapterRankError(
                f"adapter {name} version {commit.version} has rank {rank}, above the engine's "
                f"max_lora_rank={max_rank}: start vLLM with max_lora_rank >= {rank} (nothing "
                "was loaded)", rank=rank, max_rank=max_rank)
        final = files / f"{name}-{label}"
        if final.is_dir() and not final.is_symlink():
            return name, final
        return name, _copy_version(files, final.name, slot, config)


def _adapter_of(slot: SlotFile, version: int) -> tuple[str, dict[str, Any]]:
    name = slot.metadata.get(ADAPTER_NAME_KEY)
    raw = slot.metadata.get(ADAPTER_CONFIG_KEY)
    if name is None or raw is None:
        raise WeightSyncError(
            f"version {version} in {slot.path} is not an adapter (its trainer's scheme has no "
            "adapter=...): load full weights with connect_engine/update_engine instead")
    try:
        config = json.loads(raw)
        if not isinstance(config, dict):
            raise ValueError("not an object")
        adapter_rank(config)
    except (ValueError, TypeError) as exc:
        raise WeightSyncError(f"{slot.path}: the adapter config is malformed ({exc})") from None
    return name, config


def _copy_version(files: Path, name: str, slot: SlotFile, config: dict[str, Any]) -> Path:
    """Write the slot's bytes (a whole safetensors file) and the config into ``files/name``,
    built beside it and renamed into place."""
    final = files / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=files))  # mode 0700
    try:
        _write_new(tmp / ADAPTER_WEIGHTS, cast(Any, slot.file_bytes.numpy()).data)  # no copy
        _write_new(tmp / ADAPTER_CONFIG, json.dumps(config).encode())
        os.replace(tmp, final)
        fsync_directory(files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_new(path: Path, data: Any) -> None:
    """Create ``path`` (mode 0600, never through a symlink) holding ``data``."""
    fd = open_regular(path, os.O_WRONLY | os.O_EXCL, create_mode=0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            out.write(data)
    finally:
        os.close(fd)
