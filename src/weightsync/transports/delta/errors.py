"""The one error of the delta codec: a header or payload that breaks the format. It is an
:class:`IntegrityError` (the bytes that arrived are not what the sender wrote); the
receiver adds which node, version and chunk it came from."""

from __future__ import annotations

from weightsync.core.errors import IntegrityError


class MalformedDeltaError(IntegrityError):
    """A chunk header or delta payload that no sender writes (says what was expected)."""
