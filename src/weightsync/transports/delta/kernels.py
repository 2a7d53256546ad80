"""The numba kernels of the sparse delta format (``delta.sparse``), compiled where numba is
installed: this module imports numba, so only ``delta.sparse._kernels`` imports it.

The encoder finds the changed 16-bit words without a branch per word: for each block of 16
64-bit words it builds a 64-bit mask of the nonzero lanes of their XOR (a SWAR test per
word), then visits only the set bits (count-trailing-zeros). After a small optimizer step
the changes fall at random, so a per-word branch is mispredicted for a large share of
the words; here a block costs one mispredicted loop exit. Measured on a 200 MB bf16
version with 7.4% of its words changed: 40 ms against 106 ms for the per-word loop, the
same bytes out.
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, unused-ignore]
from numba import types
from numba.extending import intrinsic  # type: ignore[import-untyped, unused-ignore]

#: 64-bit words per block (64 16-bit lanes: one bit each in the block's mask)
BLOCK_WORDS = 16
#: the most bytes one block writes: 64 changes of at most 8 bytes (see ``delta.sparse``)
BLOCK_BYTES = 64 * 8


@intrinsic  # type: ignore[misc, unused-ignore]
def _trailing_zeros(typingctx: Any, value: Any) -> Any:
    """LLVM's ``cttz`` on a uint64 (the index of the lowest set bit)."""
    sig = types.uint64(types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@numba.njit(nogil=True, cache=True)  # type: ignore[misc, unused-ignore]
def encode_blocks(new64: Any, base64: Any, new16: Any, base16: Any, out: Any) -> int:
    """Write the (gap, XOR) varints of the changed 16-bit words of one chunk (``new64`` and
    ``base64``: its uint64 views; ``new16``, ``base16``: its uint16 views) into ``out``;
    the bytes written, or -1 once fewer than :data:`BLOCK_BYTES` are left before a block."""
    low = np.uint64(0x7FFF7FFF7FFF7FFF)
    high = np.uint64(0x8000800080008000)
    one, zero = np.uint64(1), np.uint64(0)
    limit = out.shape[0] - BLOCK_BYTES
    words = new64.shape[0]
    pos = 0
    last = np.int64(0)  # the lane after the previous change
    for block in range((words + BLOCK_WORDS - 1) // BLOCK_WORDS):
        if pos > limit:
            return -1
        start = block * BLOCK_WORDS
        mask = zero
        for k in range(min(BLOCK_WORDS, words - start)):
            word = new64[start + k] ^ base64[start + k]
            lanes = (((word & low) + low) | word) & high  # each nonzero lane's top bit
            nibble = (((lanes >> np.uint64(15)) & one) | ((lanes >> np.uint64(30)) & np.uint64(2))
                      | ((lanes >> np.uint64(45)) & np.uint64(4))
                      | ((lanes >> np.uint64(60)) & np.uint64(8)))
            mask |= nibble << np.uint64(4 * k)
        first = 4 * start
        while mask != zero:
            index = first + np.int64(_trailing_zeros(mask))
            mask &= mask - one
            value = np.int64(new16[index] ^ base16[index])
            gap = index - last
            if (gap | value) < 128:  # the common case: one byte each
                out[pos] = gap
                out[pos + 1] = value
                pos += 2
            else:
                while gap >= 128:
                    out[pos] = (gap & 127) | 128
                    pos += 1
                    gap >>= 7
                out[pos] = gap
                pos += 1
                while value >= 128:
                    out[pos] = (value & 127) | 128
                    pos += 1
                    value >>= 7
                out[pos] = value
                pos += 1
            last = index + 1
    return pos
