"""SharedMemTransport: weights in shared memory, copied in and out tear-free.

The sender keeps a small pool of slots, each a full packed copy of the weights in a
shared segment (a CUDA buffer shared by CUDA IPC for GPU tensors). A send takes a slot no
worker uses, points the chosen workers at it through a shared control block and packs the
weights there piece by piece (``shm.slots``). A worker applies a version at its own call by
copying its slot into its model, following the pack if it is still running, or by viewing
a completely packed slot (zero-copy), under a shared ``fcntl`` lock on that slot, which the
sender's exclusive lock respects and which the kernel drops if the worker dies
(``shm.apply``). Segments and slot handles travel lazily over the workers' pipes on the
first send, so workers may start before any weights exist.

The receiver side's methods are in ``transport_receiver.py``, mixed into the class here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.layout import Layout
from weightsync.core.strategy import flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, ChannelClosed, ChannelTimeout
from weightsync.transports.memory.dumpable import protect_sender_process
from weightsync.transports.shm.slots import (
    _IDX_LATEST,
    _MAX_WORKERS,
    DEFAULT_MODEL_ID,
    _SenderModel,
    _Slot,
    _unpack_target,
)
from weightsync.transports.shm.transport_receiver import _ReceiverSide
from weightsync.transports.shm.worker_slots import _ReceiverModel

__all__ = ["DEFAULT_MODEL_ID", "SharedMemTransport"]

logger = logging.getLogger(__name__)


class SharedMemTransport(_ReceiverSide):
    """Shared-memory weight transport for processes on one host.

    Sender side: ``register_pipe`` each worker's pipe, then ``send_weights(model_id, w)``;
    the first send of a model creates its shared slots and passes them to the workers.
    Receiver side: ``register_pipe`` the other end, then
    ``setup_connection_and_weights_on_receiver`` and ``receive_weights``.

    Unlike TorchRL's in-place update, workers do not see writes as they happen: a worker
    takes a new version only when it calls ``receive_weights`` (tear-free, see docs/contract.md).
    """

    def __init__(
        self,
        policy_weights: dict[str, Any] | None = None,
        auto_register: bool = True,
        *,
        max_slots: int | None = None, grow_for_views: bool | None = None,
    ) -> None:
        self.auto_register = auto_register
        self._max_slots = max_slots
        # the default pool makes room for the slot each zero-copy worker views
        self._grow_for_views = max_slots is None if grow_for_views is None else grow_for_views
        self._lock = threading.RLock()
        self._channels: dict[int, Channel] = {}
        self._models: dict[str, _SenderModel] = {}
        # receiver side
        self._worker_idx: int | None = None
        self._receiver_models: dict[str, _ReceiverModel] = {}
        self._receiver_versions: dict[str, int] = {}
        self._sender_gone = False
        self._adopts = False  # this receiver adopts views (zero-copy): see published_version
        self._slot_arrived = threading.Condition(self._lock)
        self._owner_pid = os.getpid()
        for model_id, weights in (policy_weights or {}).items():
            self.register_weights(model_id, weights)

    # ================================================================== sender side
    def register_pipe(self, pipe: Any) -> None:
        """Add a worker's pipe (sender side) or the pipe to the sender (receiver side)."""
        with self._lock:
            self.attach_worker(len(self._channels), Channel.from_pipe(pipe))

    def attach_worker(self, worker_idx: int, channel: Channel, *, at_latest: bool = True) -> None:
        """Give worker ``worker_idx`` every shared segment, and (``at_latest``) point it at
        the newest version of each model. Used for first connections and restarts alike."""
        if not 0 <= worker_idx < _MAX_WORKERS:
            raise ValueError(f"worker_idx must be in [0, {_MAX_WORKERS}), got {worker_idx}")
        with self._lock:
            self._channels[worker_idx] = channel
            for model_id, model in self._models.items():
                model.forget_worker(worker_idx)
                if not self._announce_model(worker_idx, model_id, model, channel):
                    return
                if at_latest:
                    model.set_target(worker_idx, model.ctrl[_IDX_LATEST])

    def detach_worker(self, worker_idx: int) -> None:
        """Forget a worker (it died or left): its slot stops counting as in use."""
        with self._lock:
            self._channels.pop(worker_idx, None)
            for model in self._models.values():
                model.set_target(worker_idx, -1)
                model.take_back_opened(worker_idx)  # a dead CUDA worker's slots
                model.forget_worker(worker_idx)

    def register_weights(self, model_id: str, weights: Any) -> None:
        """Create the shared slots for ``model_id`` from ``weights`` and publish them as its
        first version; workers already registered get the segments now, later ones on
        attach."""
        flat = self._flatten(weights)
        with self._lock:
            if model_id in self._models:
                raise ValueError(f"model {model_id!r} is already registered")
            self.publish(model_id, flat, None, 0, None)

    def _create_model(self, model_id: str, layout: Layout,
                      before_seal: Callable[[_Slot], None] | None = None) -> _SenderModel:
        protect_sender_process()  # before the first segment: see ``dumpable``
        max_slots = self._max_slots or max(len(self._channels), 1) + 2
        model = _SenderModel(layout, max(2, max_slots), self._grow_for_views)
        model.before_seal = before_seal
        model.new_slot()
        model.new_slot()
        self._models[model_id] = model
        for worker_idx, channel in list(self._channels.items()):
            self._announce_model(worker_idx, model_id, model, channel)
        return model

    def _announce_model(self, worker_idx: int, model_id: str, model: _SenderModel,
                        channel: Channel) -> bool:
        """Pass a worker a model's segments; a worker that hung up meanwhile (it refused the
        layout, or died) is detached here and reported by the hub with its reason."""
        try:
            model.announce(model_id, channel, worker_idx)
            return True
        except (ChannelClosed, TimeoutError) as exc:
            logger.info("worker %d hung up before taking model %r (%s); detaching it",
                        worker_idx, model_id, exc)
            self.detach_worker(worker_idx)
            return False

    @staticmethod
    def _flatten(weights: Any) -> dict[str, torch.Tensor]:
        try:
            return flat_tensors(weights, what="SharedMemTransport weights")
        except TypeError as exc:
            raise ValueError(str(exc)) from exc

    def applied_version(self, worker_idx: int, model_id: str = DEFAULT_MODEL_ID) -> int:
        """Sender side: the version the worker last applied, as it wrote it into the
        control block (acks through shared memory wake no thread of the trainer)."""
        model = self._models.get(model_id)
        return NO_VERSION if model is None else model.applied(worker_idx)

    def layout(self, model_id: str = DEFAULT_MODEL_ID) -> Layout | None:
        model = self._models.get(model_id)
        return None if model is None else model.layout

    def send_weights(
        self, model_id: str, weights: Any, *, worker_ids: Iterable[int] | None = None,
        version: int | None = None, timeout: float | None = 10.0,
    ) -> int:
        """Publish ``weights`` as the next version of ``model_id`` to ``worker_ids`` (all
        attached workers by default) and return that version. The weights are copied now:
        later writes to them reach nobody until the next send."""
        flat = self._flatten(weights)
        with self._lock:
            model = self._models.get(model_id)
            if model is None and not self.auto_register:
                raise KeyError(
                    f"model {model_id!r} is not registered and auto_register=False; call "
                    "register_weights first"
                )
            if model is not None:
                model.layout.check_weights(flat, given_by=f"the weights sent for {model_id!r}")
            new_version = (model.version + 1 if model else 0) if version is None else version
            self.publish(model_id, flat, worker_ids, new_version, timeout)
            return new_version

    def publish(
        self, model_id: str, flat: Mapping[str, torch.Tensor], worker_ids: Iterable[int] | None,
        version: int, timeout: float | None,
    ) -> None:
        """Write already-checked flat weights as ``version`` for ``worker_ids`` (None: every
        attached worker), creating the model's slots on first use. The schemes call this
        after their own validation, so a send checks its input once. The version is
        published in a free slot, then packed there piece by piece (``shm.slots``)."""
        deadline = Deadline(timeout)
        with self._lock:
            model = self._models.get(model_id) or self._create_model(
                model_id, Layout.from_weights(flat))
            ids = list(self._channels) if worker_ids is None else list(worker_ids)
            slot = model.acquire_free_slot(list(self._channels), deadline, model_id,
                                           lambda new: self._announce_slot(model_id, model, new, deadline))
            model.write(flat, slot, ids, version, lambda: self._wake_waiting(model, ids, version))

    def publish_whole(
        self, model_id: str, layout: Layout, worker_ids: Iterable[int] | None, version: int,
        deadline: Deadline, fill: Callable[[_Slot], None], hand_out: Callable[[_Slot], None],
        usable: Callable[[_Slot], bool],
    ) -> None:
        """Publish ``version`` once ``fill`` wrote a whole free slot (a sharded trainer:
        ``shm/sharded.py``). ``hand_out`` gives each new slot to the other writers before
        it is sealed; a slot that is not ``usable`` (a writer that rejoined never mapped
        it) is retired and another taken."""
        with self._lock:
            model = self._models.get(model_id) or self._create_model(model_id, layout, hand_out)
            ids = list(self._channels) if worker_ids is None else list(worker_ids)
            while True:
                slot = model.acquire_free_slot(
                    list(self._channels), deadline, model_id,
                    lambda new: self._announce_slot(model_id, model, new, deadline))
                if usable(slot):
                    break
                model.retire(slot)
                for channel in list(self._channels.values()):
                    with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                        channel.send_nowait({"t": "shm.retire", "model_id": model_id,
                                             "index": slot.index})
            model.write_whole(slot, ids, version, fill,
                              lambda: self._wake_waiting(model, ids, version))

    def _wake_waiting(self, model: _SenderModel, worker_ids: list[int], version: int) -> None:
        """Wake the targets blocked in ``receive()`` (after the pack; for a large model also
        before it): all at once through the control block's ring word, or where there is no
        futex, a notice to each that is waiting now (its flag lowered until it waits again)."""
        if model.ring is not None:
            model.ring.raise_and_wake()
            return
        for w in worker_ids:
            channel = self._channels.get(w)
            if channel is None or not model.waiting(w):
                continue
            model.stop_waiting(w)
            with contextlib.suppress(ChannelClosed, ChannelTimeout, OSError):
                channel.send_nowait({"t": "version", "v": version})

    def _announce_slot(self, model_id: str, model: _SenderModel, slot: _Slot,
                       deadline: Deadline) -> None:
        header, fds = model.slot_message(slot, model_id)
        for w, channel in list(self._channels.items()):
            try:
                channel.send(header, fds=fds, timeout=deadline.slice(10.0))
            except (ChannelClosed, TimeoutError):
                logger.warning("worker %d did not take a new slot; detaching it", w)
                self.detach_worker(w)

    def point_at_latest(self, worker_ids: Iterable[int], model_id: str = DEFAULT_MODEL_ID) -> None:
        """Point these workers at the newest version (a worker brought in between sends)."""
        with self._lock:
            model = self._models[model_id]
            for w in worker_ids:
                model.set_target(w, model.ctrl[_IDX_LATEST])

    def latest_buffers(self, model_id: str = DEFAULT_MODEL_ID) -> dict[str, torch.Tensor]:
        """The buffers of the newest version's slot: stable while it is the newest or a
        worker's target, so another path (a broadcast) may send from them meanwhile."""
        model = self._models[model_id]
        return model.slots[_unpack_target(model.ctrl[_IDX_LATEST])[1]].buffers

    def check_ack(self, message: str = "updated") -> None:
        """No-op: the scheme confirms delivery with its own acks."""

    def send_ack(self, message: str = "updated") -> None:
        """No-op."""

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing to do: segments are passed lazily on the first send."""

    # ================================================================== both
    def close(self) -> None:
        """Release every segment this transport holds (sender or receiver side). In a
        process forked from the owner, only this copy's references are dropped: the shared
        control block (which tells workers the sender closed) is left alone."""
        if os.getpid() != self._owner_pid:
            self._models.clear()
            self._receiver_models.clear()
            self._channels.clear()
            return
        with self._lock:
            for model in self._models.values():
                model.close()
            self._models.clear()
            for rmodel in self._receiver_models.values():
                rmodel.close()
            self._receiver_models.clear()
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
