"""MPTransport, with TorchRL's API: weights as raw bytes through a pipe or queue; acks carry versions.

The sender packs the weights into a snapshot buffer (one copy, so later optimizer steps
cannot leak into a send in flight) and streams each piece as soon as it is packed; the
receiver reads straight into one of two staging buffers and applies it to its model only
when asked, so a transfer cut off half-way never reaches the model.
"""

from __future__ import annotations

import contextlib
import queue as queue_module
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline, required_timeout
from weightsync.core.errors import IntegrityError, SenderLostError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.staging import StagingBuffers
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, ChannelClosed, ChannelTimeout, Message
from weightsync.transports.memory.pieces import PiecePlan


def as_bytes(buffer: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU uint8 tensor."""
    return memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


class PackAbandoned(OSError):
    """The pack of a snapshot failed after its first bytes were streamed: the frame cannot
    be completed, so the stream that carried it breaks (the receiver stages nothing)."""


class Snapshot:
    """A sender-side packed copy of one version, streamable while it is being packed.

    ``fill`` packs piece by piece and raises a watermark as it goes; ``pieces`` yields the
    payload a piece at a time as the watermark passes it, so a streamer writes each piece
    to its socket while the next one is packed (the pack and the transfer overlap)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout.on_device("cpu")
        self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        self.version = NO_VERSION
        self.lock = threading.Lock()
        self._plan = PiecePlan(self.layout)
        self._views = self._plan.buffer_views({"cpu": self.buffer})
        self._progress = threading.Condition()
        self.packed = 0  # bytes of ``version`` packed so far
        self.failed = False

    def fill(self, flat: Mapping[str, torch.Tensor], version: int,
             on_started: Callable[[], None] | None = None) -> None:
        """Pack ``flat`` as ``version``; ``on_started`` runs once the snapshot names the new
        version (its readers follow the pack from there)."""
        with self.lock:
            with self._progress:
                self.version, self.packed, self.failed = version, 0, False
            try:
                if on_started is not None:
                    on_started()
                self._plan.pack(flat, {"cpu": self.buffer}, self._advance, self._views)
            except BaseException:
                with self._progress:
                    self.failed = True
                    self._progress.notify_all()
                raise

    def _advance(self, watermark: int) -> None:
        with self._progress:
            self.packed = watermark
            self._progress.notify_all()

    @property
    def complete(self) -> bool:
        return self.packed == self.layout.nbytes and not self.failed

    def spans(self, deadline: Deadline) -> Iterator[tuple[int, int]]:
        """Byte ranges ``[lo, hi)`` of the payload, each as soon as it is packed (every
        byte in a yielded range is final)."""
        sent, total = 0, self.layout.nbytes
        while sent < total:
            with self._progress:
                while self.packed <= sent and not self.failed:
                    if deadline.expired():
                        raise ChannelTimeout(f"version {self.version} was not packed within {deadline}")
                    self._progress.wait(deadline.slice(0.5))
                if self.failed:
                    raise PackAbandoned(f"the pack of version {self.version} failed mid-way")
                mark = self.packed
            yield sent, mark
            sent = mark

    def pieces(self, deadline: Deadline) -> Iterator[memoryview]:
        """The payload, each piece as soon as it is packed (every yielded byte is final)."""
        data = as_bytes(self.buffer)
        for lo, hi in self.spans(deadline):
            yield data[lo:hi]

    def header(self) -> dict[str, Any]:
        return {"t": "mp.weights", "v": self.version, "fingerprint": self.layout.fingerprint}


class Staging(StagingBuffers):
    """Receiver side: the staging buffers, filled from the wire after checking the header."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout.on_device("cpu"))

    def receive(self, message: Message, read_into: Any) -> int:
        """Read the payload of ``message`` into a free buffer via ``read_into(view)``."""
        header = message.header
        if header.get("fingerprint") != self.layout.fingerprint:
            raise IntegrityError(
                f"weights for layout {header.get('fingerprint')} arrived, expected "
                f"{self.layout.fingerprint}"
            )
        # bytes that come through a pipe beside the socket are announced in the header
        announced = header.get("pipe_nbytes", message.payload_nbytes)
        if announced != self.layout.nbytes:
            raise IntegrityError(
                f"version {header.get('v')}: {announced} bytes announced, the layout "
                f"needs {self.layout.nbytes}"
            )
        return self.fill(int(header["v"]), lambda buffers: read_into(as_bytes(buffers["cpu"])))


class _QueueEndpoint:
    """Seed-style endpoint: a ``multiprocessing.Queue`` for weights, another for acks."""

    def __init__(self, weight_queue: Any, ack_queue: Any) -> None:
        self.weight_queue = weight_queue
        self.ack_queue = ack_queue


class MPTransport:
    """Multiprocessing transport: raw weight bytes through a queue or pipe.

    ``weight_queue`` may be a ``multiprocessing.Queue`` (TorchRL's form; then ``ack_queue``
    carries acknowledgements back) or one duplex pipe/``Channel`` used both ways. The
    weights cross as a JSON header and raw tensor bytes, never as pickled tensors.
    """

    def __init__(self, weight_queue: Any, ack_queue: Any = None, timeout: float = 10.0) -> None:
        self.timeout = required_timeout(timeout, "timeout")
        self._channel: Channel | None = None
        self._queues: _QueueEndpoint | None = None
        if hasattr(weight_queue, "put") and hasattr(weight_queue, "get"):
            self._queues = _QueueEndpoint(weight_queue, ack_queue)
        else:
            self._channel = Channel.from_pipe(weight_queue)
        self._snapshot: Snapshot | None = None
        self._staging: Staging | None = None
        self._layout_sent = False
        self._pending_version: int | None = None
        self._version = NO_VERSION
        self.worker_idx: int | None = None

    # ------------------------------------------------------------------ sender side
    def send_weights(self, weights: Any) -> None:
        """Send ``weights`` and wait until the receiver acknowledged them."""
        self.send_weights_async(weights)
        self.wait_ack()

    def send_weights_async(self, weights: Any, model_id: str = "policy") -> None:
        """Snapshot and send ``weights`` without waiting; finish with :meth:`wait_ack`."""
        if self._pending_version is not None:
            raise RuntimeError("a send is pending: call wait_ack() first")
        flat = flat_tensors(weights, what="MPTransport.send_weights")
        if self._snapshot is None:
            self._snapshot = Snapshot(Layout.from_weights(flat))
        else:
            self._snapshot.layout.check_weights(flat)
        self._snapshot.fill(flat, self._snapshot.version + 1)
        self._send_snapshot(self._snapshot)
        self._pending_version = self._snapshot.version

    def _send_snapshot(self, snapshot: Snapshot) -> None:
        if not self._layout_sent:
            self._put({"t": "mp.layout", "layout": snapshot.layout.to_dict()}, None)
            self._layout_sent = True
        self._put(snapshot.header(), as_bytes(snapshot.buffer))

    def _put(self, header: dict[str, Any], payload: memoryview | None) -> None:
        if self._channel is not None:
            self._channel.send(header, payload, timeout=self.timeout)
        else:
            assert self._queues is not None
            self._queues.weight_queue.put((header, None if payload is None else bytes(payload)))

    def wait_ack(self) -> None:
        """Block until the receiver acknowledged the pending send."""
        if self._pending_version is None:
            raise RuntimeError("no send is pending: call send_weights_async() first")
        deadline = Deadline(self.timeout)
        while True:
            header = self._get(deadline).header
            if header.get("t") == "ack" and int(header["v"]) >= self._pending_version:
                self._pending_version = None
                return

    def check_ack(self, message: str = "updated") -> None:
        """Alias of :meth:`wait_ack` when a send is pending; otherwise nothing to check."""
        if self._pending_version is not None:
            self.wait_ack()

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing to do: the first send carries the layout."""

    # ------------------------------------------------------------------ receiver side
    def _get(self, deadline: Deadline, ack_side: bool = True) -> Message:
        if self._channel is not None:
            message = self._channel.recv_header(deadline.remaining())
            return message
        assert self._queues is not None
        source = self._queues.ack_queue if ack_side else self._queues.weight_queue
        if source is None:
            raise RuntimeError("MPTransport built without an ack_queue cannot wait for acks")
        try:
            item = source.get(timeout=deadline.remaining())
        except queue_module.Empty as exc:
            raise WeightSyncTimeoutError(f"nothing arrived within {deadline}") from exc
        if isinstance(item, dict):
            return Message(item)
        header, payload = item
        message = Message(header, payload_nbytes=len(payload or b""))
        message.payload = bytearray(payload) if payload is not None else None
        return message

    def handle_message(self, message: Message, read_into: Any) -> int | None:
        """Take one message from the sender; returns the version staged, if it carried one."""
        kind = message.header.get("t")
        if kind == "mp.layout":
            self._staging = Staging(Layout.from_dict(message.header["layout"]))
            return None
        if kind == "mp.weights":
            if self._staging is None:
                raise IntegrityError("weights arrived before their layout")
            return self._staging.receive(message, read_into)
        return None

    @property
    def sender_layout(self) -> Layout | None:
        return None if self._staging is None else self._staging.layout

    def apply_staged(self, dest: Mapping[str, torch.Tensor], held_version: int) -> int | None:
        return None if self._staging is None else self._staging.apply(dest, held_version)

    def _ack(self, version: int) -> None:
        if self._channel is not None:
            self._channel.send({"t": "ack", "v": version}, timeout=self.timeout)
        elif self._queues is not None and self._queues.ack_queue is not None:
            self._queues.ack_queue.put({"t": "ack", "v": version})

    def receive_weights(
        self,
        timeout: float | None = None,
        *,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any | None:
        """Wait for the next weights (``timeout`` None: the transport's), apply them to
        ``model`` (or ``weights``), ack, and return them; None if none came in time."""
        target = model if model is not None else weights
        deadline = Deadline(self.timeout if timeout is None else timeout)
        while True:
            try:
                message = self._get(deadline, ack_side=False)
            except (WeightSyncTimeoutError, ChannelTimeout):
                return None
            except ChannelClosed as exc:
                raise SenderLostError(f"the sender is gone: {exc}") from exc
            payload = message.payload

            def read_into(view: memoryview, payload: Any = payload, message: Message = message) -> None:
                if payload is not None:
                    view[:] = payload
                else:
                    assert self._channel is not None
                    self._channel.recv_payload_into(view, deadline.remaining())

            staged = self.handle_message(message, read_into)
            if staged is None:
                continue
            self._ack(staged)
            if target is None:
                return None
            dest = flat_tensors(target, what="receive_weights destination")
            assert self._staging is not None
            self._staging.layout.check_weights(dest, expected_by="the sender's layout",
                                               given_by="the local model")
            applied = self.apply_staged(dest, self._version)
            if applied is not None:
                self._version = applied
            return (strategy or WeightStrategy()).extract_weights(target)

    def setup_connection_and_weights_on_receiver(
        self,
        *,
        worker_idx: int,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any:
        """Block for the initial weights from the sender and apply them."""
        self.worker_idx = worker_idx
        return self.receive_weights(self.timeout, weights=weights, model=model, strategy=strategy)

    def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.close()
