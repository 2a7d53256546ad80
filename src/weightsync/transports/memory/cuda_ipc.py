"""CUDA IPC handles of flat uint8 buffers as plain typed fields, never pickled.

A CUDA buffer is shared with a process of the same host by its IPC handle. torch's own
multiprocessing pickles that handle with the classes to rebuild it; here the handle
crosses as bytes and ints in a JSON header, checked field by field, and the receiver
rebuilds the buffer with classes it chooses itself, so a peer can never make it run code.
"""

from __future__ import annotations

import base64
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: torch's refcounted shared-memory files start with a 64-byte header; the counters follow
_REFCOUNTED_HEADER = 64

# field name -> type, in the order torch's rebuild takes them after (cls, size, stride, ...)
_FIELDS: dict[str, type] = {
    "nbytes": int,
    "offset": int,
    "device": int,
    "handle": bytes,
    "storage_size_bytes": int,
    "storage_offset_bytes": int,
    "ref_counter_handle": bytes,
    "ref_counter_offset": int,
    "event_handle": bytes,
    "event_sync_required": bool,
}


def handle_fields(args: tuple[Any, ...]) -> dict[str, Any]:
    """The JSON-safe fields of torch's reduction args for a flat uint8 CUDA buffer."""
    (_cls, size, _stride, offset, _storage_cls, dtype, device, handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = args
    if dtype != torch.uint8 or len(size) != 1:
        raise ValueError("only flat uint8 buffers are shared over CUDA IPC")
    raw = {
        "nbytes": int(size[0]), "offset": int(offset), "device": int(device),
        "handle": bytes(handle), "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle or b""),
        "event_sync_required": bool(event_sync_required),
    }
    return {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in raw.items()}


def checked_fields(fields: Any) -> dict[str, Any]:
    """Decode and type-check fields received from a peer; ValueError on anything else."""
    if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
        raise ValueError("a CUDA IPC handle must have exactly the fields " + ", ".join(_FIELDS))
    out: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        value = fields[name]
        if kind is bytes:
            if not isinstance(value, str) or len(value) > 4096:
                raise ValueError(f"CUDA IPC handle field {name!r} must be a short base64 string")
            out[name] = base64.b64decode(value, validate=True)
        elif kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"CUDA IPC handle field {name!r} must be a bool")
            out[name] = value
        else:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CUDA IPC handle field {name!r} must be an int >= 0")
            out[name] = value
    return out


def share_cuda_buffer(buffer: torch.Tensor) -> dict[str, Any]:
    """The IPC handle of a flat uint8 CUDA buffer, as JSON-safe fields."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(buffer)
    return handle_fields(args)


def open_cuda_buffer(fields: Any) -> torch.Tensor:
    """Map a buffer shared by :func:`share_cuda_buffer` in another process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    f = checked_fields(fields)
    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, torch.Size([f["nbytes"]]), (1,), f["offset"], torch.storage.TypedStorage,
        torch.uint8, f["device"], f["handle"], f["storage_size_bytes"],
        f["storage_offset_bytes"], False, f["ref_counter_handle"], f["ref_counter_offset"],
        f["event_handle"] or None, f["event_sync_required"],
    )


@dataclass(frozen=True)
class ConsumerCount:
    """Where torch counts the processes that opened one shared CUDA buffer: the int64 at
    ``index`` of the shared-memory file ``handle``. A consumer adds one when it opens the
    buffer and takes it back when it releases it; the producer frees the memory (at
    ``torch.cuda.ipc_collect()``) only once the count is back to zero. A consumer killed
    with the buffer open never takes its one back, which pins the memory until the
    producer exits, unless the producer takes it back for it."""

    handle: bytes
    index: int

    @classmethod
    def of(cls, fields: dict[str, Any]) -> ConsumerCount:
        f = checked_fields(fields)
        return cls(f["ref_counter_handle"], f["ref_counter_offset"])

    def path(self) -> str:
        name = self.handle.decode("ascii", errors="strict")
        if "/" in name.lstrip("/") or not name.strip("/"):
            raise ValueError(f"not a shared-memory file name: {name!r}")
        return "/dev/shm/" + name.lstrip("/")


def counts_to_take_back(opened: dict[int, set[ConsumerCount]], dead: set[int]) -> list[ConsumerCount]:
    """The counts that dead workers left on buffers they opened: one per (worker, buffer).
    Workers that closed cleanly released theirs (and cleared their record first), so only
    ``dead`` ones are taken back; a buffer opened by two dead workers is taken back twice."""
    return [count for worker in sorted(dead) for count in sorted(
        opened.get(worker, set()), key=lambda c: (c.handle, c.index))]


def take_back(counts: list[ConsumerCount]) -> int:
    """Take back one consumer count per entry (never below zero); returns how many were
    taken. Call ``torch.cuda.ipc_collect()`` afterwards to free what nobody holds now."""
    taken = 0
    for count in counts:
        try:
            fd = os.open(count.path(), os.O_RDWR | os.O_NOFOLLOW)
        except (OSError, ValueError) as exc:  # the producer already freed its counters
            logger.debug("consumer count %s not taken back: %s", count, exc)
            continue
        try:
            where = _REFCOUNTED_HEADER + 8 * count.index
            if os.fstat(fd).st_size < where + 8:
                continue
            with mmap.mmap(fd, where + 8) as view:
                (value,) = struct.unpack_from("<q", view, where)
                if value > 0:
                    struct.pack_into("<q", view, where, value - 1)
                    taken += 1
        finally:
            os.close(fd)
    return taken
