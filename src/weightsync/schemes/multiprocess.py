"""MultiProcessWeightSyncScheme: versions stream as raw bytes to each worker process."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.schemes.local import LocalReceiver, LocalScheme, LocalSender
from weightsync.transports.local_channel import Channel, ChannelClosed, ChannelTimeout, Message
from weightsync.transports.multiprocess import MPTransport, Snapshot, as_bytes


class MultiProcessWeightSyncScheme(LocalScheme):
    """Sync by streaming each version's bytes to every worker (no shared memory needed)."""

    def create_sender(self) -> MultiProcessWeightSender:
        return MultiProcessWeightSender(self)

    def create_receiver(self, worker_idx: int = 0) -> MultiProcessWeightReceiver:
        return MultiProcessWeightReceiver(self, worker_idx)


class MultiProcessWeightSender(LocalSender):
    _deliver_in_background = True

    def __init__(self, scheme: MultiProcessWeightSyncScheme) -> None:
        self._snapshots: list[Snapshot] = []
        self._latest: Snapshot | None = None
        self._snapshot_guard = threading.Lock()
        super().__init__(scheme)

    def _publish(
        self, flat: Mapping[str, torch.Tensor], targets: list[int], version: int,
        deadline: Deadline,
    ) -> None:
        assert self._layout is not None
        with self._snapshot_guard:
            if not self._snapshots:
                self._snapshots = [Snapshot(self._layout), Snapshot(self._layout)]
            spare = next(s for s in self._snapshots if s is not self._latest)
        spare.fill(flat, version)
        with self._snapshot_guard:
            self._latest = spare

    def _send_to(self, channel: Channel, snapshot: Snapshot, deadline: Deadline,
                 with_layout: bool) -> None:
        with snapshot.lock:
            if with_layout:
                channel.send({"t": "mp.layout", "layout": snapshot.layout.to_dict()},
                             timeout=deadline.slice(10.0))
            channel.send(snapshot.header(), as_bytes(snapshot.buffer), timeout=deadline.remaining())

    def _deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        snapshot = self._latest
        assert snapshot is not None and snapshot.version == version
        reachable, lost = self._reachable(targets)
        for w, channel in reachable:
            try:
                self._send_to(channel, snapshot, deadline, with_layout=version == 0)
            except ChannelClosed as exc:
                lost[w] = f"connection lost mid-transfer: {exc}"
            except ChannelTimeout as exc:
                # a half-written frame cannot be resumed: drop the worker, it may reconnect
                self._mark_lost(w, channel, f"transfer timed out: {exc}")
                raise WeightSyncTimeoutError(
                    f"worker {w} did not take version {version} within {deadline.timeout}s",
                    worker_ids=[w],
                ) from exc
        return lost

    def _on_join(self, worker_idx: int, channel: Channel) -> None:
        with self._snapshot_guard:
            snapshot = self._latest
        if snapshot is not None:
            self._send_to(channel, snapshot, Deadline(self.scheme.timeout), with_layout=True)

    def _close_transport(self) -> None:
        self._snapshots.clear()
        self._latest = None


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
                    f"{deadline.timeout}s"
                )
        assert self.transport is not None and self.transport.sender_layout is not None
        return self.transport.sender_layout

    def _apply_newest(self, dest: dict[str, torch.Tensor], deadline: Deadline) -> int | None:
        if self.transport is None:
            return None
        return self.transport.apply_staged(dest, self._version)
