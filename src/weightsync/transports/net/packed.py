"""A version as it crosses the network: one contiguous byte buffer holding every tensor
(cast to the wire dtype) at 64-byte aligned offsets, its typed layout (name, dtype, shape,
offset: JSON, nothing pickled), the checksum of each ``CHUNK_BYTES`` chunk, and string
metadata (a LoRA adapter's name and config, as a directory slot's header carries them)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from blake3 import blake3

from weightsync.transports.net.wire import CHUNK_BYTES, ProtocolError, chunk_checksum, tensor_view

ALIGN = 64
#: the dtypes a version may hold, by the names that travel (never evaluated)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPES[self.dtype].itemsize


@dataclass
class PackedVersion:
    """One version: ``buffer`` (uint8) holds every entry; ``checksums`` one per chunk.
    A version being filled (``fill``) is streamed as it fills: ``wait_chunk(i)`` returns
    once chunk ``i`` is packed and checksummed."""

    version: int
    entries: list[Entry]
    buffer: torch.Tensor
    checksums: list[int] = field(default_factory=list)
    #: a sharded trainer rank's part: ``name -> [start, stop, ...]`` of the global tensor
    #: each entry is (empty: every entry is a whole tensor)
    regions: dict[str, list[int]] = field(default_factory=dict)
    #: with ``regions``: each entry's global shape, so a host knows what the parts must cover
    shapes: dict[str, list[int]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    _ready: int = -1  # chunks [0, _ready) are packed; -1: all of them
    _failed: str | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _digests: list[str] | None = field(default=None, repr=False)
    _digest_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait_chunk(self, index: int, timeout: float) -> None:
        """Block until chunk ``index`` is packed; ``TimeoutError`` or ``RuntimeError`` (the
        pack failed) otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready < 0 or self._ready > index
                                       or self._failed is not None, timeout):
                raise TimeoutError(f"chunk {index} of version {self.version} not packed in "
                                   f"{timeout:g}s")
            if self._failed is not None:
                raise RuntimeError(f"packing version {self.version} failed: {self._failed}")

    def fill(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Copy every entry's source in (cast to the entry's dtype), checksumming and
        releasing each chunk as soon as it is complete."""
        count = chunk_count(self.nbytes)
        done = 0
        try:
            for entry in self.entries:
                view = self.buffer[entry.offset:entry.offset + entry.nbytes]
                view.view(DTYPES[entry.dtype]).reshape(entry.shape).copy_(sources[entry.name])
                end = entry.offset + entry.nbytes
                done = self._release(done, min(count, end // CHUNK_BYTES))
            self._release(done, count)
        except BaseException as exc:
            with self._cond:
                self._failed = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()
            raise
        with self._cond:
            self._ready = -1
            self._cond.notify_all()

    def _release(self, done: int, upto: int) -> int:
        for index in range(done, upto):
            self.checksums[index] = chunk_checksum(self.chunk(index))
        if upto > done:
            self.mark_ready(upto)
        return max(done, upto)

    def mark_ready(self, upto: int) -> None:
        """Chunks ``[0, upto)`` are in place, checksummed (a fill, or a host rebuilding a
        version it relays as it arrives); ``chunk_count``: all of them."""
        with self._cond:
            self._ready = -1 if upto >= chunk_count(self.nbytes) else upto
            self._cond.notify_all()

    def mark_failed(self, why: str) -> None:
        """The version will never be complete here: streams waiting for a chunk end."""
        with self._cond:
            self._failed = why
            self._cond.notify_all()

    def chunk_digests(self, timeout: float) -> list[str]:
        """A cryptographic digest of each chunk (the checksums are not: they catch damage,
        not a peer that recomputes them), so that a host can verify chunks a relay forwards
        against what the trainer told it over its own sealed connection. Computed once,
        when a host first asks, after the version is packed (within ``timeout``)."""
        count = chunk_count(self.nbytes)
        if count:
            self.wait_chunk(count - 1, timeout)
        with self._digest_lock:  # not the chunks' condition: streams go on meanwhile
            if self._digests is None:
                chunks = [self.chunk(i) for i in range(count)]
                if len(chunks) < 4:
                    self._digests = [chunk_digest(c) for c in chunks]
                else:  # hashing frees the GIL
                    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
                        self._digests = list(pool.map(chunk_digest, chunks))
            return list(self._digests)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    @property
    def fingerprint(self) -> str:
        """Equal for two versions of one layout: a delta needs its base's layout."""
        return layout_fingerprint(self.entries, self.nbytes)

    def chunk(self, index: int) -> torch.Tensor:
        return self.buffer[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every entry as a tensor viewing ``buffer`` (no copy)."""
        out = {}
        for e in self.entries:
            raw = self.buffer[e.offset:e.offset + e.nbytes]
            out[e.name] = raw.view(DTYPES[e.dtype]).reshape(e.shape)
        return out

    def header(self, session: str) -> dict[str, Any]:
        return {"version": self.version, "session": session, "nbytes": self.nbytes,
                "chunk_bytes": CHUNK_BYTES,
                "entries": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries],
                "regions": self.regions, "shapes": self.shapes, "metadata": self.metadata}


#: the digest a host checks a relayed chunk against, as named on the wire (a trainer and a
#: host that disagree on it refuse each other's digests rather than every chunk)
DIGEST = "blake3-128"


def chunk_digest(chunk: torch.Tensor) -> str:
    """BLAKE3 of a chunk's bytes, 128 bits: every relaying host hashes every byte it
    receives, and BLAKE3 does it at ~4.9 GB/s a core here, against SHA-256's 1.6 (with
    the SHA instructions) and BLAKE2b's 0.7; it frees the GIL while it hashes."""
    return blake3(tensor_view(chunk)).hexdigest(length=16)


