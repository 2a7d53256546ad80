"""The rank protocol's board in one directory (:mod:`weightsync.transports.ranks`): the
records are small JSON files, each with one writer.

::

    hello-<r>.json    rank r: its hello (incarnation, global layout, regions) and, to judge
                      its liveness by, its pid, host and pid namespace
    pending.json      rank 0: the current plan (version n into slot i) and the outcomes
                      of the last few attempts
    rank-<r>.json     rank r: its done record of an attempt, with its checksum shares
    rank-key          the ranks' key (:func:`shared_rank_key`), readable by the scheme's
                      file mode only

Each file is written atomically (temp file + rename) and read by the others as untrusted
input (validated, never unpickled), like the manifest and acks. Every record is sealed with
the scheme's rank key (:mod:`weightsync.transports.ranks.seal`): one that does not prove
it (written by a reader of the directory, or by a process handed another scheme) is
dropped and logged, so a process without the key can neither join, answer nor plan. A committed version is
also the manifest's: a rank that sees the manifest name its plan's version knows it was
committed even if rank 0 has moved on since. Rank 0 is gone when ``sender.lock`` is no
longer held.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from weightsync.core.errors import IntegrityError, WeightSyncError
from weightsync.transports.directory.files import (
    create_temp,
    ensure_directory,
    open_regular,
    read_json_if_changed,
    write_json_atomic,
)
from weightsync.transports.directory.manifest import ManifestCache, sender_alive
from weightsync.transports.ranks.liveness import claim_refused, hello_dead, lost_verdict
from weightsync.transports.ranks.records import Done, Hello, Outcome, Plan
from weightsync.transports.ranks.seal import (
    DONE,
    HELLO,
    OUTCOME,
    PLAN,
    DropLog,
    RecordSeal,
    UnsealedRecordError,
)

logger = logging.getLogger(__name__)

PENDING = "pending.json"
RANK_KEY = "rank-key"
#: the key's length in hex digits (:func:`weightsync.schemes.ranks.new_rank_key`)
_KEY_HEX = 32
#: outcomes ``pending.json`` keeps (a rank that looks late still finds its attempt's)
KEPT_OUTCOMES = 8

T = TypeVar("T")


def shared_rank_key(directory: Path, mode: int, new_key: Callable[[], str]) -> str:
    """The trainer ranks' key of a sharded directory: its ``rank-key`` file, which the first
    process to ask creates (``new_key()``, linked in whole, never half-written). Rank
    processes that each make the scheme again (``torchrun``) thus hold the same key; a
    scheme handed over pickled carries it. Who may read the directory's files may read it:
    the directory's file mode is this transport's boundary (docs/security.md)."""
    ensure_directory(directory, mode, create=True)
    path = directory / RANK_KEY
    while True:
        with contextlib.suppress(FileNotFoundError):
            fd = open_regular(path, os.O_RDONLY)
            try:
                text = os.read(fd, 4 * _KEY_HEX).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            if len(text) != _KEY_HEX or any(ch not in "0123456789abcdef" for ch in text):
                raise IntegrityError(
                    f"{path} does not hold a rank key ({_KEY_HEX} hex digits): remove it, and "
                    "every trainer rank makes its scheme again")
            return text
        tmp, fd = create_temp(directory, RANK_KEY, mode)
        try:
            try:
                os.write(fd, new_key().encode("ascii"))
                os.fsync(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):  # another rank linked its key first
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def hello_path(directory: Path, rank: int) -> Path:
    return directory / f"hello-{rank}.json"


def rank_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


class Pending:
    """``pending.json``: the current plan and the outcomes of the last attempts."""

    def __init__(self, plan: Plan | None, outcomes: list[Outcome]) -> None:
        self.plan, self.outcomes = plan, outcomes

    def outcome(self, attempt: str) -> Outcome | None:
        return next((o for o in reversed(self.outcomes) if o.attempt == attempt), None)

    def to_json(self, seal: RecordSeal) -> dict[str, Any]:
        return {"plan": None if self.plan is None else seal.seal(PLAN, self.plan.to_json()),
                "outcomes": [seal.seal(OUTCOME, o.to_json()) for o in self.outcomes],
                "at": time.time()}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str, seal: RecordSeal) -> Pending:
        """Rank 0's records, each proving the rank key (else UnsealedRecordError)."""
        raw = obj.get("outcomes")
        if not isinstance(raw, list):
            raise IntegrityError(f"{where}: outcomes must be a list")
        plan = obj.get("plan")
        return cls(None if plan is None else Plan.from_json(seal.opened(PLAN, plan, where),
                                                           where),
                   [Outcome.from_json(seal.opened(OUTCOME, o, where), where) for o in raw])


