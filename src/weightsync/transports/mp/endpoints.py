"""The MultiProcess transport's two ends as the send lifecycle drives them.

:class:`StreamWriter`: each version is packed once into a snapshot from a pool; one streamer
thread per worker writes the newest snapshot to that worker's socket, so workers are served
independently and a send waits only for the acks (which carry the version).
:class:`StreamReader`: the worker's reader thread stages the bytes (from the trainer's pipe,
or from the socket) and acks them;
``poll()`` copies the staged version into the model. A worker the live trainer dropped (it
stopped answering past a send's deadline) is told so once (:class:`WorkerDroppedError`),
then joins again at its next call and takes the current version, as a restarted one would.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import SchemaMismatchError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, ChannelClosed, Message
from weightsync.transports.local.link import LocalLink
from weightsync.transports.local.members import Members
from weightsync.transports.mp.pipe import PipeReader
from weightsync.transports.mp.snapshots import LAYOUT, WEIGHTS, StagedStream
from weightsync.transports.mp.streams import SnapshotPool, Streamer

#: a rejoin gets at least this long (seconds), even from poll() or a short receive(): it is
#: one local handshake, and giving up half-way would only start it over
REJOIN_SECONDS = 5.0


def _weak_callback(method: Callable[[int, Channel, str], None]) -> Callable[[int, Channel, str], None]:
    """``method`` called through a weak reference, so a streamer thread never keeps its
    writer (and so its sender) alive: a dropped sender must be collected and closed."""
    ref = weakref.WeakMethod(method)

    def call(worker_idx: int, channel: Channel, why: str) -> None:
        bound = ref()
        if bound is not None:
            bound(worker_idx, channel, why)

    return call


class StreamWriter:
    """The trainer's end: a snapshot pool and one streamer per worker."""

    needs_acks = True

    def __init__(self, address: str, token: str, uid: int, num_workers: int,
                 timeout: float) -> None:
        self.timeout = timeout
        self.num_workers = num_workers
        self._pool: SnapshotPool | None = None
        self._streamers: dict[int, Streamer] = {}
        self._streamers_lock = threading.Lock()
        self.members = Members(address, token, uid, num_workers,
                               on_join=self._joined, on_lost=self._lost)

    def start(self, deadline: Deadline) -> None:
        self.members.start()

    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        self.members.check_hub()
        if self._pool is None:
            self._pool = SnapshotPool(layout, self.num_workers + 2)
        with self.members.joining:
            reachable, lost = self.members.reachable(requested)

            def offer() -> None:  # as the pack begins: each streamer follows it piece by piece
                for w, channel in reachable:
                    self._streamer(w, channel).offer(version, deadline)

            self._pool.fill(flat, version, deadline, on_started=offer)
        return lost

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        """The streamers were offered the version as its pack began; here only the
        targets that left meanwhile are reported (offering twice does nothing)."""
        reachable, lost = self.members.reachable(targets)
        for w, channel in reachable:
            self._streamer(w, channel).offer(version, deadline)
        return lost

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Until the targets acked ``version``, within the send's one deadline (a target still
        mid-transfer then is named in the timeout; its streamer drops it when that transfer
        runs out, at the same deadline, and its worker is told it was dropped)."""
        self.members.wait_acked(targets, version, deadline, lost)

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.members.wait_joined(version, deadline)

    def held_versions(self) -> dict[int, int]:
        return self.members.held_versions()

    def transfer_paths(self) -> dict[int, str]:
        """How each worker served so far gets its bytes: ``"pipe"`` (pages mapped into a
        pipe, one copy) or ``"socket"`` (two copies; where no such pipe can be made)."""
        with self._streamers_lock:
            return {w: "pipe" if s.through_pipe else "socket" for w, s in self._streamers.items()}

    def _streamer(self, worker_idx: int, channel: Channel) -> Streamer:
        with self._streamers_lock:
            streamer = self._streamers.get(worker_idx)
            if streamer is None or streamer.channel is not channel:
                if streamer is not None:
                    streamer.stop()
                assert self._pool is not None
                streamer = Streamer(worker_idx, channel, self._pool, self.timeout,
                                    _weak_callback(self._stream_failed))
                self._streamers[worker_idx] = streamer
            return streamer

    def _stream_failed(self, worker_idx: int, channel: Channel, why: str) -> None:
        self.members.mark_lost(worker_idx, channel, why)

    def _joined(self, worker_idx: int, channel: Channel) -> None:
        """A (re)joining worker gets the newest version from its own streamer: the hub
        never blocks on a transfer."""
        if self._pool is not None and self._pool.latest is not None:
            self._streamer(worker_idx, channel).offer(self._pool.latest.version)

    def _lost(self, worker_idx: int) -> None:
        with self._streamers_lock:
            streamer = self._streamers.pop(worker_idx, None)
        if streamer is not None:
            streamer.stop()

    def close(self) -> None:
        self.members.close()
        with self._streamers_lock:
            streamers = list(self._streamers.values())
            self._streamers.clear()
        for streamer in streamers:
            streamer.stop()
        if self._pool is not None:
            self._pool.clear()


class StreamReader:
    """A worker's end: bytes staged by the reader thread, applied at the worker's call."""

    views_model = False

    def __init__(self, link: LocalLink) -> None:
        self.link = link
        self.worker_idx = link.worker_idx
        self.expecting = "weights from the sender"
        self.stream: StagedStream | None = None  # the current connection's staged stream
        self._layout_arrived = threading.Event()
        self._acking = False  # acks start once connect() has checked and applied
        self._pipe: PipeReader | None = None  # where the trainer maps the bytes, if it can
        link.rejoinable = True

    def _on_message(self, message: Message, channel: Channel) -> bool:
        if self.stream is None:
            self.stream = StagedStream()
        kind = message.header.get("t")
        if kind not in (LAYOUT, WEIGHTS):
            for fd in message.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            return False
        if kind == LAYOUT:
            self._take_pipe(message)
        staged = self.stream.handle_message(message, self._reader_for(message, channel))
        if kind == LAYOUT:
            self._layout_arrived.set()
        if staged is not None:
            # recorded before the ack: once the sender hears of it, poll() must find it
            self.link.mark_delivered(staged)
            if self._acking:
                self.link.ack(staged, timeout=self.link.timeout)
        return True

    def _take_pipe(self, message: Message) -> None:
        """The layout may come with the read end of the trainer's pipe for the bytes."""
        fds = list(message.fds)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        if message.header.get("pipe") and fds:
            self._pipe = PipeReader(fds.pop(0), self.link.sender_alive)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _reader_for(self, message: Message, channel: Channel) -> Callable[[memoryview], None]:
        """How the payload of ``message`` lands in a staging buffer: from the pipe and then
        its trailer (without which nothing is staged), or from the socket."""
        timeout = self.link.timeout
        pipe = self._pipe
        if "pipe_nbytes" not in message.header:
            return lambda view: channel.recv_payload_into(view, timeout)
        if pipe is None:
            raise ChannelClosed("weights announced through a pipe the trainer never passed")
        version = int(message.header["v"])

        def read_pipe(view: memoryview) -> None:
            deadline = Deadline(timeout)
            pipe.read_into(view, deadline)
            pipe.read_commit(version, deadline)

        return read_pipe

    def _reset_stream(self) -> None:
        """Forget the dropped connection's transfer state (its pipe, staged bytes)."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        self.stream = None
        self._layout_arrived.clear()

    def _rejoin(self, deadline: Deadline | None = None, *, reported_only: bool = True) -> None:
        """Join the trainer again if it dropped this worker (and the drop was raised)."""
        if not self.link.needs_rejoin(reported_only):
            return
        # at least REJOIN_SECONDS, and cancelled with the caller's deadline (a close())
        rejoin = Deadline(REJOIN_SECONDS) if deadline is None or deadline.remaining() is None \
            else deadline.at_least(REJOIN_SECONDS)
        self.link.rejoin(rejoin, self._on_message, self._reset_stream)

    def open(self, local: Layout | None, deadline: Deadline) -> None:
        rejoined = self.link.needs_rejoin(reported_only=False)
        if rejoined:  # connect() again after a drop
            self._rejoin(deadline, reported_only=False)
        else:
            self.link.open(deadline, self._on_message)
        while not self._layout_arrived.wait(deadline.slice(0.1)):
            self.link.check_sender(NO_VERSION)
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: the sender sent no weights within {deadline}")
        assert self.stream is not None and self.stream.sender_layout is not None
        if local is not None:
            try:
                self.stream.sender_layout.check_compatible(
                    local, other_name=f"worker {self.worker_idx}")
            except SchemaMismatchError as exc:
                self.link.report_mismatch(exc)
                raise
        # the worker holds a version already: connect() must not return before the
        # trainer's current one (the first a rejoined worker is sent) is staged
        while rejoined and not self.link.delivered > NO_VERSION:
            self.link.check_sender(NO_VERSION)
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: joined the trainer again, but its current "
                    f"version did not arrive within {deadline}")
            self.link.wait(NO_VERSION, deadline, lambda: self.link.delivered > NO_VERSION)

    def newer_available(self, version: int) -> bool:
        self.link.check_connected()
        self._rejoin()
        return self.link.delivered > version

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        self.link.check_connected()
        self._rejoin(deadline)
        if self.stream is None:
            return None
        return self.stream.apply_staged(dest, version)

    def wait(self, version: int, deadline: Deadline) -> None:
        self.link.wait(version, deadline, lambda: self.link.delivered > version)

    def check_sender(self, version: int) -> None:
        self.link.check_sender(version)

    def ack(self, version: int) -> None:
        """Versions are acked as their bytes arrive; connect() acks the one it applied."""
        self._acking = True  # and a version that arrived meanwhile is acked here
        self.link.ack(max(version, self.link.delivered), timeout=10.0)

    def close(self, dest: dict[str, torch.Tensor] | None) -> None:
        pipe = self._pipe
        if pipe is not None:
            pipe.cancelled = True  # a read in the reader thread gives up within a tick
        self.link.close()  # joins the reader thread: a layout read before it swapped pipes
        for held in (pipe, self._pipe):
            if held is not None:
                held.close()
        self._pipe = None
