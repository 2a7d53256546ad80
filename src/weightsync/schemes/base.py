"""What every scheme is: a picklable description of one sync, handed to every worker.

The public ends it creates are written once: :class:`~weightsync.schemes.sender.WeightSender`
and :class:`~weightsync.schemes.receiver.WeightReceiver`, each handed its transport's writer
or reader (``core/endpoints.py``).
"""

from __future__ import annotations

import abc
from typing import Any, TypeVar

from weightsync.core.deadline import required_timeout
from weightsync.core.strategy import WeightStrategy
from weightsync.schemes.ranks import for_trainer_ranks, for_workers, pickled_state
from weightsync.schemes.receiver import WeightReceiver
from weightsync.schemes.sender import WeightSender

DEFAULT_TIMEOUT = 60.0

S = TypeVar("S", bound="WeightSyncScheme")


class WeightSyncScheme(abc.ABC):
    """A picklable description of one sync: hand it to every worker with its index."""

    def __init__(
        self, *, timeout: float = DEFAULT_TIMEOUT, strategy: WeightStrategy | None = None
    ) -> None:
        self.timeout = required_timeout(timeout)
        self.strategy = strategy or WeightStrategy(extract_as="state_dict")

    @property
    def peer_timeout(self) -> float:
        """How long a peer may take to answer within an exchange already under way (a
        message half read, the group's store): the scheme's timeout, or
        :data:`DEFAULT_TIMEOUT` when it is 0 (then calls do not wait for a version, but a
        transfer that started is not cut short)."""
        return self.timeout or DEFAULT_TIMEOUT

    def for_workers(self: S) -> S:
        """What to hand workers: this scheme; a sharded one's (``trainer_ranks > 1``) copy
        without its trainer ranks' key (in this process as in its pickle), so that no
        worker can act as a trainer rank, even in a thread or a fork (docs/security.md)."""
        config = getattr(self, "config", None)
        return for_workers(self) if getattr(config, "rank_key", "") else self

    def for_trainer_ranks(self: S) -> S:
        """What to hand a sharded trainer's ranks: this scheme, with the rank key in its
        pickle (its own pickle carries it too; this refuses the workers' copy, which has
        none and cannot get it back)."""
        return for_trainer_ranks(self)

    def __getstate__(self) -> dict[str, Any]:
        return pickled_state(self)  # the workers' copy holds no rank key

    @abc.abstractmethod
    def create_sender(self) -> WeightSender:
        """The trainer-side end of this scheme."""

    @abc.abstractmethod
    def create_receiver(self, worker_idx: int = 0) -> WeightReceiver:
        """The end for worker ``worker_idx``."""