def chunk_count(nbytes: int) -> int:
    return (nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES


def layout_fingerprint(entries: list[Entry], nbytes: int) -> str:
    text = json.dumps([[e.name, e.dtype, list(e.shape), e.offset] for e in entries] + [nbytes])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def plan(weights: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None = None,
         buffer: torch.Tensor | None = None,
         metadata: Mapping[str, str] | None = None) -> PackedVersion:
    """An empty version laid out for ``weights`` (floating tensors cast to ``dtype`` when
    given), in ``buffer`` when it has the right size (a retired version's: no page
    faults), carrying ``metadata``; ``fill`` packs it."""
    entries, offset = [], 0
    for name in sorted(weights):
        tensor = weights[name]
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if target not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {target}, which the network path "
                             f"does not carry (it carries {sorted(DTYPES)})")
        entry = Entry(name, _NAMES[target], tuple(tensor.shape), offset)
        entries.append(entry)
        offset += (entry.nbytes + ALIGN - 1) // ALIGN * ALIGN
    if buffer is None or buffer.numel() != offset:
        buffer = torch.empty(offset, dtype=torch.uint8)
    return PackedVersion(version, entries, buffer, [0] * chunk_count(offset),
                         metadata=dict(metadata or {}), _ready=0)


def pack(weights: Mapping[str, torch.Tensor], version: int,
         dtype: torch.dtype | None = None) -> PackedVersion:
    """Copy ``weights`` (floating tensors cast to ``dtype`` when given) into one buffer
    and checksum its chunks, at once."""
    packed = plan(weights, version, dtype)
    packed.fill(weights)
    return packed


def parse_metadata(header: dict[str, Any]) -> dict[str, str]:
    """The version header's metadata (absent: none); ``ProtocolError`` unless it maps
    strings to strings."""
    metadata = header.get("metadata", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ProtocolError("a version header whose metadata is not strings by name")
    return dict(metadata)


def parse_header(header: dict[str, Any], limit: int) -> tuple[int, str, list[Entry], int]:
    """``(version, session, entries, nbytes)`` of a version header, every field
    checked (types, dtypes, bounds): ``ProtocolError`` naming the first bad one."""
    try:
        version, session, nbytes = int(header["version"]), str(header["session"]), int(header["nbytes"])
        if int(header["chunk_bytes"]) != CHUNK_BYTES:
            raise ProtocolError(f"chunks of {header['chunk_bytes']} bytes (expected {CHUNK_BYTES})")
        if not 0 <= nbytes <= limit:
            raise ProtocolError(f"a version of {nbytes} bytes (at most {limit})")
        entries = []
        for name, dtype, shape, offset in header["entries"]:
            if dtype not in DTYPES or not isinstance(name, str):
                raise ProtocolError(f"entry {name!r} has dtype {dtype!r}")
            entry = Entry(name, dtype, tuple(int(s) for s in shape), int(offset))
            if min(entry.shape, default=0) < 0 or entry.offset < 0 or entry.offset % ALIGN \
                    or entry.offset + entry.nbytes > nbytes:
                raise ProtocolError(f"entry {name!r} does not fit the version's {nbytes} bytes")
            entries.append(entry)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"a malformed version header ({type(exc).__name__}: {exc})") from None
    return version, session, entries, nbytes


def parse_regions(header: dict[str, Any], entries: list[Entry]) -> dict[str, list[int]]:
    """The ``regions`` of a version header (a sharded rank's part), each checked against its
    entry (two bounds per dimension, ``stop - start`` its size): ``ProtocolError`` naming
    the first bad one. Empty when the version holds whole tensors."""
    raw = header.get("regions") or {}
    if not isinstance(raw, dict):
        raise ProtocolError("a version header whose regions are not an object")
    shapes = {e.name: e.shape for e in entries}
    regions: dict[str, list[int]] = {}
    for name, bounds in raw.items():
        shape = shapes.get(name)
        if shape is None or not isinstance(bounds, list) or len(bounds) != 2 * len(shape) \
                or not all(type(b) is int and b >= 0 for b in bounds) \
                or any(bounds[2 * d + 1] - bounds[2 * d] != size for d, size in enumerate(shape)):
            raise ProtocolError(f"the region of entry {name!r} ({bounds!r}) does not fit its "
                                f"shape {shape}")
        regions[name] = list(bounds)
    if raw and len(regions) != len(entries):
        raise ProtocolError("a sharded version names a region for some entries only")
    return regions


def parse_shapes(header: dict[str, Any], regions: dict[str, list[int]]) -> dict[str, list[int]]:
    """The global shape of every entry of a sharded part (its ``regions``), each region
    inside its shape: ``ProtocolError`` naming the first that is missing or does not hold.
    Empty when the version holds whole tensors."""
    raw = header.get("shapes") or {}
    if not isinstance(raw, dict):
        raise ProtocolError("a version header whose shapes are not an object")
    shapes: dict[str, list[int]] = {}
    for name, bounds in regions.items():
        shape = raw.get(name)
        if not isinstance(shape, list) or len(shape) * 2 != len(bounds) \
                or not all(type(s) is int and s >= 0 for s in shape) \
                or any(bounds[2 * d + 1] > size for d, size in enumerate(shape)):
            raise ProtocolError(f"entry {name!r}: its global shape {shape!r:.80} is missing or "
                                f"does not hold its region {bounds}")
        shapes[name] = list(shape)
    return shapes
