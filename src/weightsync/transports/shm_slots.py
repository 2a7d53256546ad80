"""The shared-memory layout behind SharedMem: a control block and a pool of slots.

The control block is one small shared segment of int64 words: a magic, the newest
version's target, a closed flag, and per worker its target (version and slot), a flag
"blocked in receive()" and the version it last applied. Each slot is one full packed copy
of the weights (a memfd segment on the CPU, a CUDA buffer shared by IPC on a GPU). A
byte-range ``fcntl`` lock per slot, in the control segment's lock space, keeps the sender
(exclusive) off a slot any worker reads (shared); the kernel drops a dead reader's lock.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.cuda_ipc import open_cuda_buffer, share_cuda_buffer
from weightsync.transports.local_channel import Message
from weightsync.transports.shared_memory import Segment

_MAGIC = 0x5753594E43  # "WSYNC"
_SLOT_SPACE = 1024  # a target packs (version, slot) as version * _SLOT_SPACE + slot
_MAX_WORKERS = 1024
_HEADER_WORDS = 8
_IDX_MAGIC, _IDX_LATEST, _IDX_CLOSED = 0, 1, 2
_LOCK_BASE = 1 << 20  # byte offset of slot locks in the control segment's lock space
_WAITING_BASE = _HEADER_WORDS + _MAX_WORKERS  # per-worker flag: blocked in receive()
_APPLIED_BASE = _HEADER_WORDS + 2 * _MAX_WORKERS  # per-worker: the version it last applied
_CONTROL_NBYTES = (_HEADER_WORDS + 3 * _MAX_WORKERS) * 8
DEFAULT_MODEL_ID = "policy"


def _pack_target(version: int, slot: int) -> int:
    return version * _SLOT_SPACE + slot


def _unpack_target(packed: int) -> tuple[int, int]:
    return divmod(packed, _SLOT_SPACE)


def _lock(fd: int, slot: int, exclusive: bool) -> bool:
    """Try to take the slot's lock without blocking; True on success."""
    kind = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        fcntl.lockf(fd, kind | fcntl.LOCK_NB, 1, _LOCK_BASE + slot, 0)
        return True
    except OSError:
        return False


def _unlock(fd: int, slot: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, _LOCK_BASE + slot, 0)


@dataclass
class _Slot:
    """One full copy of the weights: a buffer per device of the layout."""

    index: int
    buffers: dict[str, torch.Tensor]
    segments: dict[str, Segment] = field(default_factory=dict)  # CPU buffers only

    def close(self) -> None:
        self.buffers.clear()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()


class _SenderModel:
    """The sender's shared state for one model id: control block and slot pool."""

    def __init__(self, layout: Layout, max_slots: int) -> None:
        self.layout = layout
        self.max_slots = max_slots
        self.control = Segment.create(_CONTROL_NBYTES)
        self.ctrl = self.control.view_int64()
        self.ctrl[_IDX_MAGIC] = _MAGIC
        self.ctrl[_IDX_LATEST] = -1
        for w in range(_MAX_WORKERS):
            self.ctrl[_HEADER_WORDS + w] = -1
            self.ctrl[_APPLIED_BASE + w] = NO_VERSION
        self.slots: list[_Slot] = []
        self.version = NO_VERSION

    def new_slot(self) -> _Slot:
        slot = _Slot(len(self.slots), {})
        for device, nbytes in self.layout.nbytes_by_device.items():
            if device == "cpu":
                seg = Segment.create(nbytes)
                slot.segments[device] = seg
                assert seg.tensor is not None
                slot.buffers[device] = seg.tensor
            else:
                slot.buffers[device] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.slots.append(slot)
        return slot

    def slot_message(self, slot: _Slot, model_id: str) -> tuple[dict[str, Any], list[int]]:
        devices = {d: (None if d == "cpu" else share_cuda_buffer(b)) for d, b in slot.buffers.items()}
        fds = [slot.segments["cpu"].fd] if "cpu" in slot.segments else []
        return {"t": "shm.slot", "model_id": model_id, "index": slot.index, "devices": devices}, fds

    def target(self, worker_idx: int) -> int:
        return self.ctrl[_HEADER_WORDS + worker_idx]

    def waiting(self, worker_idx: int) -> bool:
        return self.ctrl[_WAITING_BASE + worker_idx] != 0

    def set_target(self, worker_idx: int, packed: int) -> None:
        self.ctrl[_HEADER_WORDS + worker_idx] = packed

    def applied(self, worker_idx: int) -> int:
        return self.ctrl[_APPLIED_BASE + worker_idx]

    def close(self) -> None:
        self.ctrl[_IDX_CLOSED] = 1
        self.ctrl.release()
        for slot in self.slots:
            slot.close()
        self.control.close()


