"""Damage that a sum of 64-bit words cannot see, done to bytes the way a misdirected page
write, a reordered row or a compensating pair of bit errors would: for slot files on disk
and for buffers in memory (Ray chunks, delta bases)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

#: what each kind does, in bytes from the start of the damaged region
KINDS = ("page_swap", "row_swap", "word_pair", "top_bit_flips")
#: the region a damage kind needs (bytes)
NEEDS = 12288

_MASK = (1 << 64) - 1


def damage_bytes(data: bytearray | memoryview, kind: str, start: int = 0) -> None:
    """Damage ``data`` (at least ``start + NEEDS`` bytes) in place; the 64-bit word sum of
    the region stays the same."""
    if len(data) < start + NEEDS:
        raise ValueError(f"{kind} needs {NEEDS} bytes from {start}, the buffer has {len(data)}")
    if kind == "page_swap":  # two 4 KiB pages trade places
        a, b = slice(start, start + 4096), slice(start + 8192, start + 12288)
        data[a], data[b] = bytes(data[b]), bytes(data[a])
    elif kind == "row_swap":  # two 256-byte rows trade places
        a, b = slice(start + 256, start + 512), slice(start + 1280, start + 1536)
        data[a], data[b] = bytes(data[b]), bytes(data[a])
    elif kind == "word_pair":  # one 64-bit word gains x, another loses it
        x = 0x1234_5678 << 20
        for offset, delta in ((start + 24, x), (start + 88, -x)):
            (word,) = struct.unpack_from("<Q", data, offset)
            struct.pack_into("<Q", data, offset, (word + delta) & _MASK)
    elif kind == "top_bit_flips":  # the top bit of two words flips: 2**63 + 2**63 wraps to 0
        for offset in (start + 40 + 7, start + 72 + 7):
            data[offset] ^= 0x80
    else:
        raise ValueError(f"unknown damage {kind!r}")


def damage_tensor(buffer: torch.Tensor, kind: str, start: int = 0) -> None:
    """:func:`damage_bytes` on a contiguous CPU tensor, read as its bytes."""
    raw = buffer.reshape(-1).view(torch.uint8)
    copy = bytearray(raw.numpy().tobytes())
    damage_bytes(copy, kind, start)
    raw.copy_(torch.frombuffer(copy, dtype=torch.uint8))


def damage_slot(path: Path, kind: str, tensor: str | None = None) -> None:
    """Damage the bytes of ``tensor`` (default: the first in the file that is large enough)
    in the slot file at ``path``, in place."""
    with open(path, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        def size(key: str) -> int:
            return int(header[key]["data_offsets"][1] - header[key]["data_offsets"][0])

        name = tensor or min((k for k in header if size(k) >= NEEDS),
                             key=lambda k: header[k]["data_offsets"][0])
        begin, end = header[name]["data_offsets"]
        if end - begin < NEEDS:
            raise ValueError(f"tensor {name!r} has {end - begin} bytes, {kind} needs {NEEDS}")
        fh.seek(8 + n + begin)
        data = bytearray(fh.read(NEEDS))
        damage_bytes(data, kind)
        fh.seek(8 + n + begin)
        fh.write(data)
