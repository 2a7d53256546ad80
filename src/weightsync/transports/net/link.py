"""A worker's control connection to a network trainer (``net.members`` is the other end):
join, hear of each version, say what this worker's host staged and what it applied, and
notice a trainer that closed or died. Authenticated and sealed like a version's stream."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SenderLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.versions import NO_VERSION
from weightsync.transports.net.handshake import HandshakeError, host_credential, prove_to_trainer
from weightsync.transports.net.members import keep_alive
from weightsync.transports.net.seal import Seal
from weightsync.transports.net.wire import (
    DeadlinePassed,
    ProtocolError,
    connect_when_listening,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)

def worker_credential(token: str, worker_idx: int) -> str:
    """Worker ``worker_idx``'s credential: the scheme's workers hold the token itself."""
    return host_credential(token, f"worker{worker_idx}")


class NetLink:
    """Worker ``worker_idx``'s connection to the trainer at ``address``."""

    def __init__(self, address: str, token: str, worker_idx: int, host: str) -> None:
        self.address = address
        self.worker_idx = worker_idx
        self.credential = worker_credential(token, worker_idx)
        self.host = host
        self.session = ""
        self.cond = threading.Condition()
        self.delivered = NO_VERSION  # the newest version the trainer announced
        #: a sharded trainer's: every rank's address for ``delivered``, the round that
        #: delivers it (a failed round's number comes again in a new one), and the newest
        #: version the ranks committed (only those are applied); empty/-1 for one trainer
        self.ranks: list[str] = []
        self.round = ""
        self.committed = NO_VERSION
        #: where this host fetches ``delivered`` from (:mod:`.relay`): the relays before it,
        #: nearest first (empty: the trainer)
        self.sources: list[str] = []
        #: this worker fetches for its host, which hosts after it fetch from (its relay)
        self.lead = False
        self.feeds = False
        self.layout: dict[str, Any] | None = None  # the trainer's, from its first notice
        self.sender_lost: str | None = None
        #: called (from the reader thread) at each notice and when the trainer is gone
        self.on_event: Callable[[], None] = lambda: None
        #: what else the join says, given the address this worker reaches the trainer
        #: from (its relay's address and its host, so that its first notice routes it)
        self.join_extra: Callable[[str], dict[str, Any]] = lambda local: {}
        self._sock: socket.socket | None = None
        self._seal: Seal | None = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closing = False

    def open(self, deadline: Deadline) -> None:
        """Connect (waiting for a trainer not listening yet), authenticate both ways, join,
        and start reading the trainer's notices."""
        sock = self._connect(deadline)
        try:
            seal = prove_to_trainer(sock, self.credential, self.host, deadline)
            extra = self.join_extra(str(sock.getsockname()[0]))
            send_frame(sock, {**extra, "join": self.worker_idx}, seal)
            welcome = recv_frame(sock, seal=seal, deadline=deadline,
                                 what=f"worker {self.worker_idx}: the trainer's welcome")
        except DeadlinePassed:
            sock.close()
            raise WeightSyncTimeoutError(f"worker {self.worker_idx}: the trainer at "
                                         f"{self.address} did not answer within {deadline}") from None
        except (HandshakeError, ProtocolError, IntegrityError, OSError) as exc:
            sock.close()
            raise SenderLostError(f"worker {self.worker_idx}: joining the trainer at "
                                  f"{self.address} failed: {exc}") from None
        if "error" in welcome:
            sock.close()
            raise WeightSyncError(f"worker {self.worker_idx}: the trainer at {self.address} "
                                  f"refused it: {welcome['error']}")
        sock.settimeout(None)
        keep_alive(sock)
        self.session = str(welcome.get("session", ""))
        self._sock, self._seal = sock, seal
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"weightsync-net-link-{self.worker_idx}")
        self._reader.start()

    def _connect(self, deadline: Deadline) -> socket.socket:
        try:
            return connect_when_listening(self.address, deadline)
        except TimeoutError as exc:
            raise WeightSyncTimeoutError(f"worker {self.worker_idx}: no trainer listening at "
                                         f"{self.address} within {deadline}") from exc
        except OSError as exc:
            raise SenderLostError(f"worker {self.worker_idx}: cannot reach the trainer at "
                                  f"{self.address}: {exc}") from None

    def _read(self) -> None:
        assert self._sock is not None and self._seal is not None
        why = "the sender closed the connection; did the trainer die?"
        try:
            while True:
                message = recv_frame(self._sock, seal=self._seal,
                                     what=f"worker {self.worker_idx}: a trainer's notice")
                if message.get("close"):
                    why = "the trainer closed its sender"
                    break
                version = message.get("notice")
                if type(version) is int:
                    with self.cond:
                        if isinstance(message.get("layout"), dict):
                            self.layout = message["layout"]
                        if version >= self.delivered:
                            self._take_ranks(message)
                            self._take_route(message)
                        self.delivered = max(self.delivered, version)
                        if type(message.get("committed")) is int:
                            self.committed = max(self.committed, message["committed"])
                        self.cond.notify_all()
                    self.on_event()
        except (ProtocolError, IntegrityError, OSError) as exc:
            if self._closing:
                return
            if not isinstance(exc, ProtocolError) or "closed" not in str(exc):
                why = f"the connection to the sender broke ({type(exc).__name__}: {exc})"
        with self.cond:
            self.sender_lost = f"{why} (trainer at {self.address})"
            self.cond.notify_all()
        self.on_event()

    def _take_ranks(self, notice: dict[str, Any]) -> None:
        """A sharded trainer's notice: where each rank serves its part, and which round."""
        ranks = notice.get("ranks")
        if isinstance(ranks, list) and all(isinstance(a, str) for a in ranks):
            self.ranks = list(ranks)
        self.round = str(notice.get("round", ""))[:64]

    def _take_route(self, notice: dict[str, Any]) -> None:
        """Whom this host fetches the version from, and whether hosts fetch from it."""
        sources = notice.get("sources")
        self.sources = [a for a in sources if isinstance(a, str)][:8] \
            if isinstance(sources, list) else []
        self.lead, self.feeds = notice.get("lead") is True, notice.get("feeds") is True

    def send(self, message: dict[str, Any]) -> None:
        """Tell the trainer ``message``; a trainer that is gone is noticed by the reader."""
        if self._sock is None or self._seal is None:
            return
        with self._send_lock, contextlib.suppress(OSError):
            send_frame(self._sock, message, self._seal)

    def wait_layout(self, deadline: Deadline) -> dict[str, Any]:
        """The trainer's layout, from its first notice (it publishes version 0 at connect)."""
        with self.cond:
            while self.layout is None:
                self.check_sender(NO_VERSION)
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker {self.worker_idx}: the trainer at {self.address} published "
                        f"no version within {deadline}")
                self.cond.wait(deadline.slice(0.2))
            return self.layout

    def check_sender(self, version: int) -> None:
        if self.sender_lost is not None:
            raise SenderLostError(f"worker {self.worker_idx}: {self.sender_lost}; it keeps "
                                  f"version {version}")

    def close(self) -> None:
        """Say goodbye (a clean leave, not a loss) and end the connection."""
        self._closing = True
        if self._sock is None:
            return
        self.send({"bye": True})
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        self._sock.close()
