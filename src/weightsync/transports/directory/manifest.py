"""Weights in a directory: preallocated safetensors slots, an atomic manifest, ack files.

Any process that sees the directory (a vLLM worker, a process on another host over a
shared file system) can read the newest committed version. Layout on disk::

    slot-0.safetensors, slot-1.safetensors[, ...]   raw tensor bytes behind a JSON header
    manifest.json                                   the committed state, replaced atomically
    ack-<worker>.json                               the version each worker holds
    sender.lock                                     locked by the live sender

A slot is written only when no manifest entry names it and no reader holds its shared
``fcntl`` lock; the manifest is then replaced by rename, so a crash at any point leaves the
last complete version committed. Nothing on disk is ever unpickled, every control file is
validated as untrusted input, and files are opened as :mod:`directory_files` describes.

This module holds the on-disk format (names, manifest, acks, the sender lock); the writer and
the reader of the protocol live in ``directory_writer`` and ``directory_reader``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.core.checksum import CHECKSUM_ID
from weightsync.core.errors import IntegrityError
from weightsync.transports.directory.files import (
    open_regular,
    read_json_if_changed,
    read_json_object,
)
from weightsync.transports.directory.slots import (  # re-exported: the format's pieces
    SlotFile,
    bucket_checksums,
    check_weight_name,
    close_slots,
    file_layout,
    pack_with_checksums,
    parse_header,
)

__all__ = [
    "FORMAT", "MANIFEST", "SENDER_LOCK", "Ack", "Commit", "Manifest", "ManifestCache", "SenderLock",
    "SlotFile", "SlotRecord", "ack_path", "bucket_checksums", "check_weight_name", "close_slots",
    "file_layout", "pack_with_checksums", "parse_header", "read_ack", "read_manifest",
    "sender_alive", "slot_path",
]

MANIFEST = "manifest.json"
SENDER_LOCK = "sender.lock"
FORMAT = "weightsync-double-buffer/1"


def slot_path(directory: Path, index: int) -> Path:
    return directory / f"slot-{index}.safetensors"


def ack_path(directory: Path, worker_idx: int) -> Path:
    return directory / f"ack-{worker_idx}.json"


def _int(obj: Any, what: str, where: Path, minimum: int = 0) -> int:
    if type(obj) is not int or obj < minimum:
        raise IntegrityError(f"{where}: {what} must be an int >= {minimum}, got {obj!r}")
    return obj


@dataclass(frozen=True)
class Commit:
    """A committed version and the slot that holds it."""

    version: int
    slot: int

    @classmethod
    def from_json(cls, obj: Any, what: str, where: Path) -> Commit:
        if not isinstance(obj, dict):
            raise IntegrityError(f"{where}: {what} is not an object")
        return cls(_int(obj.get("version"), f"{what}.version", where),
                   _int(obj.get("slot"), f"{what}.slot", where))

    def to_json(self) -> dict[str, int]:
        return {"version": self.version, "slot": self.slot}


@dataclass(frozen=True)
class SlotRecord:
    """What the manifest promises about one slot: its version and per-bucket checksums."""

    version: int
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    """The committed state: the newest version, each worker's version, and a record (version,
    checksums) of every slot whose bytes still hold a committed version."""

    fingerprint: str
    latest: Commit
    workers: dict[int, Commit]
    slots: dict[int, SlotRecord]
    sender_pid: int = 0
    sender_host: str = ""
    #: the function of the slot checksums (``core.checksum``); None: an older writer's
    checksum: str | None = CHECKSUM_ID

    def for_worker(self, worker_idx: int) -> Commit:
        """The version committed for ``worker_idx`` (the latest unless isolated)."""
        return self.workers.get(worker_idx, self.latest)

    def busy_slots(self) -> set[int]:
        """Slots a writer must not touch: those holding a version some worker is to take."""
        return {self.latest.slot, *(c.slot for c in self.workers.values())}

    def named_slots(self) -> set[int]:
        """Every slot the manifest names, including those that merely still hold an older
        version (readable with ``apply_version`` until a writer reuses the slot)."""
        return self.busy_slots() | set(self.slots)

    def slot_holding(self, version: int) -> int | None:
        return next((i for i, r in self.slots.items() if r.version == version), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "fingerprint": self.fingerprint, "latest": self.latest.to_json(),
            "workers": {str(w): c.to_json() for w, c in sorted(self.workers.items())},
            "slots": {str(i): {"version": r.version, "checksums": [str(c) for c in r.checksums]}
                      for i, r in sorted(self.slots.items())},
            "sender": {"pid": self.sender_pid, "host": self.sender_host},
            "checksum": self.checksum,
            "committed_at": time.time(),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: Path) -> Manifest:
        """Validate every field; :class:`IntegrityError` naming ``where`` for anything off."""
        if obj.get("format") != FORMAT:
            raise IntegrityError(f"{where} has format {obj.get('format')!r}, expected {FORMAT!r}")
        fingerprint = obj.get("fingerprint")
        workers, slots, sender = obj.get("workers", {}), obj.get("slots", {}), obj.get("sender", {})
        if not isinstance(fingerprint, str):
            raise IntegrityError(f"{where}: fingerprint is not a string")
        if not (isinstance(workers, dict) and isinstance(slots, dict) and isinstance(sender, dict)):
            raise IntegrityError(f"{where}: workers, slots and sender must be objects")
        records = {}
        for key, record in slots.items():
            index = _key(key, "slot", where)
            sums = record.get("checksums") if isinstance(record, dict) else None
            if not isinstance(sums, list) or not all(isinstance(s, str) and s.isdigit() for s in sums):
                raise IntegrityError(f"{where}: slot {key}: checksums must be a list of digit strings")
            records[index] = SlotRecord(_int(record.get("version"), f"slot {key} version", where),
                                        tuple(int(s) for s in sums))
        pid, host = sender.get("pid", 0), sender.get("host", "")
        function = obj.get("checksum")
        if function is not None and not isinstance(function, str):
            raise IntegrityError(f"{where}: checksum must name a function, got {function!r}")
        return cls(
            fingerprint=fingerprint,
            latest=Commit.from_json(obj.get("latest"), "latest", where),
            workers={_key(k, "worker", where): Commit.from_json(v, f"worker {k}", where)
                     for k, v in workers.items()},
            slots=records,
            sender_pid=pid if type(pid) is int else 0,
            sender_host=host if isinstance(host, str) else "",
            checksum=function,
        )


def _key(key: str, what: str, where: Path) -> int:
    if not key.isdigit() or len(key) > 9:
        raise IntegrityError(f"{where}: {key!r} is not a {what} index")
    return int(key)


def read_manifest(directory: Path) -> Manifest | None:
    """The committed manifest of ``directory``; None if there is none yet."""
    path = directory / MANIFEST
    obj = read_json_object(path)
    return None if obj is None else Manifest.from_json(obj, path)


class ManifestCache:
    """Reads the manifest of one directory, parsing it only when its bytes changed (every
    commit changes them): a reader that polls an unchanged manifest pays one small read."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / MANIFEST
        self._raw: bytes | None = None
        self._manifest: Manifest | None = None

    def read(self) -> Manifest | None:
        found = read_json_if_changed(self.path, self._raw)
        if found is None:
            self._raw = self._manifest = None
            return None
        raw, obj = found
        if obj is not None:
            self._manifest = Manifest.from_json(obj, self.path)
            self._raw = raw
        return self._manifest