class RankFiles:
    """Reads and writes one directory's rank files, sealed with the rank key, parsing a file
    again only when its bytes changed (the ranks poll them every few milliseconds while a
    version is written)."""

    def __init__(self, directory: Path, mode: int, rank_key: str) -> None:
        self.directory, self.mode = directory, mode
        self.seal = RecordSeal(rank_key)
        self.drops = DropLog(logger)
        self._cache: dict[Path, tuple[bytes, Any]] = {}

    def safe(self, rank: int, read: Callable[[], T]) -> T | None:
        """What ``read`` returns, None for a record that is unreadable or does not prove
        the rank key (dropped, and logged naming ``rank``)."""
        try:
            return read()
        except UnsealedRecordError as exc:
            self.drops.dropped(rank, exc)
            return None
        except IntegrityError:
            return None

    def read(self, path: Path, parse: Callable[[dict[str, Any], str], T]) -> T | None:
        """The record in ``path`` (None if absent), or the IntegrityError it raised (again
        while its bytes stay the same: :class:`UnsealedRecordError` for a forged one)."""
        known = self._cache.get(path)
        found = read_json_if_changed(path, known[0] if known else None)
        if found is None:
            self._cache.pop(path, None)
            return None
        raw, obj = found
        if obj is None and known is not None:
            value = known[1]
        else:
            try:
                value = parse(obj or {}, str(path))
            except IntegrityError as exc:
                value = exc
            self._cache[path] = (raw, value)
        if isinstance(value, IntegrityError):
            raise value
        return value  # type: ignore[no-any-return]

    def write(self, path: Path, kind: str, record: dict[str, Any]) -> None:
        """Write ``record`` sealed as ``kind``."""
        self.write_plain(path, self.seal.seal(kind, record))

    def write_plain(self, path: Path, obj: dict[str, Any]) -> None:
        # visibility needs only the rename; the manifest is the one file fsynced
        write_json_atomic(path, obj, mode=self.mode, durable=False)

    def remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._cache.pop(path, None)

    def pending(self) -> Pending | None:
        return self.read(self.directory / PENDING,
                         lambda obj, where: Pending.from_json(obj, where, self.seal))

    def hello(self, rank: int) -> Hello | None:
        return self.read(hello_path(self.directory, rank), lambda obj, where: Hello.from_json(
            self.seal.opened(HELLO, obj, where), where))

    def done(self, rank: int) -> Done | None:
        return self.read(rank_path(self.directory, rank), lambda obj, where: Done.from_json(
            self.seal.opened(DONE, obj, where), where))


class LeadFiles:
    """Rank 0's side of the board (a :class:`~weightsync.transports.ranks.board.LeadBoard`)."""

    def __init__(self, directory: Path, mode: int, world: int, poll_interval: float,
                 rank_key: str) -> None:
        self.files = RankFiles(directory, mode, rank_key)
        self.directory, self.world, self.poll_interval = directory, world, poll_interval
        existing = self.files.safe(0, self.files.pending)  # outcomes of an earlier rank 0
        self._plan: Plan | None = None
        self._outcomes: list[Outcome] = [] if existing is None else existing.outcomes

    def hellos(self) -> dict[int, Hello]:
        out = {}
        for rank in range(1, self.world):
            hello = self.files.safe(rank, lambda r=rank: self.files.hello(r))  # type: ignore[misc]
            if hello is not None and hello.rank == rank and not hello_dead(hello):
                out[rank] = hello
        return out

    def lost(self, rank: int, incarnation: str) -> str:
        try:
            hello = self.files.hello(rank)
        except UnsealedRecordError as exc:  # a forgery: the rank re-posts, its done decides
            self.files.drops.dropped(rank, exc)
            return ""
        except IntegrityError as exc:
            return f"left an unreadable hello file ({exc})"
        return lost_verdict(hello, incarnation, "closed (its hello file is gone)")

    def post_plan(self, plan: Plan) -> None:
        self._plan = plan
        self._write()

    def dones(self, attempt: str) -> dict[int, Done]:
        out = {}
        for rank in range(1, self.world):
            done = self.files.safe(rank, lambda r=rank: self.files.done(r))  # type: ignore[misc]
            if done is not None and done.rank == rank and done.attempt == attempt:
                out[rank] = done
        return out

    def post_outcome(self, outcome: Outcome) -> None:
        self._outcomes = [*self._outcomes, outcome][-KEPT_OUTCOMES:]
        self._write()

    def _write(self) -> None:
        self.files.write_plain(self.directory / PENDING,
                               Pending(self._plan, self._outcomes).to_json(self.files.seal))

    def wait(self, seconds: float) -> None:
        time.sleep(min(seconds, self.poll_interval))


