"""One fetch per host: the workers of one trainer session on one host share the versions
staged in a private directory in shared memory (``/dev/shm``, mode 0700).

The first worker that wants a version takes the host's lock (``flock``), fetches it (a
delta against the newest version staged here when the trainer still has that one)
straight into a file of that directory, and commits it by writing its header beside it;
the others find it there and copy from it. A worker that dies while fetching lets go of
the lock with its process, and the next one fetches again; one stopped there keeps it, and
its host-mates' timeout errors name it (the holder writes who it is in the lock file).
Each worker holds a shared lock on the directory while it lives: the last one to leave
removes the directory, and a worker's start removes those of this user whose workers are
all gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    SchemaMismatchError,
    UnsafeDirectoryError,
    WeightSyncTimeoutError,
)
from weightsync.core.liveness import judged_by_pid, pid_scope, process_stat
from weightsync.transports.net.mapped_file import fresh_or_spare, map_locked, retire
from weightsync.transports.net.packed import PackedVersion, parse_header
from weightsync.transports.net.wire import ProtocolError

logger = logging.getLogger(__name__)

PREFIX = "weightsync-net-"
#: versions kept staged: the newest (being applied) and the one before (a delta's base,
#: and what a worker that started reading it just before a commit still maps)
KEEP = 2
#: a directory with no live worker is removed by another's start only once this old (so
#: that one being created, not locked yet, is never taken)
_SWEEP_AGE_S = 60.0
_LIMIT = 1 << 42

#: what fetches a version: given the newest staged (base, its trainer session) or None,
#: and where to rebuild it, returns the version and its trainer session
Fetch = Callable[[tuple[PackedVersion, str] | None, Callable[[int], torch.Tensor]],
                 tuple[PackedVersion, str]]


def _parent() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def _check_private(path: Path) -> None:
    """``path`` must be a real directory of this user that no one else may enter."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UnsafeDirectoryError(
            f"{path} is not a private directory of uid {os.getuid()} (a symlink, another "
            f"user's, or open to others); nothing was written there. Remove it, or run the "
            "workers as its owner")


