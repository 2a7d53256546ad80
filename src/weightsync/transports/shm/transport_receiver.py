"""The receiver (worker) side of ``SharedMemTransport``: segment messages taken in, the newest
version copied or adopted from its slot; mixed into the transport in ``transport.py``."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import SenderLostError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, Message
from weightsync.transports.memory.futex import FutexWord
from weightsync.transports.shm import standalone
from weightsync.transports.shm.apply import adopt_newest, copy_newest
from weightsync.transports.shm.slots import (
    _ACK_APPLIED,
    _ACK_WAITING,
    _HEADER_WORDS,
    _IDX_CLOSED,
    _PACKED_BASE,
    DEFAULT_MODEL_ID,
    _unpack_target,
)
from weightsync.transports.shm.worker_slots import _ReceiverModel


class _ReceiverSide:
    """The receiver-side methods of ``SharedMemTransport`` (its state: ``__init__``, in
    ``transport.py``)."""

    _lock: threading.RLock
    _channels: dict[int, Channel]
    _worker_idx: int | None
    _receiver_models: dict[str, _ReceiverModel]
    _receiver_versions: dict[str, int]
    _sender_gone: bool
    _adopts: bool
    _slot_arrived: threading.Condition

    def ring(self, model_id: str = DEFAULT_MODEL_ID) -> FutexWord | None:
        """Receiver side: the word a worker blocked in ``receive()`` sleeps on (None: no
        model yet, or no futex here)."""
        model = self._receiver_models.get(model_id)
        return None if model is None else model.ring

    def set_waiting(self, worker_idx: int, waiting: bool, model_id: str = DEFAULT_MODEL_ID) -> None:
        """Receiver side: announce that this worker blocks until a notice comes."""
        model = self._receiver_models.get(model_id)
        if model is not None:
            model.ack[_ACK_WAITING] = 1 if waiting else 0

    def handle_message(self, message: Message) -> bool:
        """Take a segment message from the sender; False if it is not one of ours."""
        kind = message.header.get("t")
        with self._lock:
            if kind == "shm.model":
                model_id = message.header["model_id"]
                old = self._receiver_models.pop(model_id, None)
                if old is not None:
                    old.close()
                layout = Layout.from_dict(message.header["layout"])
                self._receiver_models[model_id] = _ReceiverModel(layout, message.fds[0],
                                                                 message.fds[1])
            elif kind == "shm.retire":  # a free slot the sender let go for good
                self._receiver_models[message.header["model_id"]].drop_slot(
                    int(message.header["index"]))
            elif kind == "shm.slot":
                model = self._receiver_models[message.header["model_id"]]
                model.add_slot(message)
                if self._worker_idx is not None:  # a slot opened while idle counts at once
                    model.record_opened(self._worker_idx)
            else:
                return False
            self._slot_arrived.notify_all()
            return True

    def mark_sender_lost(self) -> None:
        with self._lock:
            self._sender_gone = True
            self._slot_arrived.notify_all()

    def receiver_layout(self, model_id: str = DEFAULT_MODEL_ID) -> Layout | None:
        model = self._receiver_models.get(model_id)
        return None if model is None else model.layout

    def wait_for_model(self, model_id: str, deadline: Deadline, pump: Any = None) -> Layout:
        """Block until the sender has announced ``model_id``; ``pump`` reads the channel
        when no background thread does."""
        with self._lock:
            while model_id not in self._receiver_models:
                if self._sender_gone:
                    raise SenderLostError("the sender closed before sending any weights")
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker {self._worker_idx}: no weights for model {model_id!r} within "
                        f"{deadline}"
                    )
                self._wait_for_slot(deadline, pump)
            return self._receiver_models[model_id].layout

    def published_version(self, worker_idx: int, model_id: str = DEFAULT_MODEL_ID) -> int:
        """The newest version this worker can take now (-1: none yet): the one the sender
        points it at, which a copying worker may take while it is still being packed; a
        worker that adopts views (zero-copy) gets the one it holds until that is whole."""
        model = self._receiver_models.get(model_id)
        if model is None:
            return NO_VERSION
        packed = model.ctrl[_HEADER_WORDS + worker_idx]
        if packed < 0:
            return NO_VERSION
        version, index = _unpack_target(packed)
        if self._adopts and model.ctrl[_PACKED_BASE + index] != model.plan.total:
            return int(model.ack[_ACK_APPLIED])
        return version

    def sender_closed(self, model_id: str = DEFAULT_MODEL_ID) -> bool:
        """Receiver side: has the sender closed (its pipe, or the model's control block says
        so)? A worker looping on ``receive_weights`` can stop on it."""
        model = self._receiver_models.get(model_id)
        return self._sender_gone or (model is not None and model.ctrl[_IDX_CLOSED] == 1)

    def apply_latest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, model_id: str = DEFAULT_MODEL_ID, pump: Any = None,
    ) -> int | None:
        """Copy the newest version published for ``worker_idx`` into ``dest`` if it is newer
        than ``held_version``; returns it, or None if there is nothing newer (or its slot's
        handle has not arrived by ``deadline``). A version still being packed is copied as
        the sender packs it (see ``shm.apply``): the call lasts about one copy either way."""
        model = self._receiver_models[model_id]
        self._worker_idx = worker_idx
        model.record_opened(worker_idx)
        return copy_newest(model, worker_idx, dest, held_version,
                           deadline, lambda d: self._wait_for_slot(d, pump))

    def adopt_latest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, model_id: str = DEFAULT_MODEL_ID,
    ) -> int | None:
        """Zero-copy apply: point every tensor of ``dest`` (``.data``) at read-only views
        into the newest slot published for ``worker_idx``, if newer than ``held_version`` and
        completely packed by ``deadline`` (see ``shm.apply.adopt_newest``)."""
        self._adopts = True  # from now on, a version still being packed is not "published"
        model = self._receiver_models[model_id]
        self._worker_idx = worker_idx
        model.record_opened(worker_idx)
        return adopt_newest(model, worker_idx, dest, held_version,
                            deadline, lambda d: self._wait_for_slot(d, None))

    def _wait_for_slot(self, deadline: Deadline, pump: Any) -> None:
        """Wait a little for a segment message still on its way (read by ``pump`` when no
        background thread reads the channel). The lock is reentrant: callers may hold it."""
        with self._lock:
            if pump is not None:
                self._lock.release()
                try:
                    pump(deadline.slice(0.05))
                finally:
                    self._lock.acquire()
            else:
                self._slot_arrived.wait(deadline.slice(0.05))

    def setup_connection_and_weights_on_receiver(
        self, *, worker_idx: int, weights: Any = None, model: Any = None,
        strategy: WeightStrategy | None = None, timeout: float | None = 60.0,
        model_id: str = DEFAULT_MODEL_ID,
    ) -> Any:
        """Wait for the sender's segments and first version, apply it to ``model`` (or
        ``weights``), and return the weights as ``strategy`` extracts them."""
        self._worker_idx = worker_idx
        return standalone.first_weights(self, worker_idx, weights if model is None else model,
                                        strategy, Deadline(timeout), model_id)

    def receive_weights(
        self, timeout: float | None = 1.0, *, weights: Any = None, model: Any = None,
        strategy: WeightStrategy | None = None, model_id: str = DEFAULT_MODEL_ID,
    ) -> Any | None:
        """Apply the newest version to ``model`` (or ``weights``) if there is a newer one and
        return the applied weights; otherwise return None at once (TorchRL's receive is a
        no-op that never blocks). ``timeout`` bounds the wait for a slot still in transit."""
        if self._worker_idx is None:
            raise RuntimeError("call setup_connection_and_weights_on_receiver first")
        return standalone.newest_weights(self, self._worker_idx, weights if model is None else model,
                                         strategy, Deadline(timeout), model_id)

    def _pump(self, timeout: float) -> None:
        """Read pending segment messages from the sender (standalone receiver use)."""
        standalone.pump(self, self._channels.get(0), timeout)

    def forget_opened(self) -> None:
        """Receiver side, at a clean close and before saying goodbye: this worker releases
        its CUDA slots itself, so the sender must not take their counts back for it."""
        for rmodel in self._receiver_models.values():
            rmodel.forget_opened()
