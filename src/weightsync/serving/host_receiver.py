"""The server host's side of the network path (``init_info`` with ``address``): one
receiver per host (the engine's rank 0) fetches each version from the trainer over the
network transport, verified chunk by chunk, and stages it as a committed version of a
host-local private directory in the existing double-buffer format, beside the one served;
every tensor-parallel rank then loads it from there with the directory path's own code,
exactly or not at all. A small status file tells the other ranks which local version holds
the trainer's version (or why there is none). An owner record in each staging directory
lets the next receiver to start on the host remove the staging of one that was killed (as
vLLM kills its workers at exit), and nothing else. Nothing here imports an inference engine."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import UnsafeDirectoryError, WeightSyncError, WeightSyncTimeoutError
from weightsync.schemes.double_buffer import VLLMDoubleBufferSyncScheme, VLLMDoubleBufferWeightSender
from weightsync.serving.owners import (
    Owner,
    Verdict,
    dead_owners,
    private_directory,
    read_owner,
    write_owner,
)
from weightsync.transports.directory.files import write_json_atomic
from weightsync.transports.net.fetch import Forwarding, VersionFetcher
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import PackedVersion
from weightsync.transports.net.relay import HostRelay, local_address_toward, relayed
from weightsync.transports.net.sharded_fetch import ShardedFetcher

logger = logging.getLogger(__name__)

STATUS = "staged.json"
_POLL = 0.02


#: the kind of owner record in each staging directory
KIND = "vllm-staging"
_PREFIX = "weightsync-vllm-"


def staging_directory(engine_id: str) -> Path:
    """The host-local private directory of one engine (every rank of it computes the same
    path): in /dev/shm where there is one, mode 0700."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return Path(base) / f"{_PREFIX}{os.getuid()}-{digest}"


def sweep_staging(parent: Path) -> int:
    """Remove the staging directories of this user under ``parent`` whose receiver is gone
    (vLLM kills its workers at exit, so nothing of theirs cleans up; each leaves twice the
    model's size in RAM): only those holding a receiver's owner record naming a process
    this one can judge dead, never one of another pid namespace. Returns how many."""
    removed = 0
    for path, owner in dead_owners(parent, KIND, f"{_PREFIX}{os.getuid()}-"):
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
        logger.info("removed staging directory %s, left by receiver process %d that is gone",
                    path, owner.pid)
    return removed


