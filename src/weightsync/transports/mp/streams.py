"""The MultiProcess sender's data path: a pool of snapshots and one streamer per worker.

Each worker has its own streamer thread that writes the newest snapshot offered to it
over its socket, so workers are served independently: a stopped or slow worker delays
nobody else, and no lock is held across a transfer. A version is offered as soon as its
pack begins, and a streamer writes each piece the moment it is packed, so the pack and
the transfers overlap. A snapshot is never rewritten while a streamer reads it; the pool
grows (up to a cap) instead of waiting for a slow reader.

On Linux the bytes go through a pipe per worker that maps the snapshot's pages instead of
copying them (see ``mp.pipe``): the worker's read is the only copy, where the socket makes
two, which leaves the trainer's core to the pack. The socket carries the headers, and the
bytes too where no such pipe can be made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.transports.local.channel import Channel, ChannelClosed, ChannelTimeout
from weightsync.transports.mp.pipe import MIN_PAYLOAD_BYTES, PipeWriter
from weightsync.transports.mp.snapshots import Snapshot, as_bytes, layout_header

logger = logging.getLogger(__name__)


class SnapshotPool:
    """Packed copies of versions: the newest, plus those streamers still read."""

    def __init__(self, layout: Layout, max_snapshots: int) -> None:
        self.layout = layout
        self.max_snapshots = max(2, max_snapshots)
        self._snapshots: list[Snapshot] = []
        self._readers: dict[int, int] = {}  # id(snapshot) -> streamers reading it
        self._cond = threading.Condition()
        self.latest: Snapshot | None = None

    def fill(self, flat: Mapping[str, torch.Tensor], version: int, deadline: Deadline,
             on_started: Callable[[], None] | None = None) -> Snapshot:
        """Pack ``flat`` as ``version`` into a snapshot no streamer reads. It becomes the
        newest before the pack begins, and ``on_started`` runs then (offer the version to
        the streamers there: each writes every piece as soon as it is packed); if the pack
        fails, the previous snapshot is the newest again. Grows the pool before waiting
        for a reader to finish."""
        with self._cond:
            while True:
                free = [s for s in self._snapshots
                        if s is not self.latest and not self._readers.get(id(s))]
                if free:
                    spare = free[0]
                    break
                if len(self._snapshots) < self.max_snapshots:
                    spare = Snapshot(self.layout)
                    self._snapshots.append(spare)
                    break
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"no free snapshot for version {version} within {deadline}: every "
                        "copy is still being streamed to a slow worker"
                    )
                self._cond.wait(deadline.slice(0.05))
            previous = self.latest

        def started() -> None:
            with self._cond:
                self.latest = spare
                self._cond.notify_all()
            if on_started is not None:
                on_started()

        try:
            spare.fill(flat, version, started)
        except BaseException:
            with self._cond:
                if self.latest is spare:
                    self.latest = previous
                self._cond.notify_all()
            raise
        return spare

    def acquire_latest(self) -> Snapshot | None:
        with self._cond:
            snapshot = self.latest
            if snapshot is not None:
                self._readers[id(snapshot)] = self._readers.get(id(snapshot), 0) + 1
            return snapshot

    def release(self, snapshot: Snapshot) -> None:
        with self._cond:
            left = self._readers[id(snapshot)] - 1
            if left:
                self._readers[id(snapshot)] = left
            else:  # nobody reads it: its id may name another snapshot once it is freed
                del self._readers[id(snapshot)]
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every snapshot (the sender closes). The readers' counts stay: a streamer
        still in a transfer when its ``stop`` gave up waiting for it releases its snapshot
        when the transfer ends, after this."""
        with self._cond:
            self._snapshots.clear()
            self.latest = None


