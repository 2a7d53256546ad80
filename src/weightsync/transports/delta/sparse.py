"""The sparse delta format: one chunk's changed 16-bit words as (gap, XOR) varint pairs.

After a small optimizer step most bf16 words are unchanged and the changed ones scatter at
random, ~5-8% of them: zstd spends ~30 ns on each such island (~0.6 GB/s on an 8 MB
chunk). This format writes, for every changed word, the number of unchanged words since the
previous change and the XOR of the new word with the base word, each as a LEB128 varint
(7 bits a byte, high bit set on all but the last byte). A small step changes only the low
mantissa bits, so both usually fit one byte: ~2 bytes a change, zstd's size, written in one
pass over the chunk.

The passes run as numba kernels (``nogil``: the encode threads run side by side; the
encoder is ``delta.kernels.encode_blocks``, which skips unchanged words without a branch per
word) when numba is installed; without it the sender keeps to zstd (``delta.py``) and the receiver decodes
with :func:`decode_numpy`, so either side may lack numba. Chunks whose size is not a
multiple of 8 bytes or whose buffers are not 8-byte aligned are never encoded this way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: the most bytes one change takes: a gap of up to 2**35 words (5 bytes), a 16-bit XOR (3)
MAX_CHANGE_BYTES = 8
#: the encoder checks its room once per block of 64 words, so ``out`` needs this much slack
BLOCK_BYTES = 64 * MAX_CHANGE_BYTES


def _decode_py(stream: Any, out16: Any) -> int:
    """XOR the changes in ``stream`` onto ``out16`` (uint16, holding the base): 0, or -1
    if the stream is malformed (a truncated varint, a word past the chunk)."""
    n = stream.shape[0]
    words = out16.shape[0]
    pos = 0
    last = 0
    while pos < n:
        gap = 0
        shift = 0
        while True:
            if pos >= n or shift > 35:
                return -1
            byte = stream[pos]
            pos += 1
            gap |= (byte & 127) << shift
            shift += 7
            if byte < 128:
                break
        value = 0
        shift = 0
        while True:
            if pos >= n or shift > 14:
                return -1
            byte = stream[pos]
            pos += 1
            value |= (byte & 127) << shift
            shift += 7
            if byte < 128:
                break
        index = last + gap
        if index >= words or value == 0 or value > 0xFFFF:
            return -1
        out16[index] ^= value
        last = index + 1
    return 0


@functools.cache
def _kernels() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """The numba-compiled (encode, decode) kernels, or None without numba."""
    try:
        import numba  # type: ignore[import-untyped, unused-ignore]

        from weightsync.transports.delta import kernels as delta_kernels
    except ImportError:
        return None
    try:
        try:
            decode = numba.njit(nogil=True, cache=True)(_decode_py)  # compiled once per machine
        except RuntimeError:  # pragma: no cover - no writable cache directory: per process
            decode = numba.njit(nogil=True)(_decode_py)
        encode = delta_kernels.encode_blocks
        # compile now (setup time: encoders and decoders are made before any send), not
        # inside the first timed chunk
        words = np.zeros(1, dtype=np.uint64)
        lanes = np.zeros(4, dtype=np.uint16)
        encode(words, words, lanes, lanes, np.zeros(BLOCK_BYTES + 16, dtype=np.uint8))
        decode(np.zeros(0, dtype=np.uint8), lanes)
        return encode, decode
    except Exception as exc:  # pragma: no cover - a numba that cannot compile here
        logger.warning("numba cannot compile the sparse delta kernels (%s): using zstd", exc)
        return None


def available() -> bool:
    """True if this process can write the sparse format (numba is installed)."""
    return _kernels() is not None


def fits(chunk: torch.Tensor) -> bool:
    """True if the uint8 chunk can go sparse: a nonempty multiple of 8 bytes, 8-aligned."""
    return chunk.numel() > 0 and chunk.numel() % 8 == 0 and chunk.data_ptr() % 8 == 0


def encode(new: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> int:
    """The sparse delta of uint8 chunk ``new`` against ``base`` into ``out``: the bytes
    written (0: nothing changed), or -1 if it might not fit in ``out`` (checked a block of
    64 words at a time: give ``out`` :data:`BLOCK_BYTES` more than the most you accept).
    Both chunks must :func:`fit`; needs :func:`available`."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the sparse delta encoder needs numba")
    new64, base64 = (t.view(torch.int64).numpy().view(np.uint64) for t in (new, base))
    return int(kernels[0](new64, base64, new64.view(np.uint16), base64.view(np.uint16),
                          out.numpy()))


def decode(stream: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> None:
    """Rebuild the uint8 chunk ``out`` from ``base`` and a sparse ``stream``; ValueError if
    the stream is malformed (numba's kernel if there is one, else :func:`decode_numpy`)."""
    if out.numel() % 2:
        raise ValueError("a sparse delta needs a chunk of whole 16-bit words")
    out.copy_(base)
    kernels = _kernels()
    if kernels is None:
        decode_numpy(stream.numpy(), out.view(torch.int16).numpy().view(np.uint16))
        return
    if kernels[1](stream.numpy(), out.view(torch.int16).numpy().view(np.uint16)) != 0:
        raise ValueError("the sparse delta is malformed")


def decode_numpy(stream: np.ndarray, out16: np.ndarray) -> None:
    """:func:`decode` without numba, vectorized (~10x slower than the kernel; it only runs
    where a receiver lacks numba): XOR the changes in ``stream`` onto ``out16``."""
    if stream.size == 0:
        return
    ends = np.flatnonzero(stream < 128)
    if ends.size == 0 or ends[-1] != stream.size - 1 or ends.size % 2:
        raise ValueError("the sparse delta is malformed")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 6:
        raise ValueError("the sparse delta is malformed")
    values = np.zeros(ends.size, dtype=np.int64)
    for k in range(int(lengths.max())):
        take = lengths > k
        values[take] |= (stream[starts[take] + k].astype(np.int64) & 127) << (7 * k)
    gaps, xors = values[0::2], values[1::2]
    indices = np.cumsum(gaps + 1) - 1
    if (int(indices[-1]) >= out16.size or int(xors.min()) == 0
            or int(xors.max()) > 0xFFFF):
        raise ValueError("the sparse delta is malformed")
    out16[indices] ^= xors.astype(np.uint16)
