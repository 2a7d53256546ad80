"""What both ends of a scheme share: the settings they read, and closing.

Kept apart from ``schemes/base.py`` so the ends never import the scheme classes that
create them.
"""

from __future__ import annotations

from typing import Protocol

from typing_extensions import Self


class SyncSettings(Protocol):
    """The scheme as its ends see it."""

    #: the default deadline of a blocking call, in seconds
    timeout: float


class Closable:
    """``close()``, ``with`` and close-on-garbage-collection, for senders and receivers."""

    _closed = False

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # no module-level names here: at interpreter exit they may already be None
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
