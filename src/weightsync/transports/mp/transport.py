"""``MPTransport``: TorchRL's multiprocessing transport API, as an adapter at the edge.

This module exists for TorchRL's transport API (``send_weights``, ``receive_weights``,
``setup_connection_and_weights_on_sender`` / ``setup_connection_and_weights_on_receiver``,
``check_ack``), the :class:`~weightsync.transports.base.TransportBackend` protocol. It is
not on the data path of :class:`~weightsync.schemes.mp.MultiProcessWeightSyncScheme`, whose
ends (``mp.endpoints``) stream snapshots to each worker through ``mp.streams``. This class
uses the same data-path classes (``mp.snapshots``: the sender packs a :class:`Snapshot`,
the receiver stages it in a :class:`StagedStream` and applies it to its model only when
asked, so a transfer cut off half-way never reaches the model) and adds what TorchRL's
API needs: a ``multiprocessing.Queue`` pair or one duplex pipe instead of the scheme's
sockets, one send in flight at a time, and acks read by the caller.
"""

from __future__ import annotations

import contextlib
import queue as queue_module
from typing import Any

from weightsync.core.deadline import Deadline, required_timeout
from weightsync.core.errors import SenderLostError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, ChannelClosed, ChannelTimeout, Message
from weightsync.transports.mp.snapshots import Snapshot, StagedStream, as_bytes, layout_header

__all__ = ["MPTransport"]


class _QueueEndpoint:
    """Seed-style endpoint: a ``multiprocessing.Queue`` for weights, another for acks."""

    def __init__(self, weight_queue: Any, ack_queue: Any) -> None:
        self.weight_queue = weight_queue
        self.ack_queue = ack_queue


class MPTransport:
    """Multiprocessing transport with TorchRL's API: raw weight bytes through a queue or pipe.

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
        self._stream = StagedStream()  # the receiver side
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
            self._put(layout_header(snapshot.layout), None)
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
        """The next message from the pipe, or from the ack queue (``ack_side``) or the
        weight queue, as a :class:`Message` with its payload already read."""
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

            staged = self._stream.handle_message(message, read_into)
            if staged is None:
                continue
            self._ack(staged)
            if target is None:
                return None
            dest = flat_tensors(target, what="receive_weights destination")
            layout = self._stream.sender_layout
            assert layout is not None
            layout.check_weights(dest, expected_by="the sender's layout", given_by="the local model")
            applied = self._stream.apply_staged(dest, self._version)
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
        """Close the pipe (a queue belongs to the caller, who made it)."""
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.close()
