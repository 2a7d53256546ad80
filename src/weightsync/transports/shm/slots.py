"""The shared-memory layout behind SharedMem: a control block, acks and a pool of slots.

The control block is one small shared segment of int64 words, written by the sender only:
a magic, the newest version's target, a closed flag, the previous newest target (a whole
version kept intact while the next one is packed), a ring word that workers blocked in
``receive()`` sleep on (``futex``), per worker its target (version and slot), and per slot
how many of its bytes are packed. What a worker writes lives in its own *ack* segment, one
per worker (and per attach: a worker that joins again gets a fresh one), passed to that
worker only: the version it last applied, a flag "blocked in receive()", the CUDA slots
it opened and the slot it views (zero-copy). The control block and the slots are sealed
against writes by anyone but the sender (``memfd``: workers map them read-only and
cannot remap them writable), so a worker can neither forge a version for the others nor
another worker's state; it can only state its own (see docs/security.md).

Each slot is one full packed copy of the weights (a memfd segment on the CPU, a
CUDA buffer shared by IPC on a GPU). A byte-range ``fcntl`` lock per slot, in the control
segment's lock space, keeps the sender (exclusive) off a slot any worker reads (shared);
the kernel drops a dead reader's lock. A zero-copy worker also records the slot it views:
it pins that slot besides its target, and the default pool grows by one per such worker.

A version is published before it is packed: the sender takes a free slot (exclusive lock:
nobody reads it), points the workers at it with its "bytes packed" word at 0, lets the lock
go and packs piece by piece, raising the word as it goes, so a copying worker follows a
few megabytes behind. A slot counts as a whole version only once the word reaches the
slot's size; a pack that fails puts every target back on the previous whole version.
"""

from __future__ import annotations

import fcntl
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel
from weightsync.transports.memory.cuda_ipc import (
    ConsumerCount,
    counts_to_take_back,
    share_cuda_buffer,
    take_back,
)
from weightsync.transports.memory.futex import FutexWord
from weightsync.transports.memory.memfd import Segment
from weightsync.transports.memory.pieces import PiecePlan

_MAGIC = 0x5753594E43  # "WSYNC"
_SLOT_SPACE = 1024  # a target packs (version, slot) as version * _SLOT_SPACE + slot
_MAX_WORKERS = 1024
_HEADER_WORDS = 8
_IDX_MAGIC, _IDX_LATEST, _IDX_CLOSED, _IDX_PREVIOUS, _IDX_RING = 0, 1, 2, 3, 4
_LOCK_BASE = 1 << 20  # byte offset of slot locks in the control segment's lock space
_PACKED_BASE = _HEADER_WORDS + _MAX_WORKERS  # per-slot: bytes packed of its version
#: what the control block holds: a SharedMem scheme's most workers and slots
MAX_WORKERS, MAX_SLOTS = _MAX_WORKERS, _SLOT_SPACE
_PACK_FAILED = -1  # a slot's "bytes packed" word after its pack failed
_CONTROL_NBYTES = (_HEADER_WORDS + _MAX_WORKERS + _SLOT_SPACE) * 8
# a worker's ack segment: the version it last applied; its flag "blocked in receive()";
# a bit per CUDA slot it opened and has not released (slots 0..62 tracked); the slot its
# model views (zero-copy, under its shared lock), -1 for none
_ACK_APPLIED, _ACK_WAITING, _ACK_OPENED, _ACK_VIEWING = 0, 1, 2, 3
_ACK_NBYTES = 4 * 8
_OPENED_BITS = 63
DEFAULT_MODEL_ID = "policy"
#: the longest a zero-copy worker waits for a forked child to lock the slot it views
FORK_LOCK_WAIT_S = 2.0

logger = logging.getLogger(__name__)


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


def _ring_of(control: Segment, ctrl: memoryview) -> FutexWord | None:
    """The control block's ring word: raised (and its sleepers woken) at each publish."""
    assert control.tensor is not None
    return FutexWord.at(ctrl, _IDX_RING, control.tensor.data_ptr())


