"""The sender of a same-host scheme: membership, the send lifecycle (connect, send,
send_async/wait_async with one deadline per call), lost workers and close.

Its hub (``transports.local_hub``) admits authenticated workers and reports their
messages and hang-ups; a subclass says how a version is published and delivered. A
worker that said goodbye is not lost, and a dead worker is reported by name.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.core.deadline import Deadline, human_duration
from weightsync.core.errors import (
    SchemaMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.fork_safety import track_for_fork
from weightsync.core.liveness import ProcessWatch
from weightsync.core.stats import SendRecord
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.schemes.base import WeightSender, lost_error
from weightsync.schemes.local import LocalScheme
from weightsync.transports.local_auth import (
    PeerCredentials,
)
from weightsync.transports.local_channel import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    Message,
    hung_up,
)
from weightsync.transports.local_hub import HUB_TICK as _HUB_TICK
from weightsync.transports.local_hub import Hub

logger = logging.getLogger(__name__)

#: a send that takes longer than this is logged at INFO (others at DEBUG)
SLOW_SEND_SECONDS = 1.0


@dataclass
class _PendingSend:
    version: int
    requested: list[int]
    targets: list[int]
    lost: dict[int, str]
    nbytes: int
    phases: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None


class LocalSender(WeightSender):
    """Sender of a same-host scheme; subclasses say how a version is published."""

    def __init__(self, scheme: LocalScheme) -> None:
        super().__init__(scheme)
        self.scheme: LocalScheme = scheme
        self._table = VersionTable(scheme.num_workers)
        self._cond = threading.Condition()
        # held while a worker joins and while a version is published, so that a joining
        # worker is either among the targets or finds the version already there
        self._membership = threading.RLock()
        self._channels: dict[int, Channel] = {}
        self._why: dict[int, str] = {}
        self._watches: dict[int, ProcessWatch] = {}
        self._reported: set[int] = set()
        self._goodbyes: set[int] = set()
        self._pending: _PendingSend | None = None
        self._forked_copy = False
        # binds the address now (a second open sender of the scheme is refused at once);
        # its thread starts at connect(), so workers wait in the listen queue until then
        self._hub = Hub(scheme.address, scheme.token, scheme.uid, self)
        track_for_fork(self)

    # ================================================================== transport hooks
    @abc.abstractmethod
    def _publish(
        self, flat: Mapping[str, torch.Tensor], targets: list[int], version: int, deadline: Deadline
    ) -> None:
        """Take the snapshot of ``flat`` as ``version`` and make it available to ``targets``."""

    @abc.abstractmethod
    def _deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        """Push ``version`` to each target (or just wake it); returns {worker: why} of losses."""

    @abc.abstractmethod
    def _on_join(self, worker_idx: int, channel: Channel) -> None:
        """A worker (re)connected: hand it what it needs to take the current version."""

    def _on_lost(self, worker_idx: int) -> None:
        """A worker is gone: forget what the transport kept for it."""

    def _close_transport(self) -> None:
        """Release the transport's resources."""

    #: a version counts as delivered once each worker acked it (streams); else once
    #: published, which for shared memory means the worker's next poll() takes it
    _delivery_needs_ack = True

    # ================================================================== hub events
    def hub_channels(self) -> dict[int, Channel]:
        with self._cond:
            return dict(self._channels)

    def admit(self, channel: Channel, hello: dict[str, Any], peer: PeerCredentials,
              welcome_proof: str) -> None:
        """An authenticated worker said hello: join it, or tell it why not."""
        refusal = self._check_hello(hello, peer)
        if refusal is not None:
            with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                channel.send_nowait({"t": "refused"} | refusal)
            channel.close()
            return
        idx = int(hello["worker_idx"])
        with self._membership:
            self._join(idx, channel, peer.pid, welcome_proof)

    def on_message(self, worker_idx: int, channel: Channel, message: Message) -> None:
        kind = message.header.get("t")
        with self._cond:
            if self._channels.get(worker_idx) is not channel:
                return
            state = self._table.workers[worker_idx]
            if kind == "ack":
                version = message.header.get("v")
                if isinstance(version, int):
                    state.version = max(state.version, version)
            elif kind == "mismatch":
                state.error = self._why[worker_idx] = str(message.header.get("error"))[:2000]
            elif kind == "bye":
                self._goodbyes.add(worker_idx)
            self._cond.notify_all()

    def on_hangup(self, worker_idx: int, channel: Channel, why: str) -> None:
        if worker_idx in self._goodbyes:
            self._mark_lost(worker_idx, channel, "closed its receiver", goodbye=True)
        else:
            self._mark_lost(worker_idx, channel, f"connection closed ({why}); did the process die?")

    def _join(self, idx: int, channel: Channel, pid: int, welcome_proof: str) -> None:
        with self._cond:
            old = self._channels.pop(idx, None)
            if old is not None:
                old.close()
            state = self._table.workers[idx]
            state.connected, state.lost, state.error = True, False, None
            state.pid, state.version = pid, NO_VERSION
            self._why.pop(idx, None)
            self._reported.discard(idx)
            self._goodbyes.discard(idx)
            self._channels[idx] = channel
            self._watch(idx, pid)
            self._cond.notify_all()
        try:
            channel.send({"t": "welcome", "worker_idx": idx, "proof": welcome_proof}, timeout=5.0)
            self._on_join(idx, channel)
        except (ChannelClosed, ChannelTimeout, OSError) as exc:
            self._mark_lost(idx, channel, f"failed while joining: {exc}")
            return
        logger.info("worker %d connected (pid %d)", idx, pid)

    def _check_hello(self, hello: dict[str, Any], peer: PeerCredentials) -> dict[str, Any] | None:
        idx = hello.get("worker_idx")
        if not isinstance(idx, int) or not 0 <= idx < self.scheme.num_workers:
            return {
                "kind": "index",
                "error": f"worker_idx {idx!r} is out of range: this scheme has "
                f"num_workers={self.scheme.num_workers}",
            }
        with self._cond:
            current = self._channels.get(idx)
            watch = self._watches.get(idx)
        if current is not None and not current.peer_closed():
            if watch is not None and watch.dying():  # a forked child may keep its socket open
                self._mark_lost(idx, current, f"process {watch.pid} is dead")
            else:
                pid = self._table.workers[idx].pid
                return {"kind": "index", "error": f"worker {idx} is already connected (pid {pid})"}
        return None

    def _mark_lost(self, idx: int, channel: Channel, why: str, *, goodbye: bool = False) -> None:
        with self._cond:
            if self._channels.get(idx) is not channel:
                return
            del self._channels[idx]
            self._watch(idx, None)
            state = self._table.workers[idx]
            state.connected, state.lost = False, True
            self._why[idx] = why
            self._cond.notify_all()
        self._on_lost(idx)
        channel.close()
        if goodbye:
            logger.debug("worker %d left: %s", idx, why)
        else:
            logger.warning("worker %d lost: %s", idx, why)

    # ================================================================== API
    @property
    def version(self) -> int:
        return self._table.published

    def worker_lag(self) -> dict[int, int]:
        with self._cond:
            return self._table.lag()

    def connected_workers(self) -> list[int]:
        with self._cond:
            return sorted(self._channels)

    def connect(self, timeout: float | None = None) -> int:
        return self._connect(self._deadline(timeout))

    def _deadline(self, timeout: float | None) -> Deadline:
        """The one deadline of a public call: from its start to its return."""
        return Deadline(self.scheme.timeout if timeout is None else timeout)

    def _connect(self, deadline: Deadline) -> int:
        self._check_open()
        if not self._hub.running and self._hub.error is None:
            self._hub.start()
        if self._table.published == NO_VERSION:
            flat = self._weights_to_send(None)
            with self._membership:
                with self._cond:
                    targets = sorted(self._channels)
                self._publish(flat, targets, 0, deadline)
                self._table.published = 0
            self._deliver(targets, 0, deadline)
        with self._cond:
            while True:
                self._check_hub()
                workers = self._table.workers.values()
                failed = {w.worker_idx: w.error for w in workers if w.error}
                if failed:
                    idx, why = next(iter(failed.items()))
                    raise SchemaMismatchError(f"worker {idx} refused the weights: {why}")
                waiting = [w.worker_idx for w in workers if w.version < 0]
                if not waiting:
                    return self._table.published
                if deadline.expired():
                    lost = [w for w in waiting if self._table.workers[w].lost]
                    if lost:
                        raise lost_error(lost, self._table.published, self._why)
                    raise WeightSyncTimeoutError(
                        f"connect: worker(s) {waiting} did not connect and take version "
                        f"{self._table.published} within {deadline} "
                        f"(connected: {sorted(self._channels)})",
                        worker_ids=waiting,
                    )
                self._cond.wait(deadline.slice(_HUB_TICK))

    def send_async(
        self, weights: Any = None, worker_ids: int | list[int] | None = None,
        timeout: float | None = None,
    ) -> None:
        self._start_send(weights, worker_ids, self._deadline(timeout))

    def send(
        self, weights: Any = None, worker_ids: int | list[int] | None = None,
        timeout: float | None = None,
    ) -> int:
        deadline = self._deadline(timeout)
        self._start_send(weights, worker_ids, deadline)
        return self._finish_send(deadline)

    def _start_send(
        self, weights: Any, worker_ids: int | list[int] | None, deadline: Deadline,
    ) -> None:
        """Snapshot and publish now; delivery never blocks on a worker (a notice, or an
        offer to the worker's streamer), so ``send_async`` returns once published."""
        self._check_open()
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        if self._table.published == NO_VERSION:
            self._connect(deadline)
        requested = self._table.check_worker_ids(worker_ids)
        flat = self._weights_to_send(weights)
        version = self._table.published + 1
        assert self._layout is not None
        t0 = time.perf_counter()
        if not self._delivery_needs_ack:
            self._drop_dead(requested)
        with self._membership:
            with self._cond:
                targets = [w for w in requested if w in self._channels]
                lost = {
                    w: self._why.get(w, "not connected")
                    for w in requested
                    if w not in self._channels and (worker_ids is not None or w not in self._reported)
                }
            pending = _PendingSend(version, requested, targets, lost, self._layout.nbytes)
            self._publish(flat, targets, version, deadline)
            self._table.published = version
        pending.phases["publish"] = time.perf_counter() - t0
        self._pending = pending
        self._deliver_pending(pending, deadline)

    def _deliver_pending(self, pending: _PendingSend, deadline: Deadline) -> None:
        t0 = time.perf_counter()
        try:
            pending.lost.update(self._deliver(pending.targets, pending.version, deadline))
        except BaseException as exc:  # surfaced by wait_async
            pending.error = exc
        pending.phases["deliver"] = time.perf_counter() - t0

    def wait_async(self, timeout: float | None = None) -> int:
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        return self._finish_send(self._deadline(timeout))

    def _finish_send(self, deadline: Deadline) -> int:
        pending = self._pending
        assert pending is not None
        try:
            if self._closed:
                raise WeightSyncError(
                    f"the sender was closed while version {pending.version} was being sent"
                )
            if pending.error is not None:
                raise pending.error
            if self._delivery_needs_ack:
                t0 = time.perf_counter()
                self._wait_acks(pending, deadline)
                pending.phases["ack"] = time.perf_counter() - t0
        finally:
            self._pending = None
        self._stats.add(SendRecord(pending.version, tuple(pending.targets), pending.nbytes,
                                   pending.phases))
        elapsed = time.perf_counter() - pending.started
        log = logger.info if elapsed > SLOW_SEND_SECONDS else logger.debug
        log("version %d sent to worker(s) %s in %s%s", pending.version, pending.targets,
            human_duration(elapsed), " (slow)" if elapsed > SLOW_SEND_SECONDS else "")
        if pending.lost:
            ids = sorted(pending.lost)
            self._reported.update(ids)
            raise lost_error(ids, pending.version, pending.lost)
        return pending.version

    def _wait_acks(self, pending: _PendingSend, deadline: Deadline) -> None:
        with self._cond:
            while True:
                slow = []
                for w in pending.targets:
                    if w in pending.lost:
                        continue
                    state = self._table.workers[w]
                    if state.version >= pending.version:
                        continue  # acked (a worker that acked and then left is not lost)
                    if state.lost or w not in self._channels:
                        pending.lost[w] = self._why.get(w, "connection lost")
                    else:
                        slow.append(w)
                if not slow:
                    return
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker(s) {slow} did not confirm version {pending.version} within "
                        f"{deadline} (they are alive but not answering)",
                        worker_ids=slow,
                    )
                self._cond.wait(deadline.slice(_HUB_TICK))

    def _watch(self, idx: int, pid: Any) -> None:
        """Start (or, with no pid, stop) watching worker ``idx``'s process; under _cond."""
        old = self._watches.pop(idx, None)
        if old is not None:
            old.close()
        if isinstance(pid, int):
            self._watches[idx] = ProcessWatch(pid)

    def _drop_dead(self, worker_ids: list[int]) -> None:
        """Mark lost the workers whose socket hung up or whose process is dead or being
        killed, so a send without acks still reports them (and never targets them).
        One ``poll`` for all sockets and one ``pread`` per worker: cheap on every send."""
        with self._cond:
            candidates = [(w, self._channels[w], self._watches.get(w))
                          for w in worker_ids if w in self._channels]
        closed = hung_up([channel for _, channel, _ in candidates])
        for w, channel, watch in candidates:
            if channel in closed:
                self._mark_lost(w, channel, "connection closed; did the process die?")
            elif watch is not None and watch.dying():
                self._mark_lost(w, channel, f"process {watch.pid} is dead or being killed")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this sender is closed")
        self._check_hub()

    def _check_hub(self) -> None:
        if self._hub.error is not None:
            raise WeightSyncError(
                f"the sender's connection hub stopped ({self._hub.error!r}); workers can no "
                "longer join: close this sender and create a new one"
            )

    def _reachable(self, targets: list[int]) -> tuple[list[tuple[int, Channel]], dict[int, str]]:
        """The targets' channels, and {worker: why} for those already gone."""
        with self._cond:
            found = [(w, self._channels[w]) for w in targets if w in self._channels]
            gone = {w: self._why.get(w, "connection lost") for w in targets
                    if w not in self._channels}
        return found, gone

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._forked_copy:
            return
        self._hub.stop()
        with self._cond:
            channels = list(self._channels.values())
            self._channels.clear()
            for idx in list(self._watches):
                self._watch(idx, None)
        for channel in channels:
            with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                channel.send_nowait({"t": "close"})
            channel.close()
        self._close_transport()