@dataclass(frozen=True)
class Ack:
    """A worker's acknowledgement: the version it holds, and which process wrote it: its pid
    and the space that pid is numbered in (:func:`~weightsync.core.liveness.pid_scope`;
    None when unknown, as in acks of older versions). ``host`` is for messages only."""

    version: int
    pid: int
    host: str
    scope: str | None = None
    #: the worker refused the weights' layout: ``message``, ``key``, ``expected``, ``got``
    mismatch: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        described: dict[str, Any] = {"version": self.version, "pid": self.pid,
                                     "host": self.host, "pidns": self.scope, "at": time.time()}
        if self.mismatch is not None:
            described["mismatch"] = self.mismatch
        return described


def read_ack(directory: Path, worker_idx: int) -> Ack | None:
    """Worker ``worker_idx``'s ack; None if it wrote none; IntegrityError if malformed."""
    path = ack_path(directory, worker_idx)
    obj = read_json_object(path)
    if obj is None:
        return None
    host = obj.get("host")
    if not isinstance(host, str):
        raise IntegrityError(f"{path}: host must be a string, got {host!r}")
    scope = obj.get("pidns")
    if scope is not None and not (isinstance(scope, str) and len(scope) <= 256):
        raise IntegrityError(f"{path}: pidns must be a short string or null, got {scope!r:.80}")
    mismatch = obj.get("mismatch")
    if mismatch is not None and not (isinstance(mismatch, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in mismatch.items())):
        raise IntegrityError(f"{path}: mismatch must map strings to strings, got {mismatch!r:.80}")
    return Ack(_int(obj.get("version"), "version", path, minimum=-1),
               _int(obj.get("pid"), "pid", path, minimum=1), host, scope, mismatch)