class _Ack:
    """A worker's ack segment, as the sender holds it (read, and reset on its behalf)."""

    def __init__(self) -> None:
        self.segment = Segment.create(_ACK_NBYTES, receivers_write=True)
        self.words = self.segment.view_int64()
        self.words[_ACK_APPLIED] = NO_VERSION
        self.words[_ACK_WAITING] = 0
        self.words[_ACK_OPENED] = 0
        self.words[_ACK_VIEWING] = -1

    def close(self) -> None:
        """Let the segment go; a thread still reading ``words`` keeps the mapping alive."""
        self.segment.close()


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

    def __init__(self, layout: Layout, max_slots: int, grow_for_views: bool = False) -> None:
        self.layout = layout
        self.max_slots = max_slots
        #: one more slot allowed per zero-copy worker (it pins the slot it views besides
        #: its target): the default pool; a cap the user chose is kept
        self.grow_for_views = grow_for_views
        self.control = Segment.create(_CONTROL_NBYTES)
        self.ctrl = self.control.view_int64()
        self.ctrl[_IDX_MAGIC] = _MAGIC
        self.ctrl[_IDX_LATEST] = -1
        self.ctrl[_IDX_PREVIOUS] = -1
        self.ring = _ring_of(self.control, self.ctrl)
        self.plan = PiecePlan(layout)
        self.views: dict[int, list[list[torch.Tensor]]] = {}  # slot -> the views packed through
        for w in range(_MAX_WORKERS):
            self.ctrl[_HEADER_WORDS + w] = -1
        self.acks: dict[int, _Ack] = {}  # worker -> the ack segment it was given
        self.slots: list[_Slot] = []
        # slot -> where torch counts the workers that opened its CUDA buffers
        self.cuda_counts: dict[int, set[ConsumerCount]] = {}
        self.version = NO_VERSION
        #: a sharded trainer: hands each new slot to the other ranks, who map it writable,
        #: before it is sealed (``shm/sharded.py``); None: sealed at once
        self.before_seal: Callable[[_Slot], None] | None = None
        #: slots let go for good (a rank that rejoined cannot map them writable)
        self.retired: set[int] = set()

    def new_slot(self) -> _Slot:
        slot = _Slot(len(self.slots), {})
        for device, nbytes in self.layout.nbytes_by_device.items():
            if device == "cpu":
                seg = Segment.create(nbytes, sealed=self.before_seal is None)
                slot.segments[device] = seg
                assert seg.tensor is not None
                slot.buffers[device] = seg.tensor
            else:
                slot.buffers[device] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if self.before_seal is not None:
            try:
                self.before_seal(slot)
            finally:  # sealed whatever happened: workers never get a writable slot
                for seg in slot.segments.values():
                    seg.seal(writes=True)
        self.slots.append(slot)
        return slot

    def retire(self, slot: _Slot) -> None:
        """Let a free slot (held with the exclusive lock) go for good: it is never chosen
        again and its memory goes once the workers drop it too."""
        self.retired.add(slot.index)
        _unlock(self.control.fd, slot.index)
        self.views.pop(slot.index, None)
        slot.close()

    def announce(self, model_id: str, channel: Channel, worker_idx: int) -> None:
        """Pass a worker the control block, a fresh ack segment of its own and every slot
        of this model (their fds)."""
        self.forget_worker(worker_idx)
        ack = self.acks[worker_idx] = _Ack()
        header = {"t": "shm.model", "model_id": model_id, "layout": self.layout.to_dict()}
        channel.send(header, fds=[self.control.fd, ack.segment.fd], timeout=10.0)
        for slot in self.slots:
            slot_header, fds = self.slot_message(slot, model_id)
            channel.send(slot_header, fds=fds, timeout=10.0)

    def slot_message(self, slot: _Slot, model_id: str) -> tuple[dict[str, Any], list[int]]:
        devices = {d: (None if d == "cpu" else share_cuda_buffer(b)) for d, b in slot.buffers.items()}
        for fields in devices.values():
            if fields is not None:
                self.cuda_counts.setdefault(slot.index, set()).add(ConsumerCount.of(fields))
        fds = [slot.segments["cpu"].fd] if "cpu" in slot.segments else []
        return {"t": "shm.slot", "model_id": model_id, "index": slot.index, "devices": devices}, fds

    def target(self, worker_idx: int) -> int:
        return self.ctrl[_HEADER_WORDS + worker_idx]

    def _ack_word(self, worker_idx: int, word: int, default: int) -> int:
        ack = self.acks.get(worker_idx)
        return default if ack is None else int(ack.words[word])

    def waiting(self, worker_idx: int) -> bool:
        return self._ack_word(worker_idx, _ACK_WAITING, 0) != 0

    def stop_waiting(self, worker_idx: int) -> None:
        """Lower a worker's "blocked in receive()" flag: it was sent a notice."""
        ack = self.acks.get(worker_idx)
        if ack is not None:
            ack.words[_ACK_WAITING] = 0

    def set_target(self, worker_idx: int, packed: int) -> None:
        self.ctrl[_HEADER_WORDS + worker_idx] = packed

    def applied(self, worker_idx: int) -> int:
        """The version the worker says it last applied (its own ack segment)."""
        return self._ack_word(worker_idx, _ACK_APPLIED, NO_VERSION)

    def viewing(self, worker_idx: int) -> int:
        """The slot worker ``worker_idx``'s model views (zero-copy), -1 for none."""
        return self._ack_word(worker_idx, _ACK_VIEWING, -1)

    def forget_worker(self, worker_idx: int) -> None:
        """A worker (re)joins or leaves: nothing applied, nothing viewed. Its ack segment
        is let go: a worker that joins again gets a fresh one, so a process that held the
        old one writes nothing the sender reads."""
        ack = self.acks.pop(worker_idx, None)
        if ack is not None:
            ack.close()

    def write(
        self, flat: Mapping[str, torch.Tensor], slot: _Slot, worker_ids: list[int],
        version: int, on_published: Callable[[], None],
    ) -> None:
        """Publish ``version`` in ``slot`` (held with the exclusive lock, which is let go
        here) and pack ``flat`` into it piece by piece. ``on_published`` (wake the workers
        blocked in ``receive()``) runs right after the pack (a wake-up before a short pack
        would only compete with it), and also before it when readers can follow it piece by
        piece (a copying worker follows the pack; a zero-copy one waits for its end). If
        the pack fails, every target goes back to what it was (whole versions) and the error
        is raised: workers that followed part of it restore a whole version themselves."""
        ctrl, packed_word = self.ctrl, _PACKED_BASE + slot.index
        packed = _pack_target(version, slot.index)
        before = {w: self.target(w) for w in worker_ids}
        latest_before = ctrl[_IDX_LATEST]
        try:
            ctrl[packed_word] = 0
            ctrl[_IDX_PREVIOUS] = latest_before
            ctrl[_IDX_LATEST] = packed
            for w in worker_ids:
                self.set_target(w, packed)
        finally:
            _unlock(self.control.fd, slot.index)  # readers follow the watermark from here
        try:
            if self.plan.in_pieces:
                on_published()
            views = self.views.get(slot.index)
            if views is None:
                views = self.views[slot.index] = self.plan.buffer_views(slot.buffers)
            self.plan.pack(flat, slot.buffers, lambda watermark: None if watermark >= self.plan.total
                           else ctrl.__setitem__(packed_word, watermark), views)
            for device in slot.buffers:
                if device != "cpu":
                    torch.cuda.synchronize(device)
            ctrl[packed_word] = self.plan.total
        except BaseException:
            # targets first: a follower that sees the failure then finds a whole version
            if ctrl[_IDX_LATEST] == packed:
                ctrl[_IDX_LATEST] = latest_before
            for w, target in before.items():
                if self.target(w) == packed:
                    self.set_target(w, target)
            ctrl[packed_word] = _PACK_FAILED
            raise
        self.version = version
        on_published()

    def write_whole(
        self, slot: _Slot, worker_ids: list[int], version: int,
        fill: Callable[[_Slot], None], on_published: Callable[[], None],
    ) -> None:
        """Publish ``version`` only once ``fill`` has written all of ``slot`` (held with
        the exclusive lock until then): a sharded trainer's ranks write it together, so no
        reader may follow it piece by piece. If ``fill`` fails nothing was published."""
        try:
            fill(slot)
        except BaseException:
            self.ctrl[_PACKED_BASE + slot.index] = _PACK_FAILED
            _unlock(self.control.fd, slot.index)
            raise
        packed = _pack_target(version, slot.index)
        try:
            self.ctrl[_PACKED_BASE + slot.index] = self.plan.total
            self.ctrl[_IDX_PREVIOUS] = self.ctrl[_IDX_LATEST]
            self.ctrl[_IDX_LATEST] = packed
            for w in worker_ids:
                self.set_target(w, packed)
        finally:
            _unlock(self.control.fd, slot.index)
        self.version = version
        on_published()

    def acquire_free_slot(self, worker_ids: list[int], deadline: Deadline, model_id: str,
                          announce: Callable[[_Slot], None]) -> _Slot:
        """A slot that is neither the newest nor any worker's target nor being read,
        exclusively locked; grows the pool (up to ``max_slots``, ``announce`` passing each
        new slot to the workers) before waiting for a reader to let one go."""
        while True:
            busy = {_unpack_target(self.ctrl[_IDX_LATEST])[1]} if self.ctrl[_IDX_LATEST] >= 0 else set()
            for w in worker_ids:
                if self.target(w) >= 0:
                    busy.add(_unpack_target(self.target(w))[1])
            for slot in self.slots:
                if slot.index not in busy and slot.index not in self.retired \
                        and _lock(self.control.fd, slot.index, exclusive=True):
                    return slot
            viewers = [w for w in worker_ids if self.viewing(w) >= 0]
            cap = self.max_slots + (len(viewers) if self.grow_for_views else 0)
            if len(self.slots) - len(self.retired) < cap and len(self.slots) < _SLOT_SPACE:
                slot = self.new_slot()
                announce(slot)
                if _lock(self.control.fd, slot.index, exclusive=True):
                    return slot
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"no free shared-memory slot for model {model_id!r} within {deadline} "
                    f"({len(self.slots)} slots, max_slots={self.max_slots}): "
                    f"{self._pins(worker_ids)}"
                )
            time.sleep(0.0002)

    def _pins(self, worker_ids: list[int]) -> str:
        """Who keeps the slots from being rewritten, for the error of a send that found
        none free."""
        pins = []
        for w in worker_ids:
            what = []
            if self.viewing(w) >= 0:
                what.append(f"views slot {self.viewing(w)} (zero-copy)")
            if self.target(w) >= 0 and self.target(w) != self.ctrl[_IDX_LATEST]:
                version, index = _unpack_target(self.target(w))
                what.append(f"has not taken version {version} (slot {index})")
            if what:
                pins.append(f"worker {w} " + " and ".join(what))
        if not pins:
            return "workers are still reading every slot"
        return ("slots are pinned by workers that are behind: " + "; ".join(pins)
                + " (a larger max_slots, or those workers' next poll(), frees one)")

    def take_back_opened(self, worker_idx: int) -> int:
        """Worker ``worker_idx`` is gone: take back the consumer counts it left on CUDA
        slots it opened and never released (a clean close clears its record first), so
        ``torch.cuda.ipc_collect()`` can free those slots; returns how many."""
        ack = self.acks.get(worker_idx)
        if ack is None:
            return 0
        bits, ack.words[_ACK_OPENED] = int(ack.words[_ACK_OPENED]) & ((1 << _OPENED_BITS) - 1), 0
        if not bits:
            return 0
        opened = {worker_idx: {count for index, counts in self.cuda_counts.items()
                               if index < _OPENED_BITS and bits >> index & 1
                               for count in counts}}
        taken = take_back(counts_to_take_back(opened, {worker_idx}))
        if taken and torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return taken

    def close(self) -> None:
        self.ctrl[_IDX_CLOSED] = 1
        self.ctrl.release()
        for worker_idx in list(self.acks):
            self.forget_worker(worker_idx)
        self.views.clear()  # views into the slots would keep their CUDA memory alive
        for slot in self.slots:
            slot.close()
        self.control.close()
        if self.cuda_counts and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # frees the CUDA slots no live worker holds

