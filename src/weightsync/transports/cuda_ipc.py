"""CUDA IPC handles of flat uint8 buffers as plain typed fields, never pickled.

A CUDA buffer is shared with a process of the same host by its IPC handle. torch's own
multiprocessing pickles that handle with the classes to rebuild it; here the handle
crosses as bytes and ints in a JSON header, checked field by field, and the receiver
rebuilds the buffer with classes it chooses itself, so a peer can never make it run code.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

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
