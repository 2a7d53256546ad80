"""Weights in a directory: preallocated safetensors slots, an atomic manifest, ack files.

Any process that sees the directory (a vLLM worker, a process on another host over a
shared file system) can read the newest committed version. Layout on disk::

    slot-0.safetensors, slot-1.safetensors[, ...]   raw tensor bytes behind a JSON header
    manifest.json                                   the committed state, replaced atomically
    ack-<worker>.json                               the version each worker holds
    sender.lock                                     locked by the live sender

A slot is written only when no manifest entry names it and no reader holds its shared
``fcntl`` lock; the manifest is then replaced by rename, so a crash at any point leaves the
last complete version committed. Nothing on disk is ever unpickled.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import socket
import struct
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout, TensorSpec

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SENDER_LOCK = "sender.lock"
FORMAT = "weightsync-double-buffer/1"

#: torch dtype <-> safetensors dtype code
_ST_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_ST_DTYPES = {code: dtype for dtype, code in _ST_CODES.items()}


def slot_path(directory: Path, index: int) -> Path:
    return directory / f"slot-{index}.safetensors"


def ack_path(directory: Path, worker_idx: int) -> Path:
    return directory / f"ack-{worker_idx}.json"


def check_weight_name(name: str) -> None:
    """Refuse names that could be taken for a path outside the directory."""
    parts = name.replace("\\", "/").split("/")
    if (
        not name or "\x00" in name or name.startswith(("/", "\\")) or ".." in parts
        or (len(name) > 1 and name[1] == ":")
    ):
        raise ValueError(
            f"weight name {name!r} is refused: names may not be absolute paths or contain '..'"
        )


def file_layout(layout: Layout, dtype: torch.dtype | None = None) -> Layout:
    """The on-disk layout: CPU, optionally cast, ordered by descending item size so the
    tensors sit back to back (safetensors allows no holes) and each stays aligned."""
    for spec in layout.specs:
        check_weight_name(spec.name)
    cast = layout.with_dtype(dtype).on_device("cpu")
    for spec in cast.specs:
        if spec.dtype not in _ST_CODES:
            raise ValueError(f"weight {spec.name!r}: dtype {spec.dtype} has no safetensors code")
    ordered = sorted(cast.specs, key=lambda s: (-s.dtype.itemsize, str(s.dtype)))
    return Layout(ordered, alignment=1)


def _header_bytes(layout: Layout, metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for name, (start, end) in layout.offsets().items():
        spec = layout[name]
        header[name] = {
            "dtype": _ST_CODES[spec.dtype], "shape": list(spec.shape), "data_offsets": [start, end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw)) % 8)  # data starts 8-byte aligned
    return raw


def parse_header(raw: bytes, file_size: int) -> tuple[Layout, dict[str, str], int]:
    """Validate a safetensors header (JSON only) and return (layout, metadata, data start)."""
    if len(raw) < 8:
        raise IntegrityError("slot file is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > 100 * 1024 * 1024 or 8 + n > file_size:
        raise IntegrityError(f"slot header of {n} bytes does not fit a file of {file_size}")
    try:
        header = json.loads(raw[8 : 8 + n])
    except ValueError as exc:
        raise IntegrityError(f"slot header is not valid JSON: {exc}") from exc
    metadata = header.pop("__metadata__", {}) or {}
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    specs, cursor = [], 0
    for name, entry in entries:
        check_weight_name(name)
        dtype = _ST_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise IntegrityError(f"slot entry {name!r}: unknown dtype {entry.get('dtype')!r}")
        start, end = (int(x) for x in entry["data_offsets"])
        spec = TensorSpec(name, tuple(int(d) for d in entry["shape"]), dtype)
        if start != cursor or end - start != spec.nbytes:
            raise IntegrityError(f"slot entry {name!r}: offsets {start}..{end} are inconsistent")
        cursor = end
        specs.append(spec)
    if 8 + n + cursor > file_size:
        raise IntegrityError(
            f"slot file is truncated: {file_size} bytes, its header describes {8 + n + cursor}"
        )
    return Layout(specs, alignment=1), {str(k): str(v) for k, v in metadata.items()}, 8 + n


def bucket_checksums(layout: Layout, data: torch.Tensor) -> list[int]:
    """One checksum per bucket: the wrapping sum of its 64-bit words (and tail bytes).

    Catches flipped bytes and truncation at the cost of one read of the data; it guards
    against corruption, not against an attacker."""
    sums = []
    for bucket in layout.buckets:
        raw = data[bucket.byte_offset : bucket.byte_offset + bucket.nbytes]
        words = raw.numel() // 8 * 8
        sums.append((_word_sum(raw[:words]) + _tail_sum(raw[words:])) & 0xFFFFFFFFFFFFFFFF)
    return sums


_PIECE_BYTES = 4 << 20  # small enough that a piece is still in cache when it is summed


def _word_sum(raw: torch.Tensor) -> int:
    """Wrapping sum of the int64 words of ``raw`` (a uint8 tensor, length a multiple of 8)."""
    return int(raw.view(torch.int64).sum()) if raw.numel() else 0


def _tail_sum(tail: torch.Tensor) -> int:
    if not tail.numel():
        return 0
    weights = torch.arange(1, tail.numel() + 1, dtype=torch.int64)
    return int((tail.to(torch.int64) * weights).sum())


@torch.no_grad()
def pack_with_checksums(
    layout: Layout, weights: Mapping[str, torch.Tensor], data: torch.Tensor
) -> list[int]:
    """Copy ``weights`` into ``data`` (casting where the layout says) and return the same
    checksums as :func:`bucket_checksums`, summing each piece right after writing it."""
    views = layout.tensor_views({"cpu": data})
    sums = []
    for bucket in layout.buckets:
        raw = data[bucket.byte_offset : bucket.byte_offset + bucket.nbytes]
        total, summed, written = 0, 0, 0
        for name in bucket.names:
            src = weights[name].detach().reshape(-1)
            dst = views[name].reshape(-1)
            step = max(1, _PIECE_BYTES // dst.element_size())
            for start in range(0, dst.numel(), step):
                piece = dst[start : start + step]
                piece.copy_(src[start : start + step])
                written += piece.numel() * piece.element_size()
                aligned = written - written % 8
                if aligned - summed >= _PIECE_BYTES:
                    total += _word_sum(raw[summed:aligned])
                    summed = aligned
        aligned = written - written % 8
        total += _word_sum(raw[summed:aligned]) + _tail_sum(raw[aligned:written])
        sums.append(total & 0xFFFFFFFFFFFFFFFF)
    return sums


class SlotFile:
    """One slot: a safetensors file mapped in memory, with its lock."""

    def __init__(self, path: Path, fd: int, layout: Layout, data_start: int, writable: bool):
        self.path = path
        self.fd = fd
        self.layout = layout
        size = os.fstat(fd).st_size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, size, flags, prot)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only maps are fine for readers
            whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.data = whole[data_start : data_start + layout.nbytes]
        self.inode = os.fstat(fd).st_ino

    @classmethod
    def create(cls, path: Path, layout: Layout, metadata: Mapping[str, str]) -> SlotFile:
        header = _header_bytes(layout, metadata)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, struct.pack("<Q", len(header)) + header)
            os.ftruncate(fd, 8 + len(header) + layout.nbytes)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(path, fd, layout, 8 + len(header), writable=True)

    @classmethod
    def open(cls, path: Path, *, writable: bool = False) -> SlotFile:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            raw = head + os.pread(fd, min(n, max(0, size - 8)), 8)
            layout, _meta, start = parse_header(raw, size)
            return cls(path, fd, layout, start, writable)
        except BaseException:
            os.close(fd)
            raise

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {"cpu": self.data}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` pairs, in file order, viewing the mapped bytes (no copy)."""
        yield from self.layout.tensor_views(self.buffers).items()

    def try_lock(self, exclusive: bool) -> bool:
        try:
            fcntl.lockf(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return True
        except OSError:
            return False

    def unlock(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def flush(self) -> None:
        if self._map is not None:
            self._map.flush()

    def close(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        with contextlib.suppress(OSError):
            os.close(self.fd)


def close_slots(slots: dict[int, SlotFile]) -> None:
    """Unmap and close every slot of ``slots`` and forget them."""
    for slot in slots.values():
        slot.close()
    slots.clear()


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Write a temp file, fsync it, rename it over ``path``, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    data = json.dumps(obj, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``; None if absent; IntegrityError if unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{path.name} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise IntegrityError(f"{path.name} does not hold a JSON object")
    return obj


def remove_stale_temp_files(directory: Path) -> int:
    """Delete temp files a killed writer left behind; returns how many."""
    removed = 0
    for path in directory.glob(".*.tmp-*"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed


class SenderLock:
    """An exclusive lock on ``sender.lock`` held for a sender's lifetime: one sender per
    directory, and receivers can tell whether a live sender exists."""

    _held_here: set[Path] = set()  # POSIX locks do not conflict within one process

    def __init__(self, directory: Path) -> None:
        self.path = (directory / SENDER_LOCK).resolve()
        if self.path in SenderLock._held_here:
            raise RuntimeError(f"another sender is writing to {directory} (in this process)")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self.fd)
            raise RuntimeError(
                f"another sender is writing to {directory} (it holds {SENDER_LOCK})"
            ) from exc
        os.ftruncate(self.fd, 0)
        os.write(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        SenderLock._held_here.add(self.path)

    def release(self) -> None:
        SenderLock._held_here.discard(self.path)
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def sender_alive(directory: Path) -> bool:
    """True if some process holds the sender lock of ``directory``."""
    try:
        fd = os.open(directory / SENDER_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        with contextlib.suppress(ValueError, AttributeError):
            if json.loads(os.read(fd, 256) or b"{}").get("pid") == os.getpid():
                return True  # our own lock: POSIX locks never conflict within a process
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def check_layout_matches(sent: Layout, local: Mapping[str, torch.Tensor], who: str) -> None:
    """Names and shapes must match; dtypes may differ (the copy casts, e.g. bf16 slots)."""
    sent.check_compatible(
        Layout.from_weights(local), self_name="the slot", other_name=who, ignore_dtype=True
    )