class Streamer:
    """Streams the newest snapshot to one worker, in a thread of its own.

    ``offer()`` never blocks: the thread picks up the newest version when it is free, so a
    worker that falls behind skips versions instead of queueing them. A transfer that
    fails or runs past its deadline breaks the stream (a half-written frame cannot be
    resumed): ``on_failure(worker_idx, channel, why)`` is called once and the thread ends.
    """

    def __init__(
        self, worker_idx: int, channel: Channel, pool: SnapshotPool, timeout: float,
        on_failure: Callable[[int, Channel, str], None],
    ) -> None:
        self.worker_idx = worker_idx
        self.channel = channel
        self._pool = pool
        self._timeout = timeout
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._wanted_version = -1
        self._deadline: Deadline | None = None
        self._sent_version = -1
        self._sent_layout = False
        self._pipe: PipeWriter | None = None  # the worker's page-mapping pipe, if it has one
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, name=f"weightsync-stream-{worker_idx}", daemon=True
        )
        self._thread.start()

    @property
    def through_pipe(self) -> bool:
        """Whether this worker's bytes go through a page-mapping pipe (else the socket)."""
        return self._pipe is not None

    def offer(self, version: int, deadline: Deadline | None = None) -> None:
        """Ask for ``version`` (the pool's newest) to be sent by ``deadline``."""
        with self._cond:
            if version > self._wanted_version:
                self._wanted_version = version
                self._deadline = deadline or Deadline(self._timeout)
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._pipe is not None:
            self._pipe.cancelled = True  # a write waiting on a stopped worker gives up
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self._pipe is not None:
                self._pipe.close()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._wanted_version <= self._sent_version:
                    self._cond.wait(1.0)
                if self._stop:
                    return
                deadline = self._deadline or Deadline(self._timeout)
                wanted = self._wanted_version
            snapshot = self._pool.acquire_latest()
            if snapshot is None or snapshot.failed or snapshot.version <= self._sent_version:
                # the offered version's pack failed (the pool rolled back to one this worker
                # has): drop the offer, unless a newer one came meanwhile
                if snapshot is not None:
                    self._pool.release(snapshot)
                with self._cond:
                    if self._wanted_version == wanted:
                        self._wanted_version = self._sent_version
                continue
            try:
                self._stream(snapshot, deadline)
            except (ChannelClosed, ChannelTimeout, OSError) as exc:
                if not self._stop:
                    what = "timed out" if isinstance(exc, ChannelTimeout) else "failed"
                    self._on_failure(self.worker_idx, self.channel,
                                     f"transfer of version {snapshot.version} {what}: {exc}")
                return
            finally:
                self._pool.release(snapshot)

    def _stream(self, snapshot: Snapshot, deadline: Deadline) -> None:
        if not self._sent_layout:
            self._send_layout(snapshot.layout, deadline)
        # a deadline that passed while we were busy with an older version still leaves
        # this transfer a short grace, so a healthy worker is never dropped for it
        timeout = max(deadline.remaining() or 0.0, 1.0) if deadline.timeout is not None else None
        if self._pipe is not None:
            self._stream_through_pipe(self._pipe, snapshot, Deadline(timeout))
        elif snapshot.complete:
            self.channel.send(snapshot.header(), as_bytes(snapshot.buffer), timeout=timeout)
        else:  # still being packed: write each piece as soon as it is packed
            self.channel.send_stream(snapshot.header(), snapshot.layout.nbytes,
                                     snapshot.pieces(Deadline(timeout)), timeout=timeout)
        with self._cond:
            self._sent_version = max(self._sent_version, snapshot.version)

    def _send_layout(self, layout: Layout, deadline: Deadline) -> None:
        """The layout, with the read end of a page-mapping pipe where one can be made."""
        header = layout_header(layout)
        opened = PipeWriter.open() if layout.nbytes >= MIN_PAYLOAD_BYTES else None
        if opened is None:
            self.channel.send(header, timeout=deadline.slice(10.0))
        else:
            pipe, read_fd = opened
            try:
                self.channel.send(header | {"pipe": True}, fds=[read_fd],
                                  timeout=deadline.slice(10.0))
            except BaseException:
                pipe.close()
                raise
            finally:
                os.close(read_fd)
            self._pipe = pipe
        self._sent_layout = True

    def _stream_through_pipe(self, pipe: PipeWriter, snapshot: Snapshot,
                             deadline: Deadline) -> None:
        """The header on the socket, the bytes through the pipe (each piece as soon as it
        is packed), then the trailer once the worker read them all. A transfer cut off
        breaks the socket and the pipe before the snapshot can be reused, so the worker
        never stages bytes the trainer let go of."""
        nbytes = snapshot.layout.nbytes
        self.channel.send(snapshot.header() | {"pipe_nbytes": nbytes},
                          timeout=deadline.remaining())
        try:
            base = snapshot.buffer.data_ptr()
            for lo, hi in snapshot.spans(deadline):
                pipe.write(base + lo, hi - lo, deadline)
            pipe.commit(snapshot.version, deadline)
        except BaseException:
            pipe.close()
            self._pipe = None
            with contextlib.suppress(OSError):
                self.channel.socket.shutdown(socket.SHUT_RDWR)
            raise