class _ReceiverModel:
    """A worker's mapping of one model id's control block and slots."""

    def __init__(self, layout: Layout, control_fd: int) -> None:
        self.layout = layout
        self.control = Segment.attach(control_fd, _CONTROL_NBYTES, writable=True)
        self.ctrl = self.control.view_int64()
        self.slots: dict[int, _Slot] = {}
        self.dest_cache: tuple[int, dict[str, torch.Tensor]] | None = None
        self.held_slot: int | None = None  # zero-copy: the slot the model's views point into

    def add_slot(self, message: Message) -> None:
        header = message.header
        slot = _Slot(int(header["index"]), {})
        fds = list(message.fds)
        for device, handle in header["devices"].items():
            if device == "cpu":
                seg = Segment.attach(fds.pop(0), self.layout.nbytes_by_device["cpu"])
                slot.segments["cpu"] = seg
                assert seg.tensor is not None
                slot.buffers["cpu"] = seg.tensor
            else:
                slot.buffers[device] = open_cuda_buffer(handle)
        self.slots[slot.index] = slot

    def _newest(self, worker_idx: int, held_version: int, deadline: Deadline,
                wait_for_slot: Callable[[Deadline], None]) -> tuple[int, int, _Slot] | None:
        """(packed target, version, slot) of the newest version for ``worker_idx`` if newer
        than ``held_version`` and its slot's handle is here; else None."""
        while True:
            packed = self.ctrl[_HEADER_WORDS + worker_idx]
            if packed < 0:
                return None
            version, index = _unpack_target(packed)
            if version == held_version:
                return None
            slot = self.slots.get(index)
            if slot is not None:
                return packed, version, slot
            wait_for_slot(deadline)  # its handle is still on the way
            if deadline.expired():
                return None  # a later call applies it

    def copy_newest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, wait_for_slot: Callable[[Deadline], None],
    ) -> int | None:
        """Copy the newest version into ``dest`` under the slot's shared lock."""
        while True:
            found = self._newest(worker_idx, held_version, deadline, wait_for_slot)
            if found is None:
                return None
            packed, version, slot = found
            if not _lock(self.control.fd, slot.index, exclusive=False):
                continue  # the sender is rewriting that slot: our target has moved on
            try:
                if self.ctrl[_HEADER_WORDS + worker_idx] != packed:
                    continue
                self.layout.unpack(slot.buffers, dest)
                for device in slot.buffers:
                    if device != "cpu":
                        torch.cuda.synchronize(device)
            finally:
                _unlock(self.control.fd, slot.index)
            self.ctrl[_APPLIED_BASE + worker_idx] = version
            return version

    def adopt_newest(
        self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
        deadline: Deadline, wait_for_slot: Callable[[Deadline], None],
    ) -> int | None:
        """Point ``dest``'s tensors at views into the newest slot (zero-copy).

        The worker then holds that slot's shared lock until its next adopt (or close), so
        the sender never rewrites memory the model reads; the slot it held before is let
        go. On the CPU the views live in a read-only mapping: a stray write into the
        model's weights is a crash (SIGSEGV), never a change seen by other workers."""
        while True:
            found = self._newest(worker_idx, held_version, deadline, wait_for_slot)
            if found is None:
                return None
            packed, version, slot = found
            index = slot.index
            if index != self.held_slot and not _lock(self.control.fd, index, exclusive=False):
                continue
            if self.ctrl[_HEADER_WORDS + worker_idx] != packed:
                if index != self.held_slot:
                    _unlock(self.control.fd, index)
                continue
            views = self.layout.tensor_views(slot.buffers)
            for name, tensor in dest.items():
                tensor.data = views[name]
            if self.held_slot is not None and self.held_slot != index:
                _unlock(self.control.fd, self.held_slot)
            self.held_slot = index
            self.ctrl[_APPLIED_BASE + worker_idx] = version
            return version

    def close(self) -> None:
        self.ctrl.release()
        for slot in self.slots.values():
            slot.close()
        self.control.close()