def sweep(parent: Path, keep: Path | None = None) -> int:
    """Remove this user's staging directories under ``parent`` that no live worker holds
    (only those older than a minute); returns how many."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        path = parent / name
        if not name.startswith(f"{PREFIX}{os.getuid()}-") or path == keep:
            continue
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
                    or time.time() - info.st_mtime < _SWEEP_AGE_S:
                continue
            fd = os.open(path / "members", os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed += 1
        logger.info("removed staging directory %s: none of its workers is alive", path)
    return removed


def host_id() -> str:
    """Names this host to a trainer: the same for every worker that shares its staging
    (the machine, and the device and inode of the shared memory it stages in: a container
    or a namespace with a /dev/shm of its own is a host of its own)."""
    info = os.stat(_parent())
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    seen = f"{os.uname().nodename}/{boot}/{info.st_dev}/{info.st_ino}"
    return hashlib.sha256(seen.encode()).hexdigest()[:16]


def _holder(fd: int) -> str:
    """Who holds the staging lock, as its holder wrote it in the lock file: the worker,
    its pid, and whether that process is stopped, gone or in uninterruptible sleep (when
    its pid can be looked up here)."""
    try:
        held = json.loads(os.pread(fd, 4096, 0))
        name, pid = str(held["name"]), int(held["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return "another worker of this host"  # written by an older version, or mid-write
    said = f"{name} (pid {pid}"
    if judged_by_pid(held.get("scope")):
        stat = process_stat(pid)
        state = "gone" if stat is None else _STATES.get(stat[0], "")
        said += f", {state}" if state else ""
    return said + ")"


#: /proc states worth naming in an error about a lock's holder
_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible sleep",
           "Z": "gone"}


class HostStage:
    """The staged versions of the trainer session ``key`` names, on this host."""

    def __init__(self, key: str, name: str) -> None:
        self.name = name
        parent = _parent()
        self.directory = parent / f"{PREFIX}{os.getuid()}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
        sweep(parent, keep=self.directory)
        self._members = self._join()
        self._mapped: tuple[int, dict[str, torch.Tensor]] | None = None

    def _join(self) -> int:
        """Create (or enter) the directory and hold its shared lock; again if it was
        removed meanwhile by the last worker leaving."""
        for _ in range(100):
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.directory, 0o700)
            _check_private(self.directory)
            members = self.directory / "members"
            fd = os.open(members, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.stat(members, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # removed between our open and our lock: start again
        raise UnsafeDirectoryError(f"{self.directory} keeps being removed while joining it")

    # ------------------------------------------------------------------ versions staged
    def newest(self) -> int:
        """The newest version staged here (-1: none)."""
        versions = self._versions()
        return versions[-1] if versions else -1

    def _versions(self) -> list[int]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                if name.startswith("v") and name.endswith(".json") and name[1:-5].isdigit():
                    found.append(int(name[1:-5]))
        return sorted(found)

    def _open(self, version: int) -> tuple[PackedVersion, str]:
        """Version ``version`` as staged (its bytes mapped, not read); FileNotFoundError if
        it was removed meanwhile."""
        with open(self.directory / f"v{version}.json", encoding="utf-8") as f:
            header = json.load(f)
        try:
            number, session, entries, nbytes = parse_header(header, _LIMIT)
        except ProtocolError as exc:
            raise UnsafeDirectoryError(f"{self.directory}: the header of version {version} is "
                                       f"damaged ({exc})") from None
        buffer = map_locked(self.directory / f"v{version}.bin", nbytes, write=False)
        return PackedVersion(number, entries, buffer), session

    @contextlib.contextmanager
    def _locked(self, deadline: Deadline, version: int) -> Iterator[None]:
        """Hold the host's staging lock, and say in the lock file who holds it (a worker
        that waits in vain names it)."""
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline.expired():
                        raise WeightSyncTimeoutError(
                            f"{self.name}: {_holder(fd)} held this host's staging lock for "
                            f"longer than {deadline} while fetching version {version} or "
                            "newer (a worker stopped while it holds the lock holds up its host "
                            "until it resumes or ends)") from None
                    time.sleep(deadline.slice(delay))
                    delay = min(delay * 2, 0.05)
            held = {"name": self.name, "pid": os.getpid(), "scope": pid_scope(),
                    "version": version}
            with contextlib.suppress(OSError):  # only an error's words depend on it
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(held).encode(), 0)
            yield
        finally:
            os.close(fd)  # lets go of the lock

    def stage(self, at_least: int, fetch: Fetch, deadline: Deadline, round_: str = "") -> int:
        """Make a version ``at_least`` or newer staged here (fetching it unless another
        worker of this host did); returns the newest staged. ``round_``: a sharded
        trainer's delivery, whose ``at_least`` counts only if staged in that round (the
        number of a failed round comes again with other bytes); ``fetch`` returns it as
        the version's session."""
        with self._locked(deadline, at_least):
            newest = self.newest()
            if newest > at_least or (newest == at_least and self._staged_in(newest, round_)):
                return newest
            base = None
            if newest >= 0:
                with contextlib.suppress(FileNotFoundError, UnsafeDirectoryError):
                    base = self._open(newest)
            incoming, spare = self.directory / "incoming.bin", self.directory / "spare.bin"
            packed, session = fetch(base, lambda n: fresh_or_spare(incoming, spare, n))
            del base  # its mapping (and its lock) with it
            os.replace(incoming, self.directory / f"v{packed.version}.bin")
            header = self.directory / f"v{packed.version}.json.tmp"
            fd = os.open(header, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(packed.header(session), f)
            os.replace(header, self.directory / f"v{packed.version}.json")  # the commit
            for old in self._versions()[:-KEEP]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / f"v{old}.json")  # no worker finds it now
                retire(self.directory / f"v{old}.bin", spare)
            return packed.version

    def _staged_in(self, version: int, round_: str) -> bool:
        """Version ``version`` (staged) was staged in ``round_`` (any, if empty)."""
        if not round_:
            return True
        try:
            return self._open(version)[1] == round_
        except (FileNotFoundError, UnsafeDirectoryError):
            return False

    def apply(self, dest: Mapping[str, torch.Tensor], held: int,
              at_most: int | None = None) -> int | None:
        """Copy the newest staged version (no newer than ``at_most``, when given) into
        ``dest`` (cast to each tensor's dtype) if newer than ``held``; returns it, or None."""
        for _ in range(10):
            found = [v for v in self._versions() if at_most is None or v <= at_most]
            newest = found[-1] if found else -1
            if newest <= held:
                return None
            try:
                tensors = self._tensors(newest)
            except FileNotFoundError:
                continue  # removed by a newer commit meanwhile: take that one
            missing = next((name for name in tensors if name not in dest), None)
            if missing is not None:
                raise SchemaMismatchError(
                    f"{self.name}: version {newest} holds key {missing!r}, which the model "
                    "does not have", key=missing, expected=None, got=None)
            with torch.no_grad():
                for name, tensor in tensors.items():
                    dest[name].copy_(tensor)
            return newest
        return None

    def _tensors(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version``'s tensors, viewing its mapped bytes (kept mapped until a
        newer one is applied)."""
        if self._mapped is None or self._mapped[0] != version:
            packed, _ = self._open(version)
            self._mapped = (version, packed.tensors())
        return self._mapped[1]

    def close(self) -> None:
        """Leave; the last worker of the session on this host removes the directory."""
        self._mapped = None
        if self._members < 0:
            return
        fd, self._members = self._members, -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # converts our shared lock
        except OSError:
            os.close(fd)
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        os.close(fd)
