"""The SharedMem worker's data path: the sender's segments mapped, the newest version copied
or adopted from its slot.

The sender's segment messages (``shm.model``, ``shm.slot``, ``shm.retire``) are taken in
as they arrive; a worker applies a version at its own call by copying its slot into its
model, following the pack if it is still running, or by viewing a completely packed slot
(zero-copy), under a shared ``fcntl`` lock on that slot, which the sender's exclusive lock
respects and which the kernel drops if the worker dies (``shm.apply``).

:class:`SlotReader` is what :class:`~weightsync.transports.shm.endpoints.SharedMemReader`
(and the Ray scheme's node-local path) read through; TorchRL's ``SharedMemTransport``
(``shm.transport``) is an adapter over it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import SenderLostError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Message
from weightsync.transports.memory.futex import FutexWord
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

__all__ = ["Pump", "SlotReader"]

#: reads pending segment messages for up to the given seconds, where no background thread
#: reads the channel (TorchRL's pipe flow)
Pump = Callable[[float], None]


class SlotReader:
    """A worker's mappings of the sender's segments (one set per model id)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        #: the worker this reader applies for, once known: a slot that arrives while the
        #: worker is idle is counted as opened by it at once (CUDA slots)
        self.worker_idx: int | None = None
        self._models: dict[str, _ReceiverModel] = {}
        self._sender_gone = False
        self._adopts = False  # this worker adopts views (zero-copy): see published_version
        self._slot_arrived = threading.Condition(self._lock)
        self._owner_pid = os.getpid()

    def ring(self, model_id: str = DEFAULT_MODEL_ID) -> FutexWord | None:
        """The word a worker blocked in ``receive()`` sleeps on (None: no model yet, or no
        futex here)."""
        model = self._models.get(model_id)
        return None if model is None else model.ring

    def set_waiting(self, worker_idx: int, waiting: bool, model_id: str = DEFAULT_MODEL_ID) -> None:
        """Announce that this worker blocks until a notice comes."""
        model = self._models.get(model_id)
        if model is not None:
            model.ack[_ACK_WAITING] = 1 if waiting else 0

    def handle_message(self, message: Message) -> bool:
        """Take a segment message from the sender; False if it is not one of ours."""
        kind = message.header.get("t")
        with self._lock:
            if kind == "shm.model":
                model_id = message.header["model_id"]
                old = self._models.pop(model_id, None)
                if old is not None:
                    old.close()
                layout = Layout.from_dict(message.header["layout"])
                self._models[model_id] = _ReceiverModel(layout, message.fds[0], message.fds[1])
            elif kind == "shm.retire":  # a free slot the sender let go for good
                self._models[message.header["model_id"]].drop_slot(int(message.header["index"]))
            elif kind == "shm.slot":
                model = self._models[message.header["model_id"]]
                model.add_slot(message)
                if self.worker_idx is not None:  # a slot opened while idle counts at once
                    model.record_opened(self.worker_idx)
            else:
                return False
            self._slot_arrived.notify_all()
            return True

    def mark_sender_lost(self) -> None:
        """The sender's channel hung up: waits for a model end with ``SenderLostError``."""
        with self._lock:
            self._sender_gone = True
            self._slot_arrived.notify_all()

    def layout(self, model_id: str = DEFAULT_MODEL_ID) -> Layout | None:
        """The layout the sender announced for ``model_id`` (None: not yet)."""
        model = self._models.get(model_id)
        return None if model is None else model.layout

    def wait_for_model(self, model_id: str, deadline: Deadline, pump: Pump | None = None) -> Layout:
        """Block until the sender has announced ``model_id``; ``pump`` reads the channel
        when no background thread does."""
        with self._lock:
            while model_id not in self._models:
                if self._sender_gone:
                    raise SenderLostError("the sender closed before sending any weights")
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker {self.worker_idx}: no weights for model {model_id!r} within "
                        f"{deadline}"
                    )
                self._wait_for_slot(deadline, pump)
            return self._models[model_id].layout

    def published_version(self, worker_idx: int, model_id: str = DEFAULT_MODEL_ID) -> int:
        """The newest version this worker can take now (-1: none yet): the one the sender
        points it at, which a copying worker may take while it is still being packed; a
        worker that adopts views (zero-copy) gets the one it holds until that is whole."""
        model = self._models.get(model_id)
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
        """Has the sender closed (its channel, or the model's control block says so)?"""
        model = self._models.get(model_id)
        return self._sender_gone or (model is not None and model.ctrl[_IDX_CLOSED] == 1)

    def apply_latest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, model_id: str = DEFAULT_MODEL_ID, pump: Pump | None = None,
    ) -> int | None:
        """Copy the newest version published for ``worker_idx`` into ``dest`` if it is newer
        than ``held_version``; returns it, or None if there is nothing newer (or its slot's
        handle has not arrived by ``deadline``). A version still being packed is copied as
        the sender packs it (see ``shm.apply``): the call lasts about one copy either way."""
        model = self._models[model_id]
        self.worker_idx = worker_idx
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
        model = self._models[model_id]
        self.worker_idx = worker_idx
        model.record_opened(worker_idx)
        return adopt_newest(model, worker_idx, dest, held_version,
                            deadline, lambda d: self._wait_for_slot(d, None))

    def _wait_for_slot(self, deadline: Deadline, pump: Pump | None) -> None:
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

    def forget_opened(self) -> None:
        """At a clean close and before saying goodbye: this worker releases its CUDA slots
        itself, so the sender must not take their counts back for it."""
        for model in self._models.values():
            model.forget_opened()

    def close(self) -> None:
        """Unmap every segment. In a process forked from the owner, only this copy's
        references are dropped."""
        if os.getpid() != self._owner_pid:
            self._models.clear()
            return
        with self._lock:
            for model in self._models.values():
                model.close()
            self._models.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
