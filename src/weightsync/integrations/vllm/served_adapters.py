"""LoRA adapter versions on ``vllm serve`` (``init_info`` with ``adapter``).

Server side (:class:`AdapterFiles`): the host's first rank copies each adapter version,
read from a double-buffer directory (the trainer's on one host; this host's staging
directory on the network path) under the slot's read lock and verified by checksum, into
its own directory ``<adapter_dir>/<name>-v<version>``. The trainer then points the stable
name at it through vLLM's ``/v1/load_lora_adapter`` (:func:`load_on_server`). The
directory goes with the server's process; one left by a killed process is removed by the
next server that starts on the host.

Why a new path per version under one name: vLLM keys prefix-cache blocks by the LoRA's
name *and path*, so a new path never reuses a block computed with another version, while
clients keep asking for ``model="policy"``. vLLM reads an adapter's files again whenever it
reloads it (after a weight update, an LRU eviction, and, while the ``load_inplace`` flag
stays on the stored request, at every step), so the newest ``keep`` versions' files stay.
Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import UnsafeDirectoryError, WeightSyncError, WeightSyncTimeoutError
from weightsync.integrations.vllm.adapters import stage_adapter
from weightsync.transports.directory.files import DEFAULT_FILE_MODE, write_json_atomic
from weightsync.transports.directory.reader import DirectoryReader

logger = logging.getLogger(__name__)

_POLL_S = 0.005
#: in each server's adapter directory: the process that owns it (pid and start time)
OWNER = "owner.json"


def version_path(adapter_dir: str, name: str, version: int) -> str:
    """Where version ``version`` of adapter ``name`` lies on the server's host: the path
    the trainer hands to ``/v1/load_lora_adapter`` (both sides compute it)."""
    return f"{adapter_dir.rstrip('/')}/{name}-v{version}"


def _private_directory(path: Path) -> Path:
    """``path`` as a directory only this user can enter: created with mode 0700, or an
    existing one that is exactly that (a re-init of the same trainer session)."""
    try:
        path.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
                or stat.S_IMODE(info.st_mode) & 0o077:
            raise UnsafeDirectoryError(
                f"adapter directory {path} exists and is not a private directory of this "
                "user (mode 0700): refusing to write adapters there") from None
    except FileNotFoundError:
        raise WeightSyncError(f"adapter directory {path}: its parent does not exist on this "
                              "host (set adapter_root in the trainer's init info)") from None
    return path


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), None if it is gone or a
    zombie: a pid alone may be reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _this_process() -> dict[str, Any]:
    return {"pid": os.getpid(), "start": _start_time(os.getpid())}


def _sweep_orphans(parent: Path) -> None:
    """Remove the adapter directories under ``parent`` whose server process is gone (vLLM
    kills its workers at exit, before any clean-up of theirs can run): private
    directories of this user that hold an owner file naming a dead process."""
    if not os.path.isdir("/proc/self"):
        return  # no way to tell a live owner from a dead one: leave them
    for entry in parent.iterdir():
        try:
            info = os.lstat(entry)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
                    or stat.S_IMODE(info.st_mode) & 0o077:
                continue
            owner = json.loads((entry / OWNER).read_text())
            alive = _start_time(int(owner["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not one of these directories, or one being made
        if alive is None or alive != owner.get("start"):
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("removed %s, left by a server process that is gone", entry)


class AdapterFiles:
    """One server's adapter versions on its host: staged under ``adapter_dir`` for vLLM to
    load, the newest ``keep`` kept."""

    def __init__(self, adapter_dir: str, name: str, max_rank: int, keep: int) -> None:
        self.root = _private_directory(Path(adapter_dir))
        _sweep_orphans(self.root.parent)
        write_json_atomic(self.root / OWNER, _this_process(), mode=0o600, durable=False)
        # removed with this object or when the process exits (vLLM reads none after that);
        # a worker killed at the server's exit leaves it to the next server's sweep
        self._removal = Finalize(self, shutil.rmtree, args=(str(self.root), True),
                                 exitpriority=0)
        self.name = name
        self.max_rank = max_rank
        self.keep = keep
        self.version = -1
        self._readers: dict[str, DirectoryReader] = {}

    def stage(self, directory: str | Path, timeout: float, *, expect: int | None = None,
              label: int | None = None) -> Path:
        """Copy committed version ``expect`` (None: the newest) of ``directory`` into
        ``<adapter_dir>/<name>-v<label>`` (``label`` defaults to that version) and return
        it. ``AdapterRankError`` for an adapter above vLLM's ``max_lora_rank``, before any
        copy; ``WeightSyncTimeoutError`` if the version is not readable within ``timeout``."""
        deadline = Deadline(timeout)
        key = str(directory)
        if key not in self._readers:
            self._readers[key] = DirectoryReader(Path(directory), 0, mode=DEFAULT_FILE_MODE)
        reader = self._readers[key]
        while True:
            manifest = reader.manifest()
            commit = None if manifest is None else manifest.for_worker(0)
            if commit is not None and expect is not None and commit.version > expect:
                raise WeightSyncError(
                    f"adapter {self.name}: version {expect} was asked for, but {directory} "
                    f"already holds version {commit.version} (two trainers on one directory?)")
            if commit is not None and (expect is None or commit.version == expect):
                tag = f"v{commit.version if label is None else label}"
                staged = stage_adapter(reader, self.root, commit, self.max_rank, tag)
                if staged is not None:
                    break
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"adapter {self.name}: version {'(newest)' if expect is None else expect} "
                    f"could not be read from {directory} within {deadline}")
            time.sleep(deadline.slice(_POLL_S))
        name, path = staged
        if name != self.name:
            raise WeightSyncError(f"{directory} holds adapter {name!r}, but the trainer's init "
                                  f"info names {self.name!r}")
        reader.ack(commit.version)
        self.version = commit.version if label is None else label
        self._prune()
        logger.info("adapter %s version %d staged at %s", name, self.version, path)
        return path

    def forget(self, directory: str | Path) -> None:
        """Drop the reader of ``directory`` (it is about to be made again)."""
        reader = self._readers.pop(str(directory), None)
        if reader is not None:
            reader.close()

    def _prune(self) -> None:
        """Remove all but the newest ``keep`` versions' directories."""
        prefix = f"{self.name}-v"
        versions = sorted(int(p.name[len(prefix):]) for p in self.root.iterdir()
                          if p.name.startswith(prefix) and p.name[len(prefix):].isdigit())
        for old in versions[:-self.keep]:
            shutil.rmtree(self.root / f"{prefix}{old}", ignore_errors=True)

    def close(self) -> None:
        """Remove every staged version (the server is going away: vLLM reads none again)."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._removal()


#: how the stable name moves to a new version (see :func:`load_on_server`)
LOAD_MODES = ("inplace", "swap")


def load_on_server(client: Any, name: str, path: str, timeout: float, mode: str = "inplace") -> None:
    """Point ``name`` on the server of ``client`` at the adapter in ``path`` (on the
    server's host) through vLLM's ``/v1/load_lora_adapter``; requests sent after this
    returns get this version. ``mode``: ``"inplace"`` (``load_inplace``: the name keeps its
    LoRA id and never stops answering; vLLM 0.32 then re-reads the files at every step,
    vLLM issue #33791) or ``"swap"`` (``/v1/unload_lora_adapter``, then a plain load under
    a new id: no re-reads, and requests in flight finish on their version, but for one
    round trip the name answers 404). ``client``: one with a ``load_lora_adapter(name,
    path)`` method (it decides how), or an HTTP client with ``base_url``
    (``HTTPVLLMWeightSyncClient``)."""
    if mode not in LOAD_MODES:
        raise ValueError(f"adapter load mode must be one of {LOAD_MODES}, got {mode!r}")
    if hasattr(client, "load_lora_adapter"):
        client.load_lora_adapter(name, path)
        return
    base_url = getattr(client, "base_url", None)
    if base_url is None:
        raise TypeError(f"adapter {name!r}: the client {type(client).__name__} has neither "
                        "load_lora_adapter(name, path) nor an HTTP base_url")
    import requests

    url = str(base_url).rstrip("/")
    if mode == "swap":
        reply = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name},
                              timeout=timeout)
        if reply.status_code >= 400 and "cannot be found" not in reply.text:  # first version
            _refused(url, name, path, reply)
    reply = requests.post(f"{url}/v1/load_lora_adapter", timeout=timeout, json={
        "lora_name": name, "lora_path": path, "load_inplace": mode == "inplace"})
    if reply.status_code >= 400:
        _refused(url, name, path, reply)


def _refused(url: str, name: str, path: str, reply: Any) -> None:
    if reply.status_code == 404 and "lora" not in reply.text.lower():
        raise WeightSyncError(
            f"{url} has no LoRA adapter routes: start vllm serve with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora")
    raise WeightSyncError(f"{url} refused adapter {name!r} from {path}: "
                          f"HTTP {reply.status_code}: {reply.text[:500]}")
