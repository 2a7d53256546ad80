"""A worker taking the newest version out of the shared slots, at its own call.

Copy mode copies the slot into the model. When the slot is still being packed, the copy
follows the sender piece by piece, a few megabytes behind (see ``shm.slots``), so the
worker holds the version moments after the pack ends instead of one more full copy later
(a slot packed in one go, small or on a GPU, is waited for only within the call's
deadline: ``poll()`` then keeps the old version and the next call takes the new one).
The wait is bounded by the pack itself, which lasts about as long as the copy a copy-mode
``poll()`` makes anyway; a pack that makes no progress for ``STALL_S`` (the trainer
stopped or died; ``POLL_STALL_S`` in a ``poll()``, which must not block, and which copies
nothing until it has seen the pack move) is given up, and not followed again until it
moves (``_ReceiverModel.stalled``): a dead trainer then surfaces as ``SenderLostError``
at once. A model that took part of a version whose pack failed or
stalled is given a whole version back (the sender's restored target, or the previous
newest slot, kept intact during the pack) before the call returns: a model never holds
a torn version, and a version it held already is never reported as newly applied.

Zero-copy mode points the model's tensors at read-only views of a slot, and only of a slot
that is completely packed; ``poll()`` keeps the old version while the newest is packed,
``receive()`` waits for it. Every read happens under the slot's shared lock. A process
forked from a zero-copy worker does not inherit that lock (``fcntl`` locks are per
process): at the fork the child takes its own, copies the weights it views into private
memory and lets it go, while the parent keeps the slot until the child has its lock.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import SchemaMismatchError, WeightSyncError
from weightsync.core.versions import NO_VERSION
from weightsync.transports.shm.slots import (
    _ACK_APPLIED,
    _ACK_VIEWING,
    _HEADER_WORDS,
    _IDX_PREVIOUS,
    _PACK_FAILED,
    _PACKED_BASE,
    _lock,
    _Slot,
    _unlock,
    _unpack_target,
)
from weightsync.transports.shm.worker_slots import _ReceiverModel

#: a pack that makes no progress for this long is given up (the trainer stopped or died)
STALL_S = 0.25
#: the same for a ``poll()`` (a zero deadline): it must return at once, not wait for a pack
POLL_STALL_S = 0.01
#: how long a follower sleeps when it has caught up with the sender's pack
_NAP_S = 0.0002
logger = logging.getLogger(__name__)


WaitForSlot = Callable[[Deadline], None]


def newest_target(model: _ReceiverModel, worker_idx: int, held_version: int,
                  deadline: Deadline, wait_for_slot: WaitForSlot) -> tuple[int, int, _Slot] | None:
    """(packed target, version, slot) of the newest version for ``worker_idx`` if newer
    than ``held_version`` and its slot's handle is here; else None."""
    while True:
        packed = model.ctrl[_HEADER_WORDS + worker_idx]
        if packed < 0:
            return None
        version, index = _unpack_target(packed)
        if version == held_version:
            return None
        slot = model.slots.get(index)
        if slot is not None:
            return packed, version, slot
        wait_for_slot(deadline)  # its handle is still on the way
        if deadline.expired():
            return None  # a later call applies it


def _sync(slot: _Slot) -> None:
    for device in slot.buffers:
        if device != "cpu":
            torch.cuda.synchronize(device)


def _follow(model: _ReceiverModel, worker_idx: int, packed: int, slot: _Slot,
            dest: Mapping[str, torch.Tensor], deadline: Deadline) -> tuple[bool, bool]:
    """Copy the slot into ``dest``, following its pack if it is still running; under the
    slot's shared lock. A slot that cannot be copied piece by piece (small, on a GPU) is
    waited for only until ``deadline``. Returns (whole version copied, ``dest`` partly
    overwritten)."""
    plan, ctrl = model.plan, model.ctrl
    word = _PACKED_BASE + slot.index
    if ctrl[word] == plan.total:
        model.layout.unpack(slot.buffers, dest, model.tensors_of(slot))
        _sync(slot)
        return True, False
    sources = model.views_of(slot) if plan.reader_ok(dest) else None
    targets = plan.dest_views(dest) if sources is not None else []
    index, last_mark, last_move = 0, -2, time.monotonic()
    # a poll() copies nothing until it has seen the pack move: a frozen trainer costs it
    # POLL_STALL_S, not a copy and a restore
    polling = deadline.expired()
    stall_s, first_mark = (POLL_STALL_S if polling else STALL_S), ctrl[word]
    while True:
        mark = ctrl[word]
        if mark == plan.total:
            if sources is None:
                model.layout.unpack(slot.buffers, dest)
            else:
                plan.copy_out(sources, targets, index, mark)
            _sync(slot)
            return True, False
        if mark == _PACK_FAILED or ctrl[_HEADER_WORDS + worker_idx] != packed:
            return False, index > 0  # the pack failed: the sender put the targets back
        if sources is None and deadline.expired():
            return False, False  # a short pack: the next call takes the whole version
        now = time.monotonic()
        if mark != last_mark:
            last_mark, last_move = mark, now
        # once a poll follows a moving pack, a pause of the trainer's (a busy core) is not
        # a stall: giving up would cost a restore, and a second copy at the next poll
        elif now - last_move > (stall_s if index == 0 else STALL_S):
            model.stalled = (packed, mark)  # not followed again until it moves
            return False, index > 0
        copied = index
        if sources is not None and (not polling or mark != first_mark):
            index = plan.copy_out(sources, targets, index, mark)
        if index == copied:
            time.sleep(_NAP_S)  # caught up: let the trainer pack the next piece


