"""The delta codec of the cross-host paths (Ray, the network path to vLLM servers): one
chunk of a packed version as the difference from the same chunk of the version the
receiving node holds.

A chunk goes as one of three kinds. ``SAME``: no byte changed, nothing crosses. ``DELTA``:
the XOR of the new chunk with the base chunk (zero wherever a word is unchanged, as most
are after one optimizer step at RL learning rates once cast to bf16), compressed with zstd
level 1, which squeezes long zero runs at ~1 GB/s. ``WHOLE``: the chunk itself, when more
than :data:`MAX_CHANGED` of its 32-bit words changed (fp32 after any step, bf16 after a
large one: compressing would cost more time than it saves) or the compressed delta would
not be smaller. The receiver XORs the delta back onto its base;
the result is verified against the sender's checksum of the new chunk (``delta_stream``).
``SPARSE``: where numba is installed, a delta goes first as (gap, XOR) varints of the
changed 16-bit words (``delta.sparse``): ~zstd's size at several times its speed; zstd
stays the sender's choice without numba or when too many words changed for that format.

Every payload is smaller than its chunk (a whole chunk is the chunk), so a receiver checks
each header against its chunk before it allocates anything (:func:`header_problem`), and
a payload that does not decode to exactly one chunk is :class:`MalformedDeltaError` (an
``IntegrityError``), never another exception.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from weightsync.transports.delta import sparse as delta_sparse
from weightsync.transports.delta.errors import MalformedDeltaError

#: chunk kinds, as they travel in each chunk's header
WHOLE, DELTA, SAME, SPARSE = 0, 1, 2, 3
KIND_NAMES = {WHOLE: "whole", DELTA: "delta", SAME: "same", SPARSE: "sparse"}
#: the sparse format is tried while it stays under this fraction of the chunk (beyond it,
#: ~12% of words changed, zstd packs the XOR tighter)
SPARSE_MAX_RATIO = 0.25
#: above this fraction of changed 32-bit words a chunk goes whole without compressing
MAX_CHANGED = 0.5
#: one 32-bit word in this many is compared first: a chunk clearly over MAX_CHANGED goes
#: whole without the full XOR (a prime, so rows of a tensor do not line up with it; ~2000
#: samples of an 8 MB chunk, touching one cache line in 64)
SAMPLE_STRIDE = 1021
#: zstd level: 1 is the fastest that still finds the zero runs (negative levels lose 20-60%)
ZSTD_LEVEL = 1


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise ImportError(
            "delta=True needs the zstandard package: pip install 'weightsync[delta]'"
        ) from None
    return zstandard


def check_available() -> None:
    """Raise ImportError (saying what to install) if the codec cannot run here."""
    _zstd()


def _xor(new: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> None:
    """``out = new ^ base`` on uint8 chunks, eight bytes at a time where they line up."""
    words = new.numel() // 8 * 8
    if words and new.data_ptr() % 8 == 0 and base.data_ptr() % 8 == 0 and out.data_ptr() % 8 == 0:
        torch.bitwise_xor(new[:words].view(torch.int64), base[:words].view(torch.int64),
                          out=out[:words].view(torch.int64))
        if words < new.numel():
            torch.bitwise_xor(new[words:], base[words:], out=out[words:])
    else:
        torch.bitwise_xor(new, base, out=out)


def _bytes(tensor: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU uint8 tensor, as a buffer (no copy)."""
    return memoryview(tensor.numpy())  # type: ignore[arg-type]  # ndarray is a buffer


def _sampled_changed(new: torch.Tensor, base: torch.Tensor) -> float:
    """The fraction of changed 32-bit words among every ``SAMPLE_STRIDE``-th (0.0 if the
    chunk is too small or unaligned to sample)."""
    words = new.numel() // 4
    if words < 64 * SAMPLE_STRIDE or new.data_ptr() % 4 or base.data_ptr() % 4:
        return 0.0
    a = new[:words * 4].view(torch.int32)[::SAMPLE_STRIDE]
    b = base[:words * 4].view(torch.int32)[::SAMPLE_STRIDE]
    return int(torch.count_nonzero(a != b)) / a.numel()