class MemberFiles:
    """The side of rank ``rank`` (a
    :class:`~weightsync.transports.ranks.board.MemberBoard`)."""

    def __init__(self, directory: Path, mode: int, rank: int, poll_interval: float,
                 rank_key: str) -> None:
        self.files = RankFiles(directory, mode, rank_key)
        self.directory, self.rank, self.poll_interval = directory, rank, poll_interval
        self._manifests = ManifestCache(directory)
        self._versions: dict[str, int] = {}  # attempt -> version, of the plans seen
        self._lead_seen = False
        self.posted: Hello | None = None

    def post_hello(self, hello: Hello) -> None:
        """Write this rank's hello, unless another live process holds the rank: a second
        claimant is refused, saying so (judged by pid where both share a pid namespace); a
        hello that does not prove the rank key holds nothing."""
        try:
            held = self.files.hello(self.rank)
        except IntegrityError:
            held = None
        why = claim_refused(held, hello)
        if why:
            raise WeightSyncError(f"{why} (in {self.directory})")
        self.files.write(hello_path(self.directory, self.rank), HELLO, hello.to_json())
        self.posted = hello

    def _keep_hello(self) -> None:
        """Write this rank's hello again if its file is gone or holds one that does not prove
        the rank key (a process without the key overwrote it); one that proves it and names
        another incarnation is a restart's, which this process does not fight."""
        if self.posted is None:
            return
        try:
            if self.files.hello(self.rank) is not None:
                return
        except UnsealedRecordError as exc:
            self.files.drops.dropped(self.rank, exc)
        except IntegrityError:
            pass
        self.files.write(hello_path(self.directory, self.rank), HELLO, self.posted.to_json())

    def post_done(self, done: Done) -> None:
        self.files.write(rank_path(self.directory, self.rank), DONE, done.to_json())

    def plans(self) -> list[Plan]:
        self._keep_hello()
        pending = self.files.safe(0, self.files.pending)
        if pending is None or pending.plan is None:
            return []
        self._versions[pending.plan.attempt] = pending.plan.version
        return [pending.plan]

    def outcome(self, attempt: str) -> Outcome | None:
        pending = self.files.safe(0, self.files.pending)
        found = None if pending is None else pending.outcome(attempt)
        if found is not None:
            return found
        version = self._versions.get(attempt)
        if version is not None:  # rank 0 committed it, and may have moved on since
            try:
                manifest = self._manifests.read()
            except IntegrityError:
                manifest = None
            if manifest is not None and manifest.latest.version >= version:
                return Outcome(attempt, version, True)
        return None

    def lead_lost(self) -> str:
        if sender_alive(self.directory):
            self._lead_seen = True
            return ""
        if self._lead_seen:
            return f"released {self.directory}/sender.lock (it died or closed)"
        return ""

    def wait(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(min(seconds, self.poll_interval))

    def withdraw(self) -> None:
        """Remove this rank's hello if it is still this process's (rank 0 then waits for
        a new one)."""
        try:
            hello = self.files.hello(self.rank)
        except IntegrityError:
            return
        if self.posted is not None and hello is not None \
                and hello.incarnation == self.posted.incarnation:
            self.files.remove(hello_path(self.directory, self.rank))
