"""The same-host schemes' shared description: ``num_workers`` processes of this host,
reached at an abstract Unix socket address, authenticated by a per-scheme token.

The sender side lives in ``schemes.local_sender`` (membership and the send lifecycle; its
hub thread, in ``transports.local_hub``, admits authenticated workers) and the receiver
side in ``schemes.local_receiver`` (the handshake and a reader thread).
"""

from __future__ import annotations

import os
import secrets

from weightsync.core.strategy import WeightStrategy
from weightsync.schemes.base import WeightSyncScheme
from weightsync.transports.local_channel import new_address


class LocalScheme(WeightSyncScheme):
    """A scheme for ``num_workers`` processes of this host; picklable (plain data only)."""

    def __init__(
        self, num_workers: int = 1, *, timeout: float = 60.0,
        strategy: WeightStrategy | None = None,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self.address = new_address()
        self.token = secrets.token_hex(16)
        self.uid = os.getuid()  # only processes of this user may connect, on either side
        # the trainer must be this process or one of its descendants: a receiver refuses
        # any other process found at the address, whatever it knows
        self.creator_pid = os.getpid()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_workers={self.num_workers}, timeout={self.timeout})"
