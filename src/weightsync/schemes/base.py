"""What every scheme is: a picklable description of one sync, handed to every worker.

The public ends it creates are written once: :class:`~weightsync.schemes.sender.WeightSender`
and :class:`~weightsync.schemes.receiver.WeightReceiver`, each handed its transport's writer
or reader (``core/endpoints.py``).
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING

from typing_extensions import Self

from weightsync.core.strategy import WeightStrategy

if TYPE_CHECKING:
    from weightsync.schemes.receiver import WeightReceiver
    from weightsync.schemes.sender import WeightSender

DEFAULT_TIMEOUT = 60.0


class WeightSyncScheme(abc.ABC):
    """A picklable description of one sync: hand it to every worker with its index."""

    def __init__(
        self, *, timeout: float = DEFAULT_TIMEOUT, strategy: WeightStrategy | None = None
    ) -> None:
        if timeout is None or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.strategy = strategy or WeightStrategy(extract_as="state_dict")

    @abc.abstractmethod
    def create_sender(self) -> WeightSender:
        """The trainer-side end of this scheme."""

    @abc.abstractmethod
    def create_receiver(self, worker_idx: int = 0) -> WeightReceiver:
        """The end for worker ``worker_idx``."""


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
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()
