"""Owner records: which process made a directory that weightsync leaves on a server's host
(a LoRA adapter's versions, a network receiver's staging), so that the next server to start
removes those whose process is gone (vLLM kills its workers at exit, before any clean-up of
theirs can run), and nothing else.

A record names its process by pid, start time (a pid alone may be reused) and pid scope
(:func:`~weightsync.core.liveness.pid_scope`): servers in containers that share /dev/shm
(``--ipc=host``) number their pids apart, so the record of a process in another pid
namespace is never judged dead here, only left alone. A sweep only looks at private
directories of this user holding a record of the kind it sweeps.
"""

from __future__ import annotations

import enum
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.core.errors import IntegrityError
from weightsync.core.liveness import judged_by_pid, pid_scope, process_start
from weightsync.transports.directory.files import read_json_object, write_json_atomic

logger = logging.getLogger(__name__)

#: in each directory weightsync made on a server's host: the process that owns it
OWNER_FILE = "owner.json"
_MADE_BY = "weightsync"


class Verdict(enum.Enum):
    """What this process can tell of a record's owner."""

    THIS_PROCESS = "this process"
    ALIVE = "alive"
    GONE = "gone"
    UNJUDGED = "of another pid namespace, whose liveness cannot be judged here"


@dataclass(frozen=True)
class Owner:
    """The process that made a directory of kind ``kind``, and what it says of it."""

    kind: str
    pid: int
    start: str | None
    scope: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_this_process(cls, kind: str, **extra: Any) -> Owner:
        pid = os.getpid()
        return cls(kind, pid, process_start(pid), pid_scope(), dict(extra))

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "made_by": _MADE_BY, "kind": self.kind, "pid": self.pid,
                "start": self.start, "pidns": self.scope}

    @classmethod
    def from_json(cls, obj: dict[str, Any], kind: str) -> Owner | None:
        """The record in ``obj`` if it is weightsync's, of ``kind`` and well formed."""
        pid, start, scope = obj.get("pid"), obj.get("start"), obj.get("pidns")
        if obj.get("made_by") != _MADE_BY or obj.get("kind") != kind \
                or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 \
                or not isinstance(start, (str, type(None))) or not isinstance(scope, (str, type(None))):
            return None
        extra = {k: v for k, v in obj.items() if k not in ("made_by", "kind", "pid", "start", "pidns")}
        return cls(kind, pid, start, scope, extra)

    def verdict(self) -> Verdict:
        """Whether the owner still runs, judged only where its pid means the same process."""
        if self.start is None or not judged_by_pid(self.scope):
            return Verdict.UNJUDGED
        if self.pid == os.getpid():
            return Verdict.THIS_PROCESS if process_start(self.pid) == self.start else Verdict.GONE
        return Verdict.ALIVE if process_start(self.pid) == self.start else Verdict.GONE

    def describe(self) -> str:
        return f"process {self.pid} ({self.verdict().value})"


def write_owner(directory: Path, owner: Owner) -> None:
    """Record ``owner`` in ``directory`` (replacing, never following, what is there)."""
    write_json_atomic(directory / OWNER_FILE, owner.to_json(), mode=0o600, durable=False)


def read_owner(directory: Path, kind: str) -> Owner | None:
    """The record of kind ``kind`` in ``directory``; None if there is none (absent, a
    symlink or other non-regular file, malformed, or another kind)."""
    try:
        obj = read_json_object(directory / OWNER_FILE)
    except (IntegrityError, OSError):
        return None
    return None if obj is None else Owner.from_json(obj, kind)


def private_directory(path: Path) -> bool:
    """Whether ``path`` itself (not what a symlink there points to) is a directory of this
    user that nobody else may enter (no group or other permission bits)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() \
        and stat.S_IMODE(info.st_mode) & 0o077 == 0


def dead_owners(parent: Path, kind: str, prefix: str = "") -> Iterator[tuple[Path, Owner]]:
    """The private directories of this user right under ``parent`` whose names start with
    ``prefix`` and whose record of kind ``kind`` names a process that is gone; a record of
    another pid namespace, or none, keeps a directory out."""
    if pid_scope() is None:
        return  # this process cannot judge any pid: leave every directory
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return
    for name in names:
        path = parent / name
        if not name.startswith(prefix) or not private_directory(path):
            continue
        owner = read_owner(path, kind)
        if owner is None:
            continue
        verdict = owner.verdict()
        if verdict is Verdict.GONE:
            yield path, owner
        elif verdict is Verdict.UNJUDGED:
            logger.debug("left %s: its owner, %s, is %s", path, owner.pid, verdict.value)