def _restore_previous(model: _ReceiverModel, worker_idx: int,
                      dest: Mapping[str, torch.Tensor], why: str) -> int:
    """Copy the previous newest version (whole, and left alone by the sender while it
    packs the next one) over a model that took part of a version; returns its number."""
    previous = model.ctrl[_IDX_PREVIOUS]
    if previous >= 0:
        version, index = _unpack_target(previous)
        slot = model.slots.get(index)
        if slot is not None and _lock(model.control.fd, index, exclusive=False):
            try:
                if (model.ctrl[_IDX_PREVIOUS] == previous
                        and model.ctrl[_PACKED_BASE + index] == model.plan.total):
                    model.layout.unpack(slot.buffers, dest)
                    _sync(slot)
                    model.ack[_ACK_APPLIED] = version
                    return version
            finally:
                _unlock(model.control.fd, index)
    raise WeightSyncError(
        f"worker {worker_idx}: {why}, and no whole version was left to restore: the model's "
        "weights are partly overwritten; reconnect this worker to take a whole version"
    )


def copy_newest(model: _ReceiverModel, worker_idx: int, dest: Mapping[str, torch.Tensor],
                held_version: int, deadline: Deadline, wait_for_slot: WaitForSlot) -> int | None:
    """Copy the newest version into ``dest`` (following its pack if it is still running);
    returns it, or None (``dest`` untouched) if there is nothing newer to take now."""
    dirty = False  # dest holds part of a version that was given up

    def restored(why: str) -> int | None:
        # a whole version back in ``dest``: news only if it is not the one held already
        version = _restore_previous(model, worker_idx, dest, why)
        return None if version == held_version else version

    while True:
        found = newest_target(model, worker_idx, NO_VERSION if dirty else held_version,
                              deadline, wait_for_slot)
        if found is None:
            return restored("no version to finish with") if dirty else None
        packed, version, slot = found
        if model.stalled is not None:
            if model.stalled == (packed, model.ctrl[_PACKED_BASE + slot.index]):
                # given up before and not moved since: copying it again would only stall again
                return restored(f"the pack of version {version} stalled") if dirty else None
            model.stalled = None
        if not _lock(model.control.fd, slot.index, exclusive=False):
            continue  # the sender holds it for a moment while it publishes there
        try:
            if model.ctrl[_HEADER_WORDS + worker_idx] != packed:
                continue
            whole, touched = _follow(model, worker_idx, packed, slot, dest, deadline)
        finally:
            _unlock(model.control.fd, slot.index)
        if whole:
            model.ack[_ACK_APPLIED] = version
            return version
        dirty = dirty or touched
        if model.ctrl[_HEADER_WORDS + worker_idx] == packed:  # stalled (or short), not failed
            if dirty:
                return restored(f"the trainer stopped packing version {version}")
            return None