def _clear_staging(directory: Path) -> None:
    """Remove ``directory`` if it is a staging directory this process may start over: this
    process's, one whose receiver is gone, or an empty one of this user. Anything else there
    (a symlink, another user's, a live receiver's, one of another pid namespace) is an
    :class:`UnsafeDirectoryError` naming it; nothing is followed or removed."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return
    expected = (f"expected this user's (uid {os.getuid()}) private staging directory "
                "(mode 0700) or nothing")
    if stat.S_ISLNK(info.st_mode):
        target = "?"
        with contextlib.suppress(OSError):
            target = os.readlink(directory)
        raise UnsafeDirectoryError(
            f"staging path {directory} is a symbolic link (to {target!r}), {expected}: "
            "nothing was followed or removed; remove the link")
    if not private_directory(directory):
        kind = "directory" if stat.S_ISDIR(info.st_mode) else "file, not a directory"
        raise UnsafeDirectoryError(
            f"staging path {directory} is a {kind} of uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}, {expected}: nothing was removed")
    owner = read_owner(directory, KIND)
    if owner is None:
        if os.listdir(directory):
            raise UnsafeDirectoryError(
                f"staging directory {directory} holds files but no receiver's owner record: "
                "weightsync did not make them, so it removes nothing; remove it yourself")
        directory.rmdir()
        return
    verdict = owner.verdict()
    if verdict not in (Verdict.THIS_PROCESS, Verdict.GONE):
        raise UnsafeDirectoryError(
            f"staging directory {directory} belongs to receiver {owner.describe()}: is "
            "another engine with this engine's id running? (remove it if none is)")
    shutil.rmtree(directory)


def request_key(token: str, what: str) -> str:
    """Names one request (an init's ticket, or an update's version) of one trainer session
    in the status file, without writing the token there."""
    return hashlib.sha256(f"{token}/{what}".encode()).hexdigest()[:24]


class HostReceiver:
    """The one receiver of a host: fetches versions and commits them to ``directory`` for
    the engine's ``num_workers`` ranks."""

    def __init__(self, directory: Path, num_workers: int, name: str, timeout: float, *,
                 thread_setup: Callable[[], None] | None = None) -> None:
        """``thread_setup`` runs first on the thread that stages in the background (an
        engine moves it off the cores it computes on there)."""
        self.directory, self.num_workers, self.timeout = directory, num_workers, timeout
        self.sender: VLLMDoubleBufferWeightSender | None = None
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # what is staged
        sweep_staging(directory.parent)
        self._start_over()
        self.fetcher = VersionFetcher(name)
        self.sharded = ShardedFetcher(name)
        self.version = -1  # the trainer's number of the version staged last
        self._lock = threading.Lock()  # one stage at a time, in the background or not
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="weightsync-stage",
                                          initializer=thread_setup)
        self._pending: dict[str, Future[int]] = {}  # background stages, by request key
        #: with several servers: serves what this host fetches to the servers after it
        self.relay: HostRelay | None = None
        self._relay_key = ""
        #: run with a staged version's request key before the trainer hears it is staged
        #: (an engine whose ranks load it ahead of the take waits for them here)
        self.after_commit: Callable[[str], None] | None = None

    def _start_over(self) -> None:
        """An empty staging directory with this process's owner record (a previous engine's
        or session's slots: nothing to trust there, and their layout may not be the next
        one's)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        _clear_staging(self.directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            raise UnsafeDirectoryError(
                f"staging path {self.directory} appeared while this receiver made it: is "
                "another receiver starting with this engine's id?") from None
        write_owner(self.directory, Owner.of_this_process(KIND))
        self.scheme = VLLMDoubleBufferSyncScheme(self.directory, num_workers=self.num_workers,
                                                 timeout=self.timeout)
        self.layout = {}

    def _relay_for(self, trainer: str, pool: str, delta: bool) -> HostRelay | None:
        """This host's relay under the session's ``pool`` key (None without one), started
        at the first stage that has it; the trainer learns its address from each request."""
        if not pool:
            return None
        if self.relay is None or self._relay_key != pool:
            if self.relay is not None:
                self.relay.close()
            self.relay = HostRelay(local_address_toward(trainer), pool, timeout=self.timeout,
                                   delta=delta)
            self._relay_key = pool
            self.fetcher.relay_address = self.relay.address
        return self.relay

    def stage(self, address: str | Sequence[str], token: str, want: int | None, key: str,
              timeout: float, *, new_session: bool = False, relays: Sequence[str] = (),
              pool: str = "", delta: bool = False) -> int:
        """Fetch ``want`` (None: the trainer's current version) from the trainer, or from
        every rank of a sharded trainer (``address``: theirs, rank by rank), commit it
        locally and return its local version; the outcome is in the status file under
        ``key`` either way (an error is raised here too), written before the trainer hears
        the version arrived, so its verdict means "staged". ``new_session`` (an init, where
        every rank attaches afresh): a version of another layout than the one staged (the
        trainer now sends another dtype or model) starts the staging directory over. With
        the session's ``pool`` key, this host relays what it fetches to other servers, and
        ``relays`` (other servers' hosts) are asked for ``want`` before the trainer, each
        chunk checked against the trainer's digests; the trainer then hears a report."""
        staged: list[int] = []

        def commit(version: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
                   ) -> None:
            staged.append(self._commit(version, tensors, metadata, key, timeout, new_session))

        def commit_packed(packed: PackedVersion) -> None:
            commit(packed.version, packed.tensors(), packed.metadata)

        with self._lock:
            try:
                if isinstance(address, str):
                    self._fetch(address, token, want, timeout, commit_packed,
                                self._relay_for(address, pool, delta), relays, pool)
                else:
                    self.sharded.fetch(address, token, want, timeout, commit=lambda version,
                                       tensors: commit(version, tensors, {}))
            except Exception as exc:
                self._status({"key": key, "error": f"{type(exc).__name__}: {exc}"})
                raise
            return staged[0]

    def _fetch(self, trainer: str, token: str, want: int | None, timeout: float,
               commit: Callable[[PackedVersion], None], relay: HostRelay | None,
               relays: Sequence[str], pool: str) -> None:
        """``want`` from the first of ``relays`` that delivers it checked (then reported to
        the trainer), else from the trainer; this host's ``relay`` serves it on."""
        deadline = Deadline(timeout)
        offer = None if relay is None else relay.offer
        if relays and want is not None and relay is not None:
            server_id = token.partition(".")[0]  # the id the trainer's credential names
            fetched = relayed(relays, want, self.fetcher, trainer, token, deadline, offer,
                              relay_credential=host_credential(pool, server_id), commit=commit)
            if fetched is not None:
                try:
                    self.fetcher.report(trainer, token, want, fetched[1], deadline.remaining())
                except WeightSyncError as exc:  # staged all the same: the trainer times out
                    logger.warning("host %s staged version %d from %s but could not tell the "
                                   "trainer: %s", self.fetcher.name, want, fetched[1], exc)
                return
        self.fetcher.fetch(trainer, token, want, deadline.remaining(), commit=commit,
                           forwarding=Forwarding(started=offer))

    def _commit(self, version: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                key: str, timeout: float, new_session: bool) -> int:
        """Commit a fetched, verified version to the staging directory; its local number."""
        layout = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        if new_session and self.layout and layout != self.layout:
            logger.info("host %s: the trainer's new session sends another layout; its "
                        "staging directory starts over", self.fetcher.name)
            self._start_over()
        if self.sender is None:
            self.sender = self.scheme.create_sender()
            self.sender.register_model(tensors)
            self.layout = layout
        writer: Any = self.sender.writer
        writer.slot_metadata = dict(metadata)  # a LoRA adapter's name and config (unsharded)
        local = int(self.sender.update_weights(tensors, timeout=timeout))
        self._status({"key": key, "local": local, "version": version})
        self.version = version
        if self.after_commit is not None:
            self.after_commit(key)
        return local

    def stage_in_background(self, address: str | Sequence[str], token: str, want: int,
                            key: str, timeout: float, **options: Any) -> None:
        """Start :meth:`stage` (``options``: its keywords) on this receiver's thread and
        return at once (the engine keeps generating while the version travels);
        :meth:`staged` waits for it."""
        self._pending = {k: f for k, f in self._pending.items() if not f.done()}
        future = self._stager.submit(self.stage, address, token, want, key, timeout, **options)
        future.add_done_callback(lambda done: self._log_failure(done, want))
        self._pending[key] = future

    def _log_failure(self, done: Future[int], want: int) -> None:
        """Say at once why a background stage failed (the trainer hears it too; a take
        that asks for it later fetches again)."""
        if done.cancelled() or done.exception() is None:
            return
        exc = done.exception()
        logger.warning("host %s: staging version %d in the background failed: %s: %s",
                       self.fetcher.name, want, type(exc).__name__, exc, exc_info=exc)

    def staged(self, key: str, timeout: float) -> int | None:
        """The local version of the background stage started for ``key`` once it ends, or
        None if none was started for it or it failed (logged: the caller fetches it now)."""
        future = self._pending.pop(key, None)
        if future is None:
            return None
        try:
            return int(future.result(timeout=timeout))
        except FutureTimeout:
            raise WeightSyncTimeoutError(
                f"host {self.fetcher.name}: the version staged in the background was not "
                f"staged within {timeout:g}s") from None
        except Exception as exc:
            logger.warning("host %s: staging in the background failed (%s: %s); fetching "
                           "it again now", self.fetcher.name, type(exc).__name__, exc)
            return None

    def _status(self, status: dict[str, Any]) -> None:
        write_json_atomic(self.directory / STATUS, status, mode=0o600, durable=False)

    def close(self) -> None:
        self._stager.shutdown(wait=False, cancel_futures=True)
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        shutil.rmtree(self.directory, ignore_errors=True)


def wait_staged(directory: Path, key: str, timeout: float, where: str) -> int:
    """The local version the host's receiver staged for ``key`` (ranks other than the
    receiver wait here); the receiver's error, or ``WeightSyncTimeoutError``."""
    deadline = Deadline(timeout)
    while True:
        status = None
        with contextlib.suppress(OSError, ValueError):
            status = json.loads((directory / STATUS).read_text())
        if isinstance(status, dict) and status.get("key") == key:
            if "error" in status:
                raise WeightSyncError(f"{where}: this host's receiver failed: {status['error']}")
            return int(status["local"])
        if deadline.expired():
            raise WeightSyncTimeoutError(
                f"{where}: this host's receiver (rank 0) staged nothing in {directory} within "
                f"{deadline}")
        time.sleep(deadline.slice(_POLL))


def host_name(engine_id: str) -> str:
    return f"{socket.gethostname()}/{engine_id[:12]}"
