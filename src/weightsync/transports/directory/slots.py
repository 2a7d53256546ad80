"""Slot files of the directory transport: preallocated safetensors files, memory-mapped.

A slot is a valid safetensors file (``safetensors.safe_open`` reads it): an 8-byte header
length, a JSON header (parsed as untrusted input, never unpickled), then the tensors back to
back. Each bucket has a checksum (``core.checksum``), computed while writing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.core.checksum import combine, copy_shares, shares
from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout, TensorSpec
from weightsync.transports.directory.files import create_temp, open_regular

logger = logging.getLogger(__name__)

#: torch dtype <-> safetensors dtype code
_ST_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_ST_DTYPES = {code: dtype for dtype, code in _ST_CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024
_CUDA_HOST_REGISTER_PORTABLE = 0x01  # pinned for every CUDA context, not just the current one
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # a receiver maps its slots read-only


#: the ``__metadata__`` entry naming the tied names (alias -> stored name), as JSON
TIES_KEY = "weightsync.ties"


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
    for alias in cast.ties:
        check_weight_name(alias)
    ordered = sorted(cast.specs, key=lambda s: (-s.dtype.itemsize, str(s.dtype)))
    return Layout(ordered, alignment=1, ties=cast.ties)


def _header_bytes(layout: Layout, metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    if layout.ties:  # a tied tensor is stored once; safetensors metadata holds only strings
        header["__metadata__"][TIES_KEY] = json.dumps(layout.ties, sort_keys=True)
    for name, (start, end) in layout.offsets().items():
        spec = layout[name]
        header[name] = {
            "dtype": _ST_CODES[spec.dtype], "shape": list(spec.shape), "data_offsets": [start, end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw)) % 8)  # data starts 8-byte aligned
    return raw


def _spec_of(name: str, entry: Any) -> tuple[TensorSpec, int, int]:
    """One header entry as (spec, start, end); ValueError/TypeError if it is malformed."""
    if not isinstance(entry, dict):
        raise TypeError(f"entry {name!r} is a {type(entry).__name__}, not an object")
    check_weight_name(name)
    dtype = _ST_DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise ValueError(f"entry {name!r}: unknown dtype {entry.get('dtype')!r}")
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)):
        raise ValueError(f"entry {name!r}: data_offsets must be [start, end] and shape a list")
    if not all(type(x) is int and x >= 0 for x in (*offsets, *shape)):
        raise ValueError(f"entry {name!r}: offsets and shape must be non-negative ints")
    return TensorSpec(name, tuple(shape), dtype), offsets[0], offsets[1]


def parse_header(raw: bytes, file_size: int, source: str = "slot file") -> tuple[Layout, dict[str, str], int]:
    """Validate a safetensors header (JSON only) and return (layout, metadata, data start);
    :class:`IntegrityError` naming ``source`` for anything malformed."""
    if len(raw) < 8:
        raise IntegrityError(f"{source} is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER or 8 + n > file_size or len(raw) < 8 + n:
        raise IntegrityError(f"{source}: a header of {n} bytes does not fit a file of {file_size}")
    try:
        header = json.loads(raw[8 : 8 + n])
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise IntegrityError(f"{source}: the safetensors header is not valid JSON ({reason})") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{source}: the safetensors header is a JSON {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise IntegrityError(f"{source}: __metadata__ is not an object")
    try:
        entries = sorted((_spec_of(name, entry) for name, entry in header.items()),
                         key=lambda item: item[1])
    except (TypeError, ValueError) as exc:
        raise IntegrityError(f"{source}: bad safetensors header: {exc}") from None
    cursor = 0
    for spec, start, end in entries:
        if start != cursor or end - start != spec.nbytes:
            raise IntegrityError(f"{source}: entry {spec.name!r} has inconsistent offsets {start}..{end}")
        cursor = end
    if 8 + n + cursor > file_size:
        raise IntegrityError(
            f"{source} is truncated: {file_size} bytes, its header describes {8 + n + cursor}"
        )
    try:
        ties = json.loads(metadata[TIES_KEY]) if TIES_KEY in metadata else {}
        for alias in ties if isinstance(ties, dict) else ():
            check_weight_name(str(alias))
        layout = Layout([spec for spec, _, _ in entries], alignment=1, ties=ties)
    except ValueError as exc:
        raise IntegrityError(f"{source}: bad {TIES_KEY} metadata: {exc}") from None
    return layout, {str(k): str(v) for k, v in metadata.items()}, 8 + n


def bucket_checksums(layout: Layout, data: torch.Tensor) -> list[int]:
    """One checksum per bucket (:func:`weightsync.core.checksum.checksum`: it sees where each
    4-byte lane is, so swapped pages, rows or words are caught, not only flipped bytes); it
    guards against corruption and misplaced writes, not against an attacker. All buckets
    are summed in one go, their bytes cut into one stretch per thread."""
    return shares([(data[bucket.byte_offset : bucket.byte_offset + bucket.nbytes], 0)
                   for bucket in layout.buckets])


@torch.no_grad()
def pack_with_checksums(
    layout: Layout, weights: Mapping[str, torch.Tensor], data: torch.Tensor
) -> list[int]:
    """Copy ``weights`` into ``data`` (casting where the layout says) and return the same
    checksums as :func:`bucket_checksums`, summing each lane as it is copied
    (:func:`weightsync.core.checksum.copy_shares`: the checksum is linear, the tensors'
    shares add up to their bucket's)."""
    views = layout.tensor_views({"cpu": data})
    pieces, owners = [], []
    for index, bucket in enumerate(layout.buckets):
        for name in bucket.names:
            target = views[name].reshape(-1)
            position = int(target.storage_offset()) * target.element_size() - int(data.storage_offset())
            pieces.append((weights[name].detach().reshape(-1), target, position - bucket.byte_offset))
            owners.append(index)
    sums = [0] * len(layout.buckets)
    for index, value in zip(owners, copy_shares(pieces), strict=True):
        sums[index] += value
    return [combine([total]) for total in sums]


def reserve(fd: int, size: int, path: Path) -> None:
    """Allocate the file's blocks now: a write through the mapping of a sparse file on a
    full file system kills the process (SIGBUS), an OSError here names the directory."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
            return
        raise OSError(exc.errno, f"cannot reserve {size} bytes for {path.name} in "
                      f"{path.parent}: {exc.strerror}; the last committed version stays") from None


class SlotFile:
    """One slot: a safetensors file mapped in memory, with its ``fcntl`` lock."""

    def __init__(self, path: Path, fd: int, layout: Layout, data_start: int, writable: bool,
                 metadata: Mapping[str, str] | None = None):
        self.path = path
        self.fd = fd
        self.layout = layout
        #: the header's ``__metadata__`` (strings only; what a writer put beside the tensors)
        self.metadata: dict[str, str] = dict(metadata or {})
        info = os.fstat(fd)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, info.st_size, flags, prot)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only maps are fine for readers
            self._whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.data = self._whole[data_start : data_start + layout.nbytes]
        self.inode = info.st_ino
        self.writable = writable
        self._cuda_registered = False

    @classmethod
    def create(cls, path: Path, layout: Layout, metadata: Mapping[str, str], mode: int) -> SlotFile:
        """A new slot of ``layout`` at ``path`` (written beside it, then renamed into place)."""
        header = _header_bytes(layout, metadata)
        tmp, fd = create_temp(path.parent, path.name, mode)
        try:
            os.write(fd, struct.pack("<Q", len(header)) + header)
            os.ftruncate(fd, 8 + len(header) + layout.nbytes)
            reserve(fd, 8 + len(header) + layout.nbytes, path)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(path, fd, layout, 8 + len(header), writable=True, metadata=metadata)

    @classmethod
    def open(cls, path: Path, *, writable: bool = False) -> SlotFile:
        """Map an existing slot, validating its header; refuses symlinks and non-regular files."""
        fd = open_regular(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            raw = head + os.pread(fd, min(n, max(0, size - 8), _MAX_HEADER), 8)
            layout, metadata, start = parse_header(raw, size, str(path))
            if writable:  # a slot file left sparse (truncated, copied) is filled in first
                reserve(fd, size, path)
            return cls(path, fd, layout, start, writable, metadata=metadata)
        except BaseException:
            os.close(fd)
            raise

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {"cpu": self.data}

    @property
    def file_bytes(self) -> torch.Tensor:
        """The whole file as mapped (header and data): a valid safetensors file's bytes."""
        return self._whole

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

    def register_with_cuda(self) -> bool:
        """Page-lock the mapping for CUDA (``cudaHostRegister``), so copies between it and a
        GPU run at the pinned rate; False (and a debug log) where CUDA cannot do it."""
        if self._cuda_registered or self._map is None or not torch.cuda.is_available():
            return self._cuda_registered
        if self._whole.numel() == 0:
            return False
        flags = _CUDA_HOST_REGISTER_PORTABLE | (0 if self.writable else _CUDA_HOST_REGISTER_READ_ONLY)
        err = torch.cuda.cudart().cudaHostRegister(self._whole.data_ptr(), self._whole.numel(), flags)
        self._cuda_registered = int(err) == 0
        if not self._cuda_registered:
            logger.debug("cudaHostRegister(%s) failed with %s: copies stay pageable", self.path, err)
        return self._cuda_registered

    @property
    def cuda_registered(self) -> bool:
        return self._cuda_registered

    def close(self) -> None:
        """Unregister from CUDA, unmap and close (views handed out must be dropped first)."""
        if self._cuda_registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._whole.data_ptr())
            self._cuda_registered = False
        self.data = self._whole = torch.empty(0, dtype=torch.uint8)
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


def current_slot(slots: dict[int, SlotFile], path: Path, index: int, *, writable: bool,
                 named_by: str) -> tuple[SlotFile, bool]:
    """Slot ``index`` at ``path`` from ``slots``, (re)opened if the file was replaced since
    (a new inode); returns it and whether it was opened now. ``named_by``: what named the
    path, for the error when it is gone."""
    slot = slots.get(index)
    try:
        inode = os.lstat(path).st_ino
    except FileNotFoundError as exc:
        raise IntegrityError(f"{named_by} names {path}, which does not exist") from exc
    if slot is not None and slot.inode == inode:
        return slot, False
    if slot is not None:
        slot.close()
        del slots[index]
    slot = slots[index] = SlotFile.open(path, writable=writable)
    return slot, True