def adopt_newest(model: _ReceiverModel, worker_idx: int, dest: Mapping[str, torch.Tensor],
                 held_version: int, deadline: Deadline, wait_for_slot: WaitForSlot) -> int | None:
    """Point ``dest``'s tensors at views into the newest slot, once it is completely packed.

    The worker then holds that slot's shared lock until its next adopt (or close), so the
    sender never rewrites memory the model reads; the slot it held before is let go. On the
    CPU the views live in a read-only mapping: a stray write into the model's weights is a
    crash (SIGSEGV), never a change seen by other workers. A slot still being packed is
    waited for until ``deadline`` (``Deadline(0)``: not at all, the old version stays)."""
    while True:
        found = newest_target(model, worker_idx, held_version, deadline, wait_for_slot)
        if found is None:
            return None
        packed, version, slot = found
        index = slot.index
        if index != model.held_slot and not _lock(model.control.fd, index, exclusive=False):
            continue
        whole = model.ctrl[_PACKED_BASE + index] == model.plan.total
        if model.ctrl[_HEADER_WORDS + worker_idx] != packed or not whole:
            if index != model.held_slot:
                _unlock(model.control.fd, index)
            if not whole and model.ctrl[_HEADER_WORDS + worker_idx] == packed:
                if deadline.expired():
                    return None
                time.sleep(_NAP_S)
            continue
        views, ties = model.tensors_of(slot), model.layout.ties
        pairs = [(name, tensor, views[ties.get(name, name)]) for name, tensor in dest.items()]
        for name, tensor, view in pairs:  # the model changed (``model.half()``): refuse it
            if tensor.dtype != view.dtype or tensor.shape != view.shape:
                if index != model.held_slot:
                    _unlock(model.control.fd, index)
                raise SchemaMismatchError(
                    f"key {name!r}: the trainer sends shape {tuple(view.shape)} dtype {view.dtype}, "
                    f"the worker's model now has shape {tuple(tensor.shape)} dtype {tensor.dtype} "
                    "(a zero-copy model must not be cast or reshaped)",
                    key=name, expected=(tuple(view.shape), view.dtype),
                    got=(tuple(tensor.shape), tensor.dtype))
        with _fork_guard:  # a fork sees the tensors and ``held_slot`` agree
            if model.held_slot is not None and model.held_slot != index:
                model.wait_for_forked_children()  # they lock it before it is let go
            for _name, tensor, view in pairs:
                tensor.data = view
            if model.held_slot is not None and model.held_slot != index:
                _unlock(model.control.fd, model.held_slot)
            model.held_slot, model.viewer = index, worker_idx
            model.ack[_ACK_VIEWING] = index  # the sender counts it pinned
            model.adopted = list(dest.values())
            _viewing.add(model)
        model.ack[_ACK_APPLIED] = version
        return version


# ---------------------------------------------------------------- fork of a zero-copy worker
_viewing: weakref.WeakSet[_ReceiverModel] = weakref.WeakSet()  # models that adopted a slot
_fork_guard = threading.Lock()  # held across a fork and around each re-pointing


def _before_fork() -> None:
    """A pipe per model that views a slot: its write end goes to the child, which closes
    it once it holds its own lock (the parent keeps the slot until then)."""
    _fork_guard.acquire()
    for model in list(_viewing):
        if model.held_slot is not None:
            try:
                read_end, model.fork_write_end = os.pipe()
            except OSError:
                logger.exception("no pipe for a fork of a zero-copy worker")
                continue
            model.fork_pipes.append(read_end)


def _after_fork_in_parent() -> None:
    try:
        for model in list(_viewing):
            if model.fork_write_end is not None:
                os.close(model.fork_write_end)  # EOF once the child closes its copy too
                model.fork_write_end = None
    finally:
        _fork_guard.release()


def _after_fork_in_child() -> None:
    """Turn the views of a slot the parent holds into private copies (the same tensor
    objects get their own storage), under this process's own lock on the slot. Never
    raises: a failure here is logged (the child's weights may then change under it)."""
    try:
        for model in list(_viewing):
            try:
                _copy_views_in_child(model)
            except Exception:
                logger.exception("a forked child could not copy the zero-copy weights it "
                                 "inherited: they may change under it")
        _viewing.clear()
    finally:
        _fork_guard.release()


def _copy_views_in_child(model: _ReceiverModel) -> None:
    index = model.held_slot
    if index is None:
        return
    write_end, model.fork_write_end = model.fork_write_end, None
    locked = _lock(model.control.fd, index, exclusive=False)
    if write_end is not None:
        os.close(write_end)  # the parent may let the slot go now: we hold it ourselves
    try:
        for tensor in model.adopted:
            if tensor.device.type == "cpu":  # CUDA cannot be used in a forked child
                tensor.data = _private_copy(tensor.data)
    finally:
        if locked:
            _unlock(model.control.fd, index)
        for read_end in model.fork_pipes:  # the parent's, for its other children
            os.close(read_end)
        model.fork_pipes.clear()
        model.held_slot = None
        model.adopted = []


def _private_copy(view: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU view in this process's own memory; a plain ``memmove`` for a
    contiguous one (no thread pool: OpenMP may hang in a forked child)."""
    if not view.is_contiguous():
        return view.clone()
    copy = torch.empty_like(view)
    ctypes.memmove(copy.data_ptr(), view.data_ptr(), view.numel() * view.element_size())
    return copy


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
