"""The rank key's proof on the records of a board whose medium does not authenticate who
wrote a record (files, a Ray actor), written once for every such board.

Each record carries an HMAC-SHA256, under the scheme's rank key (which workers handed
``scheme.for_workers()`` never receive), over its kind and its whole content: the rank
index, the incarnation, and, for a done or an outcome, the attempt, a fresh 64-bit random
id rank 0 draws for each attempt (its nonce for that round, bound to its version by rank
0's sealed plan). A record forged without the key does not verify, and a sealed record
cannot be passed off as another kind, another rank's, or another attempt's. What does not
verify is dropped by the reader, never acted on.

A hello names no round (a rank announces itself before rank 0 may exist): a replayed hello
is a real rank's, judged alive or dead by its pid like the original; a round it names can
only be answered by a done sealed with the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

from weightsync.core.errors import IntegrityError

#: the kinds of record a board carries (a record is sealed and checked as one of them)
HELLO, PLAN, DONE, OUTCOME, WITHDRAW = "hello", "plan", "done", "outcome", "withdraw"
#: the field that carries the proof
MAC = "mac"
_LABEL = b"weightsync trainer-rank record\x00"


class UnsealedRecordError(IntegrityError):
    """A record that does not prove the scheme's rank key: forged, damaged, or written by a
    process handed another scheme (each scheme draws its own key)."""


class RecordSeal:
    """Seals and checks the records of one scheme's ranks with its rank key."""

    def __init__(self, rank_key: str) -> None:
        if not isinstance(rank_key, str) or not rank_key:
            raise ValueError("a trainer rank's board needs the scheme's rank key (the "
                             "workers' copy of a scheme has none)")
        self._key = rank_key.encode()

    def seal(self, kind: str, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with its proof, as the board carries it (a proof it already had is
        replaced)."""
        body = {k: v for k, v in record.items() if k != MAC}
        return {**body, MAC: self._mac(kind, body)}

    def opened(self, kind: str, obj: Any, where: str) -> dict[str, Any]:
        """The content of the sealed record ``obj``, or :class:`UnsealedRecordError` (``where``
        says whose record it claims to be) if its proof does not verify."""
        if not isinstance(obj, dict):
            raise IntegrityError(f"{where}: not a record")
        body = {k: v for k, v in obj.items() if k != MAC}
        proof = obj.get(MAC)
        try:
            expected = self._mac(kind, body)
        except (TypeError, ValueError) as exc:
            raise IntegrityError(f"{where}: not a JSON record ({exc})") from None
        if not isinstance(proof, str) or not hmac.compare_digest(proof, expected):
            raise UnsealedRecordError(
                f"{where} does not prove the scheme's rank key (forged, or written by a "
                "process with another scheme's key: every rank must be handed the same one)")
        return body

    def _mac(self, kind: str, body: dict[str, Any]) -> str:
        payload = json.dumps([kind, body], sort_keys=True, separators=(",", ":"),
                             allow_nan=False).encode()
        return hmac.new(self._key, _LABEL + payload, hashlib.sha256).hexdigest()


class DropLog:
    """Logs a record a reader drops, naming the rank it claims to be from, once while it
    stays the same (boards are polled every few milliseconds)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._last: dict[int, object] = {}

    def dropped(self, rank: int, error: IntegrityError, record: Any = None) -> None:
        """``error`` dropped a record of ``rank``: ``record`` (its proof tells one forgery
        from the next), or the error itself where a reader keeps it while the bytes stay."""
        proof = record.get(MAC) if isinstance(record, dict) else None
        key: object = (proof if isinstance(proof, str) else str(error)) \
            if record is not None else error
        if self._last.get(rank) == key:
            return
        self._last[rank] = key
        self._logger.warning("dropped a record claiming to be trainer rank %d's: %s", rank,
                             error)