def _changed_fraction(xor: torch.Tensor) -> float:
    """The fraction of nonzero 32-bit words of an XOR (bytes, if they do not line up)."""
    words = xor.numel() // 4 * 4
    if words and xor.data_ptr() % 4 == 0:
        changed = int(torch.count_nonzero(xor[:words].view(torch.int32)))
        changed += int(torch.count_nonzero(xor[words:]))
        return changed / (words // 4 + xor.numel() - words)
    return int(torch.count_nonzero(xor)) / max(xor.numel(), 1)


def _readonly(raw: bytes) -> torch.Tensor:
    """A uint8 tensor over ``raw`` without a copy (only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we never write
        return torch.frombuffer(raw, dtype=torch.uint8)


class DeltaEncoder:
    """The trainer's side: encodes chunks against their base (one scratch chunk, reused)."""

    def __init__(self, sparse: bool | None = None) -> None:
        self._compressor = _zstd().ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False)
        self._scratch: torch.Tensor | None = None
        #: write SPARSE deltas (default: where numba is installed)
        self.sparse = delta_sparse.available() if sparse is None else sparse

    def _encode_sparse(self, new: torch.Tensor, base: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``(SAME, empty)``, ``(SPARSE, varints)``, or ``(DELTA, empty)`` meaning: too many
        changes for the sparse format, try zstd."""
        n = new.numel()
        room = int(n * SPARSE_MAX_RATIO) + delta_sparse.BLOCK_BYTES
        if self._scratch is None or self._scratch.numel() < max(n, room):
            self._scratch = torch.empty(max(n, room), dtype=torch.uint8)
        out = self._scratch[:room]
        written = delta_sparse.encode(new, base, out)
        if written == 0:
            return SAME, new[:0]
        if written < 0 or written >= n:  # a delta is always smaller than its chunk
            return DELTA, new[:0]
        return SPARSE, out[:written].clone()  # the scratch is reused by the next chunk

    def encode(self, new: torch.Tensor, base: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``(kind, payload)`` for the uint8 chunk ``new`` against ``base`` (same size):
        ``SAME`` with an empty payload, ``SPARSE`` with the changed words' varints,
        ``DELTA`` with the compressed XOR, or ``WHOLE`` with ``new`` itself."""
        n = new.numel()
        if _sampled_changed(new, base) > min(1.0, MAX_CHANGED * 1.5):
            return WHOLE, new
        if self.sparse and delta_sparse.fits(new) and delta_sparse.fits(base):
            kind, payload = self._encode_sparse(new, base)
            if kind != DELTA:
                return kind, payload
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.uint8)
        xor = self._scratch[:n]
        _xor(new, base, xor)
        changed = _changed_fraction(xor)
        if changed == 0:
            return SAME, new[:0]
        if changed > MAX_CHANGED:
            return WHOLE, new
        packed = self._compressor.compress(_bytes(xor))
        if len(packed) >= n:
            return WHOLE, new
        return DELTA, _readonly(packed)


def header_problem(kind: int, size: int, chunk_bytes: int, has_base: bool) -> str | None:
    """Why a chunk header (its ``kind`` and payload ``size``) cannot be one the encoder
    wrote for a chunk of ``chunk_bytes`` (None: it can). ``has_base``: the receiver holds
    the version the deltas are taken against. The receiver checks every header with this
    before it allocates or receives anything for the chunk."""
    name = KIND_NAMES.get(kind)
    if name is None:
        kinds = ", ".join(f"{k} ({n})" for k, n in KIND_NAMES.items())
        return f"unknown chunk kind {kind} (expected one of {kinds})"
    if kind == WHOLE:
        expected, ok = f"exactly the chunk's {chunk_bytes}", size == chunk_bytes
    elif kind == SAME:
        expected, ok = "0", size == 0
    else:  # a delta is written only when it is smaller than the chunk
        expected, ok = f"1 to {chunk_bytes - 1}", 0 < size < chunk_bytes
    if not ok:
        return f"a {name} chunk of {size} payload bytes (expected {expected})"
    if kind != WHOLE and not has_base:
        return (f"a {name} chunk, but this node holds no base for it (the stream is of "
                "whole chunks)")
    return None


class DeltaDecoder:
    """The receiving node's side: rebuilds chunks from their base and what arrived."""

    def __init__(self) -> None:
        self._zstd = _zstd()
        self._decompressor = self._zstd.ZstdDecompressor()
        delta_sparse.available()  # compile the sparse kernel now, before the first version

    def decode(self, kind: int, payload: torch.Tensor, base: torch.Tensor,
               out: torch.Tensor) -> None:
        """Write the new chunk into ``out`` from ``base`` and a ``SAME``/``DELTA``/``SPARSE``
        payload; MalformedDeltaError if the payload does not decode to exactly one chunk
        (nothing larger than the chunk is ever allocated)."""
        if kind == SAME:
            if payload.numel():
                raise MalformedDeltaError(f"an unchanged chunk carries {payload.numel()} bytes")
            out.copy_(base)
            return
        if kind == SPARSE:
            delta_sparse.decode(payload, base, out)
            return
        if kind != DELTA:
            raise MalformedDeltaError(f"chunk kind {kind} is not a delta")
        _xor(_readonly(self._decompress(payload, out.numel())), base, out)

    def _decompress(self, payload: torch.Tensor, size: int) -> bytes:
        """The ``size`` bytes of one zstd frame that declares that size and fills
        ``payload`` exactly; MalformedDeltaError otherwise (the output is bounded by the
        declared size, checked first: a frame cannot make this allocate more)."""
        data = _bytes(payload)
        zstd = self._zstd
        try:
            declared = zstd.frame_content_size(data)
        except zstd.ZstdError as exc:
            raise MalformedDeltaError(f"the delta is no zstd frame: {exc}") from None
        if declared != size:
            raise MalformedDeltaError(
                f"the delta's zstd frame declares {declared} bytes (-1: unknown), the chunk "
                f"has {size}")
        stream = self._decompressor.decompressobj(write_size=size)
        try:
            raw = stream.decompress(data)
        except zstd.ZstdError as exc:  # corrupted on the way, or longer than declared
            raise MalformedDeltaError(f"the delta does not decompress: {exc}") from None
        if not stream.eof or stream.unused_data:
            raise MalformedDeltaError(
                "the delta's zstd frame is cut short" if not stream.eof else
                f"{len(stream.unused_data)} bytes follow the delta's zstd frame")
        if len(raw) != size:
            raise MalformedDeltaError(f"the delta decompresses to {len(raw)} bytes, the chunk "
                                      f"has {size}")
        return raw


def unchanged_fraction(new: torch.Tensor, base: torch.Tensor) -> float:
    """The fraction of equal elements of two tensors of one shape and dtype (compared as
    raw words: what a delta of their packed bytes sees)."""
    if new.numel() == 0:
        return 1.0
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    return float((new.reshape(-1).view(width) == base.reshape(-1).view(width)).float().mean())
