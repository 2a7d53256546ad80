"""A worker's side of SharedMem's shared memory: its read-only mapping of one model's
control block and slots, and its own ack segment (the only shared memory it writes). The
layout of both, and the trainer's side, are in ``shm/slots.py``."""

from __future__ import annotations

import logging
import os
import select
import time

import torch

from weightsync.core.layout import Layout
from weightsync.transports.local.channel import Message
from weightsync.transports.memory.cuda_ipc import open_cuda_buffer
from weightsync.transports.memory.memfd import Segment
from weightsync.transports.memory.pieces import PiecePlan
from weightsync.transports.shm.slots import (
    _ACK_NBYTES,
    _ACK_OPENED,
    _ACK_VIEWING,
    _CONTROL_NBYTES,
    _OPENED_BITS,
    FORK_LOCK_WAIT_S,
    _ring_of,
    _Slot,
)

logger = logging.getLogger(__name__)


class _ReceiverModel:
    """A worker's mapping of one model id's control block and slots (read-only) and of its
    own ack segment (the only shared memory it writes)."""

    def __init__(self, layout: Layout, control_fd: int, ack_fd: int) -> None:
        self.layout = layout
        self.control = Segment.attach(control_fd, _CONTROL_NBYTES)
        self.ctrl = self.control.view_int64()
        self.ack_segment = Segment.attach(ack_fd, _ACK_NBYTES, writable=True)
        self.ack = self.ack_segment.view_int64()
        self.ring = _ring_of(self.control, self.ctrl)
        self.slots: dict[int, _Slot] = {}
        self.plan = PiecePlan(layout)
        self._views: dict[int, list[list[torch.Tensor]]] = {}  # slot -> its pieces' views
        self._tensor_views: dict[int, dict[str, torch.Tensor]] = {}  # slot -> each tensor
        self.held_slot: int | None = None  # zero-copy: the slot the model's views point into
        self.viewer: int | None = None  # zero-copy: the worker index that views held_slot
        self._opened_bits = 0  # CUDA slots mapped here (their consumer count holds our one)
        self._recorded: tuple[int, int] | None = None  # (worker, bits) written to ctrl
        #: copy mode: (target, bytes packed) of a pack given up as stalled; not followed
        #: again while both stay the same (see ``shm.apply``)
        self.stalled: tuple[int, int] | None = None
        #: zero-copy: the tensors whose ``.data`` views ``held_slot`` (a forked child makes
        #: them private), and the read ends of pipes whose write ends forked children close
        #: once they hold their own lock on that slot (see ``shm.apply``)
        self.adopted: list[torch.Tensor] = []
        self.fork_pipes: list[int] = []
        self.fork_write_end: int | None = None  # the current fork's, between its two halves

    def views_of(self, slot: _Slot) -> list[list[torch.Tensor]]:
        """The typed views of each piece of ``slot`` (made once per slot; a reader uses them
        only for a layout packed in pieces)."""
        views = self._views.get(slot.index)
        if views is None:
            views = self._views[slot.index] = self.plan.buffer_views(slot.buffers)
        return views

    def tensors_of(self, slot: _Slot) -> dict[str, torch.Tensor]:
        """Each tensor of the layout as a view into ``slot`` (made once per slot)."""
        views = self._tensor_views.get(slot.index)
        if views is None:
            views = self._tensor_views[slot.index] = self.layout.tensor_views(slot.buffers)
        return views

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
                if slot.index < _OPENED_BITS:
                    self._opened_bits |= 1 << slot.index
        self.slots[slot.index] = slot
        self._views.pop(slot.index, None)
        self._tensor_views.pop(slot.index, None)

    def drop_slot(self, index: int) -> None:
        """The sender retired a free slot (nobody's target, nobody views it): unmap it."""
        slot = self.slots.pop(index, None)
        self._views.pop(index, None)
        self._tensor_views.pop(index, None)
        if slot is not None:
            slot.close()

    def record_opened(self, worker_idx: int) -> None:
        """Tell the sender, in the control block, which CUDA slots this worker holds open:
        should it die, the sender takes back the counts it left. Written after opening
        (a death in between leaks, never frees memory a live worker maps)."""
        if self._opened_bits and self._recorded != (worker_idx, self._opened_bits):
            self.ack[_ACK_OPENED] = self._opened_bits
            self._recorded = (worker_idx, self._opened_bits)

    def forget_opened(self) -> None:
        """A clean close, before the slots are released: the sender must not take back
        counts this worker's own release takes back."""
        if self._recorded is not None:
            self.ack[_ACK_OPENED] = 0
            self._recorded = None

    def wait_for_forked_children(self) -> None:
        """Zero-copy, before this worker lets the slot it views go: wait (up to
        ``FORK_LOCK_WAIT_S``) until every child forked since holds its own lock on it (or
        has exited), so the sender cannot rewrite it while a child copies it."""
        end = time.monotonic() + FORK_LOCK_WAIT_S
        while self.fork_pipes:
            read_end = self.fork_pipes[0]
            ready, _, _ = select.select([read_end], [], [], max(0.0, end - time.monotonic()))
            if ready and os.read(read_end, 64):
                continue  # nothing is ever written: only the close (EOF) counts
            if not ready:
                logger.warning("a process forked from this zero-copy worker did not copy its "
                               "weights within %.1f s: it may see them change", FORK_LOCK_WAIT_S)
            os.close(read_end)
            self.fork_pipes.pop(0)

    def close(self) -> None:
        self.wait_for_forked_children()  # closing the fd drops this process's slot locks
        if self.held_slot is not None and self.viewer is not None:
            self.ack[_ACK_VIEWING] = -1
        self.held_slot = None
        self.adopted = []
        self.forget_opened()
        self._views.clear()
        self._tensor_views.clear()
        self.ctrl.release()
        self.ack.release()
        for slot in self.slots.values():
            slot.close()
        self.control.close()
        self.ack_segment.close()
