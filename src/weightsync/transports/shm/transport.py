"""``SharedMemTransport``: TorchRL's shared-memory transport API, as an adapter at the edge.

This module exists for TorchRL's transport API (``register_pipe``, ``register_weights``,
``send_weights``, ``receive_weights``, ``setup_connection_and_weights_on_sender`` /
``setup_connection_and_weights_on_receiver``, ``check_ack``), the
:class:`~weightsync.transports.base.TransportBackend` protocol. It is not on the data path
of :class:`~weightsync.schemes.shm.SharedMemWeightSyncScheme`: its ends
(``shm.endpoints``) publish through :class:`~weightsync.transports.shm.publisher.SlotPublisher`
and read through :class:`~weightsync.transports.shm.reader.SlotReader`, and this class
composes the same two, adding what TorchRL's API needs and the scheme does not: pipes
registered by the caller, weights in any form TorchRL passes (flattened and checked here),
version numbers counted per model, and a worker's pipe read by the caller's thread (no
scheme, no reader thread: the *pipe flow* below reads the sender's segment messages
whenever the worker looks for weights).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, ChannelClosed
from weightsync.transports.shm.publisher import SlotPublisher
from weightsync.transports.shm.reader import Pump, SlotReader
from weightsync.transports.shm.slots import DEFAULT_MODEL_ID

__all__ = ["DEFAULT_MODEL_ID", "SharedMemTransport"]


class SharedMemTransport:
    """Shared-memory weight transport for processes on one host, with TorchRL's API.

    Sender side: ``register_pipe`` each worker's pipe, then ``send_weights(model_id, w)``;
    the first send of a model creates its shared slots and passes them to the workers.
    Receiver side: ``register_pipe`` the other end, then
    ``setup_connection_and_weights_on_receiver`` and ``receive_weights``.

    Unlike TorchRL's in-place update, workers do not see writes as they happen: a worker
    takes a new version only when it calls ``receive_weights`` (tear-free, see docs/contract.md).

    One object serves either side, as TorchRL's does: ``publisher`` holds the sender's
    slots and the registered pipes, ``reader`` a worker's mappings; the side not in use
    holds nothing.
    """

    def __init__(
        self,
        policy_weights: dict[str, Any] | None = None,
        auto_register: bool = True,
        *,
        max_slots: int | None = None, grow_for_views: bool | None = None,
    ) -> None:
        self.auto_register = auto_register
        #: the sender's side (a receiver's pipe to its sender is registered here too, as
        #: TorchRL's ``register_pipe`` does not say which side it is on)
        self.publisher = SlotPublisher(max_slots, grow_for_views)
        #: the worker's side
        self.reader = SlotReader()
        self._pipes: list[Channel] = []
        self._lock = threading.Lock()  # a pipe's index; a send's version check and publish
        self._received: dict[str, int] = {}  # model id -> the version this worker applied
        for model_id, weights in (policy_weights or {}).items():
            self.register_weights(model_id, weights)

    # ================================================================== sender side
    def register_pipe(self, pipe: Any) -> None:
        """Add a worker's pipe (sender side) or the pipe to the sender (receiver side)."""
        channel = Channel.from_pipe(pipe)
        with self._lock:
            self._pipes.append(channel)
            self.publisher.attach_worker(len(self.publisher.workers), channel)

    def attach_worker(self, worker_idx: int, channel: Channel, *, at_latest: bool = True) -> None:
        """Give worker ``worker_idx`` every shared segment (see ``SlotPublisher``)."""
        self.publisher.attach_worker(worker_idx, channel, at_latest=at_latest)

    def detach_worker(self, worker_idx: int) -> None:
        """Forget a worker (it died or left): its slot stops counting as in use."""
        self.publisher.detach_worker(worker_idx)

    def register_weights(self, model_id: str, weights: Any) -> None:
        """Create the shared slots for ``model_id`` from ``weights`` and publish them as its
        first version; workers already registered get the segments now, later ones on
        attach."""
        flat = self._flatten(weights)
        with self._lock:
            if self.publisher.layout(model_id) is not None:
                raise ValueError(f"model {model_id!r} is already registered")
            self.publisher.publish(model_id, flat, None, 0, None)

    def send_weights(
        self, model_id: str, weights: Any, *, worker_ids: Iterable[int] | None = None,
        version: int | None = None, timeout: float | None = 10.0,
    ) -> int:
        """Publish ``weights`` as the next version of ``model_id`` to ``worker_ids`` (all
        attached workers by default) and return that version. The weights are copied now:
        later writes to them reach nobody until the next send."""
        flat = self._flatten(weights)
        with self._lock:
            layout = self.publisher.layout(model_id)
            if layout is None and not self.auto_register:
                raise KeyError(
                    f"model {model_id!r} is not registered and auto_register=False; call "
                    "register_weights first"
                )
            if layout is not None:
                layout.check_weights(flat, given_by=f"the weights sent for {model_id!r}")
            new_version = self.publisher.version(model_id) + 1 if version is None else version
            self.publisher.publish(model_id, flat, worker_ids, new_version, timeout)
            return new_version

    @staticmethod
    def _flatten(weights: Any) -> dict[str, torch.Tensor]:
        try:
            return flat_tensors(weights, what="SharedMemTransport weights")
        except TypeError as exc:
            raise ValueError(str(exc)) from exc

    def applied_version(self, worker_idx: int, model_id: str = DEFAULT_MODEL_ID) -> int:
        """Sender side: the version the worker last applied, as it wrote it into the
        control block (acks through shared memory wake no thread of the trainer)."""
        return self.publisher.applied_version(worker_idx, model_id)

    def layout(self, model_id: str = DEFAULT_MODEL_ID) -> Layout | None:
        """Sender side: the layout ``model_id`` was registered or first sent with."""
        return self.publisher.layout(model_id)

    def check_ack(self, message: str = "updated") -> None:
        """No-op: a published version is delivered (workers take it at their next call)."""

    def send_ack(self, message: str = "updated") -> None:
        """No-op."""

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing to do: segments are passed lazily on the first send."""

    # ================================================================== receiver side
    def setup_connection_and_weights_on_receiver(
        self, *, worker_idx: int, weights: Any = None, model: Any = None,
        strategy: WeightStrategy | None = None, timeout: float | None = 60.0,
        model_id: str = DEFAULT_MODEL_ID,
    ) -> Any:
        """Wait for the sender's segments and first version, apply it to ``model`` (or
        ``weights``), and return the weights as ``strategy`` extracts them."""
        self.reader.worker_idx = worker_idx
        deadline = Deadline(timeout)
        self.reader.wait_for_model(model_id, deadline, pump=self._pump)
        while self.reader.published_version(worker_idx, model_id) < 0:
            if deadline.expired():
                raise WeightSyncTimeoutError(f"worker {worker_idx}: no version within {deadline}")
            self._pump(deadline.slice(0.01))
        return self._apply_newest(worker_idx, weights if model is None else model, strategy,
                                  deadline, model_id)

    def receive_weights(
        self, timeout: float | None = 1.0, *, weights: Any = None, model: Any = None,
        strategy: WeightStrategy | None = None, model_id: str = DEFAULT_MODEL_ID,
    ) -> Any | None:
        """Apply the newest version to ``model`` (or ``weights``) if there is a newer one and
        return the applied weights; otherwise return None at once (TorchRL's receive is a
        no-op that never blocks). ``timeout`` bounds the wait for a slot still in transit."""
        worker_idx = self.reader.worker_idx
        if worker_idx is None:
            raise RuntimeError("call setup_connection_and_weights_on_receiver first")
        return self._apply_newest(worker_idx, weights if model is None else model, strategy,
                                  Deadline(timeout), model_id)

    def _apply_newest(self, worker_idx: int, target: Any, strategy: WeightStrategy | None,
                      deadline: Deadline, model_id: str) -> Any | None:
        """Apply the newest version to ``target`` if newer than the one it holds; the weights
        as ``strategy`` extracts them, or None if there was nothing newer."""
        if target is None:
            raise ValueError("receive_weights needs a model or a weights buffer to write into")
        self._pump(0.0)
        dest = flat_tensors(target, what="receive_weights destination")
        held = self._received.get(model_id, NO_VERSION)
        applied = self.reader.apply_latest(worker_idx, dest, held, deadline, model_id,
                                           pump=self._pump)
        if applied is None:
            return None
        self._received[model_id] = applied
        return (strategy or WeightStrategy()).extract_weights(target)

    def _pump(self, timeout: float) -> None:
        """The pipe flow: take every segment message waiting on the pipe to the sender (for
        up to ``timeout`` for the first), in the caller's thread."""
        if not self._pipes:
            return
        channel = self._pipes[0]
        while channel.readable(timeout):
            try:
                message = channel.recv(timeout=5.0)
            except ChannelClosed:
                self.reader.mark_sender_lost()
                return
            self.reader.handle_message(message)
            timeout = 0.0

    def wait_for_model(self, model_id: str, deadline: Deadline, pump: Pump | None = None) -> Layout:
        """Receiver side: block until the sender has announced ``model_id``."""
        return self.reader.wait_for_model(model_id, deadline, pump)

    def published_version(self, worker_idx: int, model_id: str = DEFAULT_MODEL_ID) -> int:
        """Receiver side: the newest version this worker can take now (-1: none yet)."""
        return self.reader.published_version(worker_idx, model_id)

    def sender_closed(self, model_id: str = DEFAULT_MODEL_ID) -> bool:
        """Receiver side: has the sender closed? A worker looping on ``receive_weights`` can
        stop on it."""
        return self.reader.sender_closed(model_id)

    def apply_latest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, model_id: str = DEFAULT_MODEL_ID, pump: Pump | None = None,
    ) -> int | None:
        """Receiver side: copy the newest version into ``dest`` (``SlotReader.apply_latest``)."""
        return self.reader.apply_latest(worker_idx, dest, held_version, deadline, model_id, pump)

    def adopt_latest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, model_id: str = DEFAULT_MODEL_ID,
    ) -> int | None:
        """Receiver side: zero-copy apply (``SlotReader.adopt_latest``)."""
        return self.reader.adopt_latest(worker_idx, dest, held_version, deadline, model_id)

    # ================================================================== both
    def close(self) -> None:
        """Release every segment and pipe this transport holds (sender or receiver side). In
        a process forked from the owner, only this copy's references are dropped."""
        self.reader.close()
        self.publisher.close()  # and the pipes: they are its workers' channels
        self._pipes.clear()
