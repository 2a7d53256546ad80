"""The same-host schemes' shared description: ``num_workers`` processes of this host,
reached at an abstract Unix socket address, authenticated by a per-scheme token.

The ends are the common :class:`~weightsync.schemes.sender.WeightSender` and
:class:`~weightsync.schemes.receiver.WeightReceiver`, handed the transport's writer and
reader (``transports/shm/endpoints.py``, ``transports/mp/endpoints.py``).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from weightsync.core.checks import checked_int
from weightsync.core.strategy import WeightStrategy
from weightsync.schemes.base import WeightSyncScheme
from weightsync.transports.local.address import new_address
from weightsync.transports.local.link import LocalLink


def check_num_workers(num_workers: object) -> int:
    return checked_int(num_workers, "num_workers", 1)


@dataclass(frozen=True)
class SameHostConfig:
    """Where the trainer listens and who may connect; validated once, never changed."""

    num_workers: int
    address: str = field(default_factory=new_address)
    token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    #: only processes of this user may connect, on either side
    uid: int = field(default_factory=os.getuid)
    #: the trainer must be this process or one of its descendants: a receiver refuses
    #: any other process found at the address, whatever it knows
    creator_pid: int = field(default_factory=os.getpid)

    def __post_init__(self) -> None:
        check_num_workers(self.num_workers)


class LocalScheme(WeightSyncScheme):
    """A scheme for ``num_workers`` processes of this host; picklable (plain data only)."""

    def __init__(
        self, num_workers: int = 1, *, timeout: float = 60.0,
        strategy: WeightStrategy | None = None,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        self.config = SameHostConfig(num_workers)

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    @property
    def address(self) -> str:
        return self.config.address

    @property
    def token(self) -> str:
        return self.config.token

    def _link(self, worker_idx: int) -> LocalLink:
        """Worker ``worker_idx``'s connection to the trainer (index checked here)."""
        worker_idx = checked_int(worker_idx, "worker_idx")
        if worker_idx >= self.num_workers:
            raise ValueError(f"worker_idx {worker_idx} is out of range: the scheme has "
                             f"num_workers={self.num_workers}")
        c = self.config
        return LocalLink(c.address, c.token, c.uid, c.creator_pid, worker_idx, self.peer_timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_workers={self.num_workers}, timeout={self.timeout})"
