"""The sparse delta format: one chunk's changed 16-bit words as (gap, XOR) varint pairs.

After a small optimizer step most bf16 words are unchanged and the changed ones scatter at
random, ~5-8% of them: zstd spends ~30 ns on each such island (~0.6 GB/s on an 8 MB
chunk). This format writes, for every changed word, the number of unchanged words since the
previous change and the XOR of the new word with the base word, each as a LEB128 varint
(7 bits a byte, high bit set on all but the last byte). A small step changes only the low
mantissa bits, so both usually fit one byte: ~2 bytes a change, zstd's size, written in one
pass over the chunk.

The format, strictly (both decoders accept exactly these streams, and refuse anything else
with :class:`MalformedDeltaError`): one or more pairs, nothing after the last; each varint
canonical (no final ``0x00`` byte after a continued one: one value, one encoding); a gap of
at most :data:`MAX_GAP_BYTES` bytes, a XOR of at most :data:`MAX_XOR_BYTES` bytes and in
``[1, 0xFFFF]``; every change's word (the previous change's word + 1 + gap, from word 0)
inside the chunk. Hence the words are strictly increasing, and a stream has at most one
pair per word of its chunk.

The passes run as numba kernels (``nogil``: the encode threads run side by side; the
encoder is ``delta.kernels.encode_blocks``, which skips unchanged words without a branch per
word) when numba is installed; without it the sender keeps to zstd (``delta.codec``) and the
receiver decodes with :func:`decode_numpy`, so either side may lack numba. Chunks whose
size is not a multiple of 8 bytes or whose buffers are not 8-byte aligned are never encoded
this way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weightsync.transports.delta.errors import MalformedDeltaError

logger = logging.getLogger(__name__)

#: the longest gap varint: 35 bits, more unchanged words than any chunk has
MAX_GAP_BYTES = 5
#: the longest XOR varint: a 16-bit value needs 3 bytes of 7 bits
MAX_XOR_BYTES = 3
#: the most bytes one change takes
MAX_CHANGE_BYTES = MAX_GAP_BYTES + MAX_XOR_BYTES
#: the encoder checks its room once per block of 64 words, so ``out`` needs this much slack
BLOCK_BYTES = 64 * MAX_CHANGE_BYTES
#: the most 16-bit words a chunk decoded this way may have (the numpy decoder's running
#: index then stays far from int64's limit)
MAX_WORDS = 1 << 31

#: why a stream is refused, by the code the decoding kernel returns
REFUSALS = {
    1: "it is empty (an unchanged chunk goes as SAME)",
    2: "it ends inside a varint or after a gap without its XOR",
    3: "a varint is longer than the format allows (5 bytes for a gap, 3 for a XOR)",
    4: "a varint is not canonical (it ends in a 0x00 byte after a continued one)",
    5: "a XOR is 0 or over 0xFFFF (a 16-bit word's change)",
    6: "a change lies past the end of the chunk",
}


def _decode_py(stream: Any, out16: Any) -> int:
    """XOR the changes in ``stream`` onto ``out16`` (uint16, holding the base): 0, or the
    :data:`REFUSALS` code of the first defect (``out16`` is then partly written). Plain
    Python that numba compiles; :func:`decode_numpy` is the same rule, vectorized."""
    n = stream.shape[0]
    words = out16.shape[0]
    if n == 0:
        return 1
    pos = 0
    last = 0  # the word after the previous change
    while pos < n:
        gap = 0
        length = 0
        byte = 128
        while byte >= 128:
            if pos >= n:
                return 2
            if length == MAX_GAP_BYTES:
                return 3
            byte = int(stream[pos])
            gap |= (byte & 127) << (7 * length)
            pos += 1
            length += 1
        if length > 1 and byte == 0:
            return 4
        value = 0
        length = 0
        byte = 128
        while byte >= 128:
            if pos >= n:
                return 2
            if length == MAX_XOR_BYTES:
                return 3
            byte = int(stream[pos])
            value |= (byte & 127) << (7 * length)
            pos += 1
            length += 1
        if length > 1 and byte == 0:
            return 4
        if value == 0 or value > 0xFFFF:
            return 5
        if gap >= words - last:  # last + gap >= words, without the sum
            return 6
        index = last + gap
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


def _refuse(code: int) -> MalformedDeltaError:
    return MalformedDeltaError(f"the sparse delta is malformed: {REFUSALS[code]}")


def _check_chunk(words: int) -> None:
    if words > MAX_WORDS:
        raise ValueError(f"a sparse delta's chunk has at most {MAX_WORDS} 16-bit words, "
                         f"this one {words}")


def decode(stream: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> None:
    """Rebuild the uint8 chunk ``out`` from ``base`` and a sparse ``stream``;
    MalformedDeltaError if the stream breaks the format (numba's kernel if there is one,
    else :func:`decode_numpy`: the same rule)."""
    if out.numel() % 2:
        raise MalformedDeltaError("a sparse delta needs a chunk of whole 16-bit words, this "
                                  f"one has {out.numel()} bytes")
    _check_chunk(out.numel() // 2)
    out.copy_(base)
    out16 = out.view(torch.int16).numpy().view(np.uint16)
    kernels = _kernels()
    if kernels is None:
        decode_numpy(stream.numpy(), out16)
        return
    code = kernels[1](stream.numpy(), out16)
    if code:
        raise _refuse(code)


def decode_numpy(stream: np.ndarray, out16: np.ndarray) -> None:
    """:func:`decode` without numba, vectorized (~10x slower than the kernel; it only runs
    where a receiver lacks numba): XOR the changes in ``stream`` onto ``out16``. The same
    rule as the kernel; ``out16`` is untouched when the stream is refused."""
    words = out16.shape[0]
    _check_chunk(words)
    if stream.size == 0:
        raise _refuse(1)
    ends = np.flatnonzero(stream < 128)  # the last byte of each varint
    if ends.size == 0 or ends[-1] != stream.size - 1 or ends.size % 2:
        raise _refuse(2)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if (int(lengths[0::2].max()) > MAX_GAP_BYTES
            or int(lengths[1::2].max()) > MAX_XOR_BYTES):
        raise _refuse(3)
    if bool(np.any((lengths > 1) & (stream[ends] == 0))):
        raise _refuse(4)
    values = np.zeros(ends.size, dtype=np.int64)
    for k in range(int(lengths.max())):
        take = lengths > k
        values[take] |= (stream[starts[take] + k].astype(np.int64) & 127) << (7 * k)
    gaps, xors = values[0::2], values[1::2]
    if int(xors.min()) == 0 or int(xors.max()) > 0xFFFF:
        raise _refuse(5)
    # the words rise by at least 1 a change: more changes than words, or one gap past the
    # end, reach past it; otherwise the running sum stays under words**2 (no overflow)
    if gaps.size > words or int(gaps.max()) >= words:
        raise _refuse(6)
    indices = np.cumsum(gaps + 1) - 1
    if int(indices[-1]) >= words:
        raise _refuse(6)
    out16[indices] ^= xors.astype(np.uint16)