def _file_id(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


class SenderLock:
    """An exclusive lock on ``sender.lock`` held for a sender's lifetime: one sender per
    directory, and receivers can tell whether a live sender exists by trying to take it.

    The lock itself is the liveness: the kernel drops it when the sender dies, whatever pid
    namespace (container) either side is in. The pid written into the file is for people
    only; a process knows its own locks from :attr:`_held_here` (POSIX locks never conflict
    within one process), never from a pid, which another namespace may share."""

    #: locks this process holds: path -> (st_dev, st_ino) of the lock file
    _held_here: dict[Path, tuple[int, int]] = {}

    def __init__(self, directory: Path, mode: int) -> None:
        self.path = directory.resolve() / SENDER_LOCK
        if self.path in SenderLock._held_here:
            raise RuntimeError(f"another sender is writing to {directory} (in this process)")
        self.fd = open_regular(self.path, os.O_RDWR, create_mode=mode)
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self.fd)
            raise RuntimeError(
                f"another sender is writing to {directory} (it holds {SENDER_LOCK})"
            ) from exc
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        SenderLock._held_here[self.path] = _file_id(self.fd)
        self.owner_pid = os.getpid()

    def release(self) -> None:
        """Unlock (in the process that locked; a forked child only closes its copy)."""
        SenderLock._held_here.pop(self.path, None)
        with contextlib.suppress(OSError):
            if os.getpid() == self.owner_pid:
                os.ftruncate(self.fd, 0)
                fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)

    @staticmethod
    def held_here(fd: int) -> bool:
        """Whether this process holds the lock on the file open at ``fd``."""
        return bool(SenderLock._held_here) and _file_id(fd) in SenderLock._held_here.values()


# a forked child holds none of its parent's POSIX locks
os.register_at_fork(after_in_child=SenderLock._held_here.clear)


def sender_alive(directory: Path) -> bool:
    """True if some process holds the sender lock of ``directory`` (this one included): a
    lock we cannot take is held, across pid namespaces too."""
    path = directory / SENDER_LOCK
    if SenderLock._held_here:
        # decided without opening the file: closing any descriptor of a file drops every
        # POSIX lock this process holds on it, the sender's own (a reader in the trainer's
        # process, or a sharded rank 0 checking itself, would release it)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return False
        if (info.st_dev, info.st_ino) in SenderLock._held_here.values():
            return True
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if SenderLock.held_here(fd):
            return True  # our own lock: POSIX locks never conflict within a process
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
