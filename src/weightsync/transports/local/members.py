"""Who is connected to a same-host trainer: the hub's owner on the trainer's side.

:class:`Members` is handed the authenticated workers by the hub (``local.hub``) and keeps,
for each worker index, its channel, its process watch and the version it confirmed. It
tells the transport that holds it of joins and losses through two callbacks (events, not
subclass hooks), and answers the waits of the send lifecycle: until targets confirmed a
version, until every worker holds one. A worker that said goodbye is not lost, and a dead
worker is reported by name.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import (
    SchemaMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.liveness import ProcessWatch
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.transports.local.auth import PeerCredentials
from weightsync.transports.local.channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    Message,
    hung_up,
)
from weightsync.transports.local.hub import HUB_TICK, Hub, close_passed_fds

logger = logging.getLogger(__name__)

#: control messages of the same-host protocol (the "t" field of a frame's header)
WELCOME, REFUSED, ACK, MISMATCH, BYE, CLOSE, VERSION = (
    "welcome", "refused", "ack", "mismatch", "bye", "close", "version")

#: at most this many messages are read from a lost worker's connection, each given this
#: long to arrive whole once it began
_MAX_LEFT_MESSAGES = 64
_LEFT_MESSAGE_TIMEOUT = 0.5

JoinEvent = Callable[[int, Channel], None]
LostEvent = Callable[[int], None]


class Members:
    """The workers of one same-host sender, admitted by its hub."""

    def __init__(self, address: str, token: str, uid: int, num_workers: int,
                 on_join: JoinEvent, on_lost: LostEvent) -> None:
        self.num_workers = num_workers
        self._on_join = on_join
        self._on_lost = on_lost
        self.table = VersionTable(num_workers)
        self.cond = threading.Condition()
        # held while a worker joins and while a version is published, so that a joining
        # worker is either among the targets or finds the version already there
        self.joining = threading.RLock()
        self._channels: dict[int, Channel] = {}
        self._why: dict[int, str] = {}
        self._watches: dict[int, ProcessWatch] = {}
        self._goodbyes: set[int] = set()
        self._mismatches: dict[int, dict[str, str]] = {}  # key/expected/got a worker named
        # binds the address now (a second open sender of the scheme is refused at once);
        # its thread starts with start(), so workers wait in the listen queue until then
        self.hub = Hub(address, token, uid, self)

    # ================================================================== hub events
    def hub_channels(self) -> dict[int, Channel]:
        with self.cond:
            return dict(self._channels)

    def admit(self, channel: Channel, hello: dict[str, Any], peer: PeerCredentials,
              welcome_proof: str) -> None:
        """An authenticated worker said hello: join it, or tell it why not."""
        refusal = self._check_hello(hello)
        if refusal is not None:
            with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                channel.send_nowait({"t": REFUSED} | refusal)
            channel.close()
            return
        with self.joining:
            self._join(int(hello["worker_idx"]), channel, peer.pid, welcome_proof)

    def on_message(self, worker_idx: int, channel: Channel, message: Message) -> None:
        with self.cond:
            if self._channels.get(worker_idx) is not channel:
                return
            self._record(worker_idx, message)
            self.cond.notify_all()

    def _record(self, worker_idx: int, message: Message) -> None:
        """Take a worker's control message into the table (under cond)."""
        kind = message.header.get("t")
        state = self.table.workers[worker_idx]
        if kind == ACK:
            version = message.header.get("v")
            if isinstance(version, int):
                state.version = max(state.version, version)
        elif kind == MISMATCH:
            state.error = self._why[worker_idx] = str(message.header.get("error"))[:2000]
            self._mismatches[worker_idx] = {
                name: str(value)[:500] for name in ("key", "expected", "got")
                if isinstance(value := message.header.get(name), str)}
        elif kind == BYE:
            self._goodbyes.add(worker_idx)

    def on_hangup(self, worker_idx: int, channel: Channel, why: str) -> None:
        self.mark_lost(worker_idx, channel, f"connection closed ({why}); did the process die?")

    def _join(self, idx: int, channel: Channel, pid: int, welcome_proof: str) -> None:
        with self.cond:
            old = self._channels.pop(idx, None)
            if old is not None:
                old.close()
            state = self.table.workers[idx]
            state.connected, state.lost, state.error = True, False, None
            state.pid, state.version = pid, NO_VERSION
            self._why.pop(idx, None)
            self._goodbyes.discard(idx)
            self._mismatches.pop(idx, None)
            self._channels[idx] = channel
            self._watch(idx, pid)
            self.cond.notify_all()
        try:
            channel.send({"t": WELCOME, "worker_idx": idx, "proof": welcome_proof}, timeout=5.0)
            self._on_join(idx, channel)
        except (ChannelClosed, ChannelTimeout, OSError) as exc:
            self.mark_lost(idx, channel, f"failed while joining: {exc}")
            return
        logger.info("worker %d connected (pid %d)", idx, pid)

    def _check_hello(self, hello: dict[str, Any]) -> dict[str, Any] | None:
        idx = hello.get("worker_idx")
        if not isinstance(idx, int) or not 0 <= idx < self.num_workers:
            return {"kind": "index", "error": f"worker_idx {idx!r} is out of range: this "
                    f"scheme has num_workers={self.num_workers}"}
        with self.cond:
            current = self._channels.get(idx)
            watch = self._watches.get(idx)
        if current is not None and not current.peer_closed():
            if watch is not None and watch.dying():  # a forked child may keep its socket open
                self.mark_lost(idx, current, f"process {watch.pid} is dead")
            else:
                pid = self.table.workers[idx].pid
                return {"kind": "index", "error": f"worker {idx} is already connected (pid {pid})"}
        return None

    def mark_lost(self, idx: int, channel: Channel, why: str) -> None:
        """Worker ``idx`` (on ``channel``; a newer channel is left alone) is gone: say why.

        Whoever finds the loss (the hub at a hang-up, a streamer whose write failed, a
        look for dead workers) first reads what the worker sent before it: a worker that
        reports a mismatch and closes is refused for the mismatch, and one that said
        goodbye has left, not died, whichever thread notices first."""
        with self.hub.read_lock:  # the hub reads nothing from this channel meanwhile
            with self.cond:
                if self._channels.get(idx) is not channel:
                    return
            self._read_left(idx, channel)
            with self.cond:
                if self._channels.get(idx) is not channel:
                    return
                goodbye = idx in self._goodbyes
                if goodbye:
                    why = "closed its receiver"
                del self._channels[idx]
                self._watch(idx, None)
                state = self.table.workers[idx]
                state.connected, state.lost = False, True
                self._why[idx] = why
                self.cond.notify_all()
        self._on_lost(idx)
        channel.close()
        (logger.debug if goodbye else logger.warning)(
            "worker %d %s: %s", idx, "left" if goodbye else "lost", why)

    def _read_left(self, idx: int, channel: Channel) -> None:
        """Record the messages worker ``idx`` sent before its loss and the hub has not read
        yet (under the hub's read lock); stops at the end of the stream or of what has
        arrived, and after a bounded number, for a live worker that keeps sending."""
        for _ in range(_MAX_LEFT_MESSAGES):
            if channel.closed or not channel.readable(0.0):
                return
            try:
                message = channel.recv(timeout=_LEFT_MESSAGE_TIMEOUT, max_payload=0)
            except (ChannelClosed, ChannelTimeout, OSError):
                return
            close_passed_fds(message)
            with self.cond:
                self._record(idx, message)

    def _watch(self, idx: int, pid: Any) -> None:
        """Start (or, with no pid, stop) watching worker ``idx``'s process; under cond."""
        old = self._watches.pop(idx, None)
        if old is not None:
            old.close()
        if isinstance(pid, int):
            self._watches[idx] = ProcessWatch(pid)

    # ================================================================== the lifecycle's needs
    def start(self) -> None:
        if not self.hub.running and self.hub.error is None:
            self.hub.start()

    def check_hub(self) -> None:
        """Raise if the hub thread failed: no worker could join or ack any more."""
        if self.hub.error is not None:
            raise WeightSyncError(
                f"the sender's connection hub stopped ({self.hub.error!r}); workers can no "
                "longer join: close this sender and create a new one"
            )

    def drop_dead(self, worker_ids: list[int]) -> None:
        """Mark lost the workers whose socket hung up or whose process is dead or being
        killed. One ``poll`` for all sockets and one ``pread`` per worker: cheap."""
        with self.cond:
            candidates = [(w, self._channels[w], self._watches.get(w))
                          for w in worker_ids if w in self._channels]
        closed = hung_up([channel for _, channel, _ in candidates])
        for w, channel, watch in candidates:
            if channel in closed:
                self.mark_lost(w, channel, "connection closed; did the process die?")
            elif watch is not None and watch.dying():
                self.mark_lost(w, channel, f"process {watch.pid} is dead or being killed")

    def reachable(self, targets: list[int]) -> tuple[list[tuple[int, Channel]], Losses]:
        """The targets' channels, and {worker: why} for those not connected."""
        with self.cond:
            found = [(w, self._channels[w]) for w in targets if w in self._channels]
            gone = {w: self._why.get(w, "not connected") for w in targets
                    if w not in self._channels}
        return found, gone

    def held_versions(self) -> dict[int, int]:
        with self.cond:
            return {w: self.table.workers[w].version for w in self._channels}

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        with self.cond:
            while True:
                self.check_hub()
                slow = []
                for w in targets:
                    if w in lost:
                        continue
                    state = self.table.workers[w]
                    if state.version >= version:
                        continue  # acked (a worker that acked and then left is not lost)
                    if state.lost or w not in self._channels:
                        lost[w] = self._why.get(w, "connection lost")
                    else:
                        slow.append(w)
                if not slow:
                    return
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker(s) {slow} did not confirm version {version} within "
                        f"{deadline} (they are alive but not answering)", worker_ids=slow)
                self.cond.wait(deadline.slice(HUB_TICK))

    def wait_joined(self, version: int, deadline: Deadline,
                    refresh: Callable[[], None] | None = None) -> None:
        """Until every worker holds ``version`` or newer (``refresh`` reads versions the
        workers recorded elsewhere, e.g. shared memory)."""
        with self.cond:
            while True:
                self.check_hub()
                if refresh is not None:
                    refresh()
                workers = self.table.workers.values()
                failed = {w.worker_idx: w.error for w in workers if w.error}
                if failed:
                    idx, why = next(iter(failed.items()))
                    raise SchemaMismatchError(f"worker {idx} refused the weights: {why}",
                                              **self._mismatches.get(idx, {}))
                waiting = [w.worker_idx for w in workers if w.version < version]
                if not waiting:
                    return
                if deadline.expired():
                    lost = [w for w in waiting if self.table.workers[w].lost]
                    if lost:
                        raise WorkerLostError.naming(
                            {w: self._why.get(w, 'connection lost') for w in lost}, version)
                    raise WeightSyncTimeoutError(
                        f"connect: worker(s) {waiting} did not connect and take version "
                        f"{version} within {deadline} (connected: {sorted(self._channels)})",
                        worker_ids=waiting,
                    )
                self.cond.wait(deadline.slice(HUB_TICK))

    def close(self) -> None:
        """Stop the hub and tell every worker the sender left."""
        self.hub.stop()
        with self.cond:
            channels = list(self._channels.values())
            self._channels.clear()
            for idx in list(self._watches):
                self._watch(idx, None)
        for channel in channels:
            with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                channel.send_nowait({"t": CLOSE})
            channel.close()
