"""LoRA adapter versions as files on a server's host (``init_info`` with ``adapter``).

:class:`AdapterFiles`: the host's first rank copies each adapter version,
read from a double-buffer directory (the trainer's on one host; this host's staging
directory on the network path) under the slot's read lock and verified by checksum, into
its own directory ``<adapter_dir>/<name>-v<version>``. The trainer then points the stable
name at it (for ``vllm serve``: ``weightsync.integrations.vllm.lora_routes``). The
``adapter_dir`` must be new (the server creates it) or empty: it comes from ``init_info``,
and the server removes it when it goes, so it must never name anything the server did not
make. The versions go with the server's process; those left by a killed process are
removed by the next server that starts on the host, if it can tell that process is gone.

Why a new path per version under one name: vLLM keys prefix-cache blocks by the LoRA's
name *and path*, so a new path never reuses a block computed with another version, while
clients keep asking for ``model="policy"``. vLLM reads an adapter's files again whenever it
reloads it (after a weight update, an LRU eviction, and, while the ``load_inplace`` flag
stays on the stored request, at every step), so the newest ``keep`` versions' files stay.
Nothing here imports an inference engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time
from multiprocessing.util import Finalize
from pathlib import Path

from weightsync.core.deadline import Deadline
from weightsync.core.errors import UnsafeDirectoryError, WeightSyncError, WeightSyncTimeoutError
from weightsync.serving.adapter_copy import stage_adapter
from weightsync.serving.owners import (
    OWNER_FILE,
    Owner,
    dead_owners,
    private_directory,
    read_owner,
    write_owner,
)
from weightsync.transports.directory.files import DEFAULT_FILE_MODE
from weightsync.transports.directory.reader import DirectoryReader

logger = logging.getLogger(__name__)

_POLL_S = 0.005
#: the kind of owner record in each server's adapter directory
KIND = "vllm-adapter"


def version_path(adapter_dir: str, name: str, version: int) -> str:
    """Where version ``version`` of adapter ``name`` lies on the server's host: the path
    the trainer hands to ``/v1/load_lora_adapter`` (both sides compute it)."""
    return f"{adapter_dir.rstrip('/')}/{name}-v{version}"


def _made_here(entry: str, name: str) -> bool:
    """Whether ``entry`` of an adapter directory is one :class:`AdapterFiles` of adapter
    ``name`` makes: its owner record, a version, or one of their temp files."""
    version = rf"{re.escape(name)}-v-?\d+"
    return entry == OWNER_FILE or entry.startswith(f".{OWNER_FILE}.tmp-") \
        or re.fullmatch(rf"{version}|\.{version}\..+", entry) is not None


def _remove_made(root: str, name: str, created: bool) -> None:
    """Remove what weightsync made in ``root`` for adapter ``name``, and ``root`` itself if
    weightsync ``created`` it and nothing else is left in it: never anything it did not make."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning("could not list adapter directory %s to remove its versions: %s", root, exc)
        return
    for entry in entries:
        if not _made_here(entry, name):
            continue
        path = os.path.join(root, entry)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)  # a symlink itself, never what it points to
    if created:
        try:
            os.rmdir(root)
        except FileNotFoundError:
            pass
        except OSError:
            logger.warning("left adapter directory %s: it holds files weightsync did not make",
                           root)


def _claim_directory(path: Path) -> bool:
    """Make ``path`` the adapter directory: created with mode 0700 (True), or an existing
    private directory of this user that is empty (False: weightsync then removes only what it
    writes there, never the directory). Anything else is refused, since whatever holds
    files there was not made by this server: ``close()`` would otherwise delete it."""
    try:
        path.mkdir(mode=0o700, parents=False)
        return True
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise WeightSyncError(f"adapter directory {path}: its parent does not exist on this "
                              "host (set adapter_root in the trainer's init info)") from None
    if not private_directory(path):
        raise UnsafeDirectoryError(
            f"adapter directory {path} exists and is not a private directory of this "
            "user (mode 0700, not a symlink): refusing to write adapters there")
    entries = os.listdir(path)
    if entries:
        owner = read_owner(path, KIND)
        whose = f"{len(entries)} entries" if owner is None else \
            f"the adapter versions of another weightsync server, {owner.describe()}"
        raise UnsafeDirectoryError(
            f"adapter directory {path} exists and is not empty (it holds {whose}): a server "
            "writes adapters only into a directory it creates, or an empty one, since it "
            "removes what it wrote there when it stops. Name a new path (the trainer engine "
            "names <adapter_root>/weightsync-<name>-<random>), or an empty directory")
    return False


def _sweep_orphans(parent: Path) -> None:
    """Remove what weightsync made in the adapter directories under ``parent`` whose
    server process is gone (vLLM kills its workers at exit, before any clean-up of theirs
    can run): private directories of this user whose owner record is an adapter server's,
    judged only where the owner's pid means the same process (not across pid namespaces)."""
    for path, owner in dead_owners(parent, KIND):
        name, created = owner.extra.get("adapter"), owner.extra.get("created")
        if not isinstance(name, str) or not isinstance(created, bool):
            continue
        _remove_made(str(path), name, created)
        logger.info("removed the adapter versions in %s, left by server process %d that is "
                    "gone", path, owner.pid)


class AdapterFiles:
    """One server's adapter versions on its host: staged under ``adapter_dir`` for vLLM to
    load, the newest ``keep`` kept."""

    def __init__(self, adapter_dir: str, name: str, max_rank: int, keep: int) -> None:
        root = Path(adapter_dir)
        _sweep_orphans(root.parent)  # first: ``root`` may be a dead server's
        created = _claim_directory(root)
        self.root = root
        # removed with this object or when the process exits (vLLM reads none after that);
        # a worker killed at the server's exit leaves it to the next server's sweep
        self._removal = Finalize(self, _remove_made, args=(str(root), name, created),
                                 exitpriority=0)
        write_owner(root, Owner.of_this_process(KIND, adapter=name, created=created))
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
