"""MultiProcessWeightSyncScheme: versions stream as raw bytes to each worker process."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.schemes.local import LocalScheme
from weightsync.schemes.local_receiver import LocalReceiver
from weightsync.schemes.local_sender import LocalSender
from weightsync.transports.local_channel import Channel, Message
from weightsync.transports.multiprocess import MPTransport
from weightsync.transports.multiprocess_streams import SnapshotPool, Streamer


class MultiProcessWeightSyncScheme(LocalScheme):
    """Sync by streaming each version's bytes to every worker (no shared memory needed)."""

    def create_sender(self) -> MultiProcessWeightSender:
        return MultiProcessWeightSender(self)

    def create_receiver(self, worker_idx: int = 0) -> MultiProcessWeightReceiver:
        return MultiProcessWeightReceiver(self, worker_idx)


def _weak_callback(method: Callable[[int, Channel, str], None]) -> Callable[[int, Channel, str], None]:
    """``method`` called through a weak reference, so a streamer thread never keeps its
    sender alive (a dropped sender must be collected, and its ``__del__`` closes it)."""
    ref = weakref.WeakMethod(method)

    def call(worker_idx: int, channel: Channel, why: str) -> None:
        bound = ref()
        if bound is not None:
            bound(worker_idx, channel, why)

    return call


class MultiProcessWeightSender(LocalSender):
    """Packs each version once into a snapshot; one streamer thread per worker writes it
    to that worker, so workers are served independently and a send ends at its deadline
    with only the workers that did not answer blamed (acks carry the version)."""

    def __init__(self, scheme: MultiProcessWeightSyncScheme) -> None:
        super().__init__(scheme)
        self._pool: SnapshotPool | None = None
        self._streamers: dict[int, Streamer] = {}
        self._streamers_lock = threading.Lock()

    def _publish(
        self, flat: Mapping[str, torch.Tensor], targets: list[int], version: int,
        deadline: Deadline,
    ) -> None:
        assert self._layout is not None
        if self._pool is None:
            self._pool = SnapshotPool(self._layout, self.scheme.num_workers + 2)
        self._pool.fill(flat, version, deadline)

    def _deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        reachable, lost = self._reachable(targets)
        for w, channel in reachable:
            self._streamer(w, channel).offer(version, deadline)
        return lost

    def _streamer(self, worker_idx: int, channel: Channel) -> Streamer:
        with self._streamers_lock:
            streamer = self._streamers.get(worker_idx)
            if streamer is None or streamer.channel is not channel:
                if streamer is not None:
                    streamer.stop()
                assert self._pool is not None
                streamer = Streamer(worker_idx, channel, self._pool, self.scheme.timeout,
                                    _weak_callback(self._stream_failed))
                self._streamers[worker_idx] = streamer
            return streamer

    def _stream_failed(self, worker_idx: int, channel: Channel, why: str) -> None:
        self._mark_lost(worker_idx, channel, why)

    def _on_join(self, worker_idx: int, channel: Channel) -> None:
        """A (re)joining worker gets the newest version from its own streamer: the hub
        never blocks on a transfer."""
        if self._pool is not None and self._pool.latest is not None:
            self._streamer(worker_idx, channel).offer(self._pool.latest.version)

    def _on_lost(self, worker_idx: int) -> None:
        with self._streamers_lock:
            streamer = self._streamers.pop(worker_idx, None)
        if streamer is not None:
            streamer.stop()

    def _close_transport(self) -> None:
        with self._streamers_lock:
            streamers = list(self._streamers.values())
            self._streamers.clear()
        for streamer in streamers:
            streamer.stop()
        if self._pool is not None:
            self._pool.clear()


class MultiProcessWeightReceiver(LocalReceiver):
    def __init__(self, scheme: MultiProcessWeightSyncScheme, worker_idx: int) -> None:
        super().__init__(scheme, worker_idx)
        self.transport: MPTransport | None = None
        self._layout_arrived = threading.Event()

    def _handle(self, message: Message, channel: Channel) -> bool:
        if self.transport is None:
            self.transport = MPTransport(channel, timeout=self.scheme.timeout)
        kind = message.header.get("t")
        if kind not in ("mp.layout", "mp.weights"):
            return False
        staged = self.transport.handle_message(
            message, lambda view: channel.recv_payload_into(view, self.scheme.timeout)
        )
        if kind == "mp.layout":
            self._layout_arrived.set()
        if staged is not None:
            self._mark_delivered(staged, channel)
        return True

    def _sender_layout(self, deadline: Deadline) -> Layout:
        while not self._layout_arrived.wait(deadline.slice(0.1)):
            self._wait_for_delivery(Deadline(0), "connect")
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: the sender sent no weights within "
                    f"{deadline}"
                )
        assert self.transport is not None and self.transport.sender_layout is not None
        return self.transport.sender_layout

    def _apply_newest(self, dest: dict[str, torch.Tensor], deadline: Deadline) -> int | None:
        if self.transport is None:
            return None
        return self.transport.apply_staged(dest, self._version)
