"""The four records the ranks of a sharded trainer exchange, whatever carries them (socket
messages, JSON files, a Ray actor): a rank's hello, rank 0's plan of an attempt, a rank's
done, and rank 0's outcome of the attempt.

Every answer names what it answers: a done names the attempt and the incarnation (the
hello) of the rank that wrote it, an outcome names the attempt. A record that answers
another attempt is stale and dropped, so one late rank costs at most the attempt it missed.
Records cross process boundaries as JSON-safe dicts and are read back as untrusted input:
validated field by field, never unpickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    TrainerRankLostError,
    WeightSyncError,
)

#: why an attempt failed: a rank was lost, the ranks' layouts disagree, or something else
LOST, SCHEMA, FAILED = "lost", "schema", "failed"


def new_id() -> str:
    """A fresh incarnation or attempt id (64 random bits, hex)."""
    return os.urandom(8).hex()


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise IntegrityError(f"{where}: not a record")
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise IntegrityError(f"{where}: {key} has the wrong type ({type(value).__name__})")
    return value


def _detail(obj: dict[str, Any], where: str) -> dict[str, Any]:
    detail = obj.get("detail", {})
    if not isinstance(detail, dict):
        raise IntegrityError(f"{where}: detail is not an object")
    return detail


@dataclass(frozen=True)
class Hello:
    """Rank ``rank`` announcing itself: a fresh ``incarnation`` per process and per model it
    registers, its global layout and the regions it writes (``describe_regions``)."""

    rank: int
    incarnation: str
    layout: dict[str, Any]
    fingerprint: str
    regions: dict[str, list[int]]
    #: the medium's (a pid and host to judge liveness by)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "incarnation": self.incarnation, "layout": self.layout,
                "fingerprint": self.fingerprint, "regions": self.regions, "detail": self.detail}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Hello:
        regions = _get(obj, "regions", dict, where)
        for name, bounds in regions.items():
            if not isinstance(bounds, list) or not all(type(b) is int and b >= 0 for b in bounds):
                raise IntegrityError(f"{where}: the region of {name!r} is not a list of ints")
        return cls(_get(obj, "rank", int, where), _get(obj, "incarnation", str, where),
                   _get(obj, "layout", dict, where), _get(obj, "fingerprint", str, where),
                   regions, _detail(obj, where))


@dataclass(frozen=True)
class Plan:
    """Rank 0's word: attempt ``attempt`` writes ``version``, by the rank incarnations
    ``incarnations`` (rank -> hello incarnation) whose layouts it checked; ``detail``
    is the medium's (the slot to write, the group generation)."""

    version: int
    attempt: str
    incarnations: dict[int, str]
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "attempt": self.attempt,
                "incarnations": {str(r): i for r, i in sorted(self.incarnations.items())},
                "detail": self.detail}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Plan:
        incarnations = _get(obj, "incarnations", dict, where)
        if not all(k.isdigit() and isinstance(v, str) for k, v in incarnations.items()):
            raise IntegrityError(f"{where}: incarnations must map rank numbers to ids")
        return cls(_get(obj, "version", int, where), _get(obj, "attempt", str, where),
                   {int(k): v for k, v in incarnations.items()}, _detail(obj, where))


@dataclass(frozen=True)
class Done:
    """Rank ``rank`` (incarnation ``incarnation``) wrote its part of ``attempt``;
    ``detail``: the medium's (checksum shares, an error its data plane hit)."""

    rank: int
    incarnation: str
    attempt: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "incarnation": self.incarnation, "attempt": self.attempt,
                "detail": self.detail}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Done:
        return cls(_get(obj, "rank", int, where), _get(obj, "incarnation", str, where),
                   _get(obj, "attempt", str, where), _detail(obj, where))


@dataclass(frozen=True)
class Outcome:
    """How attempt ``attempt`` of ``version`` ended: committed, or failed (``kind`` is
    :data:`LOST`, :data:`SCHEMA` or :data:`FAILED`; ``rank`` the rank to blame)."""

    attempt: str
    version: int
    committed: bool
    kind: str = ""
    rank: int = 0
    message: str = ""
    key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "version": self.version, "committed": self.committed,
                "kind": self.kind, "rank": self.rank, "message": self.message, "key": self.key}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Outcome:
        committed = obj.get("committed") if isinstance(obj, dict) else None
        if not isinstance(committed, bool):
            raise IntegrityError(f"{where}: committed must be true or false")
        key = obj.get("key")
        return cls(_get(obj, "attempt", str, where), _get(obj, "version", int, where),
                   committed, _get(obj, "kind", str, where), _get(obj, "rank", int, where),
                   _get(obj, "message", str, where), key if isinstance(key, str) else None)

    def error(self, rank: int, note: str = "") -> WeightSyncError:
        """What rank ``rank`` raises for this failed attempt: the same as every rank."""
        message = (f"trainer rank {rank}: version {self.version} was not committed: "
                   f"{self.message}{note}")
        if self.kind == SCHEMA:
            return SchemaMismatchError(message, key=self.key)
        if self.kind == LOST:
            return TrainerRankLostError(message, rank=self.rank)
        return WeightSyncError(message)


def failure(plan: Plan, error: BaseException) -> Outcome:
    """The outcome that fails ``plan`` because of ``error`` (rank 0's own, or a rank's)."""
    if isinstance(error, SchemaMismatchError):
        return Outcome(plan.attempt, plan.version, False, SCHEMA,
                       int(getattr(error, "rank", 0) or 0), str(error), error.key)
    if isinstance(error, TrainerRankLostError):
        return Outcome(plan.attempt, plan.version, False, LOST, error.rank, str(error))
    return Outcome(plan.attempt, plan.version, False, FAILED, 0,
                   f"trainer rank 0: {type(error).__name__}: {error}")
