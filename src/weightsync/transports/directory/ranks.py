"""The control files of a sharded trainer writing one directory: who is there, which version
is being written where, and what each rank wrote.

::

    hello-<r>.json    rank r: its incarnation (a random nonce), pid, pid namespace, the
                      global layout it registered and the regions of each tensor it writes
    pending.json      rank 0: version n goes to slot i (attempt id, the ranks' nonces it
                      checked); or why the attempt failed
    rank-<r>.json     rank r: it wrote its part of that attempt, with its checksum shares

Each file is written atomically (temp file + rename) by its one writer and read by the
others as untrusted input (validated, never unpickled), like the manifest and acks. The
protocol that uses them is in ``directory/sharded.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.core.errors import IntegrityError
from weightsync.core.liveness import judged_by_pid, pid_scope, process_dying
from weightsync.transports.directory.files import read_json_if_changed, write_json_atomic

PENDING = "pending.json"
#: what a failure record says went wrong: a rank was lost, or the ranks' layouts disagree
LOST, SCHEMA = "lost", "schema"


def hello_path(directory: Path, rank: int) -> Path:
    return directory / f"hello-{rank}.json"


def rank_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


def new_nonce() -> str:
    return os.urandom(8).hex()


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: Path) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise IntegrityError(f"{where}: {key} has the wrong type ({type(value).__name__})")
    return value


def _sums(obj: Any, where: Path) -> tuple[int, ...]:
    if not isinstance(obj, list) or not all(isinstance(s, str) and s.isdigit() for s in obj):
        raise IntegrityError(f"{where}: checksums must be a list of digit strings")
    return tuple(int(s) for s in obj)


@dataclass(frozen=True)
class Hello:
    """A rank announcing itself (written at its first send, again after a restart)."""

    rank: int
    nonce: str
    pid: int
    host: str
    scope: str | None
    layout: dict[str, Any]  # Layout.to_dict() of the global layout
    fingerprint: str
    regions: dict[str, list[int]]  # describe_regions() of its pieces

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "nonce": self.nonce, "pid": self.pid, "host": self.host,
                "pidns": self.scope, "layout": self.layout, "fingerprint": self.fingerprint,
                "regions": self.regions, "at": time.time()}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: Path) -> Hello:
        regions = _field(obj, "regions", dict, where)
        for name, bounds in regions.items():
            if not isinstance(bounds, list) or not all(type(b) is int and b >= 0 for b in bounds):
                raise IntegrityError(f"{where}: the region of {name!r} is not a list of ints")
        scope = obj.get("pidns")
        return cls(_field(obj, "rank", int, where), _field(obj, "nonce", str, where),
                   _field(obj, "pid", int, where), _field(obj, "host", str, where),
                   scope if isinstance(scope, str) else None, _field(obj, "layout", dict, where),
                   _field(obj, "fingerprint", str, where), regions)

    def dead(self) -> bool:
        """The process that wrote this hello is gone (judged only in our pid namespace)."""
        return judged_by_pid(self.scope) and process_dying(self.pid)

    @property
    def who(self) -> str:
        return f"trainer rank {self.rank} (pid {self.pid} on {self.host})"


def make_hello(rank: int, layout: dict[str, Any], fingerprint: str,
               regions: dict[str, list[int]]) -> Hello:
    return Hello(rank, new_nonce(), os.getpid(), socket.gethostname(), pid_scope(), layout,
                 fingerprint, regions)


@dataclass(frozen=True)
class Failure:
    """Why an attempt was abandoned: ``kind`` is :data:`LOST` (``rank`` died, restarted,
    stopped or was too slow) or :data:`SCHEMA` (``rank``'s layout disagrees)."""

    attempt: str
    rank: int
    kind: str
    message: str


@dataclass(frozen=True)
class Pending:
    """Rank 0's word on the version being written: ``version`` into ``slot``, attempt
    ``attempt``, by the rank incarnations ``nonces`` (rank -> hello nonce) whose layouts it
    checked. ``failure``: the last attempt that failed (this one, if it names it)."""

    version: int
    slot: int
    attempt: str
    nonces: dict[int, str]
    failure: Failure | None = None

    @property
    def failed(self) -> bool:
        return self.failure is not None and self.failure.attempt == self.attempt

    def to_json(self) -> dict[str, Any]:
        failure = None if self.failure is None else {
            "attempt": self.failure.attempt, "rank": self.failure.rank,
            "kind": self.failure.kind, "message": self.failure.message}
        return {"version": self.version, "slot": self.slot, "attempt": self.attempt,
                "ranks": {str(r): n for r, n in sorted(self.nonces.items())},
                "failure": failure, "pid": os.getpid(), "at": time.time()}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: Path) -> Pending:
        ranks = _field(obj, "ranks", dict, where)
        if not all(k.isdigit() and isinstance(v, str) for k, v in ranks.items()):
            raise IntegrityError(f"{where}: ranks must map rank numbers to nonces")
        raw = obj.get("failure")
        failure = None
        if raw is not None:
            if not isinstance(raw, dict):
                raise IntegrityError(f"{where}: failure is not an object")
            failure = Failure(_field(raw, "attempt", str, where), _field(raw, "rank", int, where),
                              _field(raw, "kind", str, where), _field(raw, "message", str, where))
        return cls(_field(obj, "version", int, where), _field(obj, "slot", int, where),
                   _field(obj, "attempt", str, where), {int(k): v for k, v in ranks.items()},
                   failure)


@dataclass(frozen=True)
class RankDone:
    """Rank ``rank`` (incarnation ``nonce``) wrote its part of ``attempt`` (``version``);
    ``checksums``: its share of each bucket checksum."""

    rank: int
    nonce: str
    version: int
    attempt: str
    checksums: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "nonce": self.nonce, "version": self.version,
                "attempt": self.attempt, "checksums": [str(c) for c in self.checksums],
                "pid": os.getpid(), "at": time.time()}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: Path) -> RankDone:
        return cls(_field(obj, "rank", int, where), _field(obj, "nonce", str, where),
                   _field(obj, "version", int, where), _field(obj, "attempt", str, where),
                   _sums(obj.get("checksums"), where))


class ControlFiles:
    """Reads and writes one directory's rank files, parsing a file again only when its
    bytes changed (rank 0 polls them every few milliseconds while a version is written)."""

    def __init__(self, directory: Path, mode: int) -> None:
        self.directory = directory
        self.mode = mode
        self._cache: dict[Path, tuple[bytes, Any]] = {}

    def _read(self, path: Path, parse: Any) -> Any:
        known = self._cache.get(path)
        found = read_json_if_changed(path, known[0] if known else None)
        if found is None:
            self._cache.pop(path, None)
            return None
        raw, obj = found
        if obj is None and known is not None:
            return known[1]
        value = parse(obj, path)
        self._cache[path] = (raw, value)
        return value

    def hello(self, rank: int) -> Hello | None:
        return self._read(hello_path(self.directory, rank), Hello.from_json)

    def pending(self) -> Pending | None:
        return self._read(self.directory / PENDING, Pending.from_json)

    def done(self, rank: int) -> RankDone | None:
        return self._read(rank_path(self.directory, rank), RankDone.from_json)

    def write(self, path: Path, record: Hello | Pending | RankDone) -> None:
        # visibility needs only the rename; the manifest is the one file fsynced
        write_json_atomic(path, record.to_json(), mode=self.mode, durable=False)

    def remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._cache.pop(path, None)
