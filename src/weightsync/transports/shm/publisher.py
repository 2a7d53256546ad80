"""The SharedMem sender's data path: versions published into a pool of shared slots.

The sender keeps a small pool of slots per model, each a full packed copy of the weights
in a shared segment (a CUDA buffer shared by CUDA IPC for GPU tensors). A publish takes a
slot no worker uses, points the chosen workers at it through a shared control block and
packs the weights there piece by piece (``shm.slots``); workers read it at their own call
(``shm.reader``). Segments and slot handles travel lazily over each worker's channel the
first time they exist, so workers may attach before any weights do.

:class:`SlotPublisher` is what :class:`~weightsync.transports.shm.endpoints.SharedMemWriter`
(and the Ray scheme's node-local path) publish through; TorchRL's ``SharedMemTransport``
(``shm.transport``) is an adapter over it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.layout import Layout
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

__all__ = ["SlotPublisher"]

logger = logging.getLogger(__name__)


class SlotPublisher:
    """The sender's slot pools (one per model id) and the channels of its workers.

    ``attach_worker`` gives a worker every segment; ``publish`` writes a version into a
    free slot and points the chosen workers at it; ``applied_version`` reads back what
    each worker applied (acks through shared memory, which wake no thread here)."""

    def __init__(self, max_slots: int | None = None, grow_for_views: bool | None = None) -> None:
        """``max_slots`` None: the number of attached workers + 2 (at the first publish),
        and room for the slot each zero-copy worker views unless ``grow_for_views`` is
        False."""
        self._max_slots = max_slots
        # the default pool makes room for the slot each zero-copy worker views
        self._grow_for_views = max_slots is None if grow_for_views is None else grow_for_views
        self._lock = threading.RLock()
        self._channels: dict[int, Channel] = {}
        self._models: dict[str, _SenderModel] = {}
        self._owner_pid = os.getpid()

    @property
    def workers(self) -> list[int]:
        """The indices of the workers attached now."""
        with self._lock:
            return list(self._channels)

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

    def applied_version(self, worker_idx: int, model_id: str = DEFAULT_MODEL_ID) -> int:
        """The version the worker last applied, as it wrote it into the control block."""
        model = self._models.get(model_id)
        return NO_VERSION if model is None else model.applied(worker_idx)

    def layout(self, model_id: str = DEFAULT_MODEL_ID) -> Layout | None:
        """The layout ``model_id`` was published with (None: never published)."""
        model = self._models.get(model_id)
        return None if model is None else model.layout

    def version(self, model_id: str = DEFAULT_MODEL_ID) -> int:
        """The newest version written for ``model_id`` (-1: none)."""
        model = self._models.get(model_id)
        return NO_VERSION if model is None else model.version

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

    # ------------------------------------------------------------------ internals
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

    def close(self) -> None:
        """Release every segment and close every worker's channel. In a process forked from
        the owner, only this copy's references are dropped: the shared control block (which
        tells workers the sender closed) is left alone."""
        if os.getpid() != self._owner_pid:
            self._models.clear()
            self._channels.clear()
            return
        with self._lock:
            for model in self._models.values():
                model.close()
            self._models.clear()
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
