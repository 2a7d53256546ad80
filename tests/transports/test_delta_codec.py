"""The delta codec on its own: every kind round-trips exactly; a corrupted delta, a header
no encoder writes, or a stream that breaks the sparse format is refused (one error,
``IntegrityError``) rather than decoded into wrong bytes or allowed to allocate what it
declares; and the numba and numpy sparse decoders accept exactly the same streams."""

from __future__ import annotations

import random
import time

import pytest
import torch

pytest.importorskip("zstandard")

import weightsync as ws
from weightsync.transports.delta import sparse as delta_sparse
from weightsync.transports.delta.codec import (
    DELTA,
    SAME,
    SPARSE,
    WHOLE,
    DeltaDecoder,
    DeltaEncoder,
    header_problem,
    unchanged_fraction,
)


def bf16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.uint8).clone()


@pytest.mark.parametrize("extra", [0, 3])  # a chunk that does not end on a word
def test_kinds_round_trip(extra):
    torch.manual_seed(0)
    weights = torch.randn(100_000) * 0.02
    base = torch.cat([bf16_bytes(weights), torch.arange(extra, dtype=torch.uint8)])
    small = torch.cat([bf16_bytes(weights + 1e-6 * torch.randn_like(weights).sign()),
                       torch.arange(extra, dtype=torch.uint8)])
    large = torch.cat([bf16_bytes(weights * 1.7 + 0.01), torch.arange(extra, dtype=torch.uint8)])
    encoder, decoder = DeltaEncoder(sparse=False), DeltaDecoder()
    for new, kind in ((base.clone(), SAME), (small, DELTA), (large, WHOLE)):
        got, payload = encoder.encode(new, base)
        assert got == kind
        out = torch.empty_like(new)
        if kind == WHOLE:
            assert payload.data_ptr() == new.data_ptr()
            continue
        decoder.decode(kind, payload.clone(), base, out)
        assert torch.equal(out, new)
    kind, payload = encoder.encode(small, base)
    assert payload.numel() < 0.2 * small.numel()


def test_corrupted_delta_is_refused():
    torch.manual_seed(1)
    weights = torch.randn(50_000) * 0.02
    base = bf16_bytes(weights)
    new = bf16_bytes(weights + 1e-6 * torch.randn_like(weights).sign())
    kind, payload = DeltaEncoder(sparse=False).encode(new, base)
    assert kind == DELTA
    broken = payload[: payload.numel() // 2].clone()
    with pytest.raises(ws.IntegrityError, match="cut short|does not decompress"):
        DeltaDecoder().decode(DELTA, broken, base, torch.empty_like(new))


def test_unchanged_fraction():
    a = torch.zeros(10, dtype=torch.bfloat16)
    b = a.clone()
    b[:3] = 1.0
    assert unchanged_fraction(b, a) == pytest.approx(0.7)


needs_numba = pytest.mark.skipif(not delta_sparse.available(), reason="numba not installed")


def small_step(n: int, seed: int, scale: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new): bf16 chunks of ``n`` weights before and after a small step."""
    torch.manual_seed(seed)
    weights = torch.randn(n) * 0.02
    return bf16_bytes(weights), bf16_bytes(weights + scale * torch.randn_like(weights).sign())


@needs_numba
def test_sparse_round_trips_with_numba_and_numpy():
    base, new = small_step(100_000, 2)
    new[-2:] = base[-2:] ^ 0xFF  # the last word changes in both bytes (a 3-byte varint)
    new[:2] = base[:2] ^ 0x01  # and the first
    kind, payload = DeltaEncoder().encode(new, base)
    assert kind == SPARSE and payload.numel() < 0.2 * new.numel()
    out = torch.empty_like(new)
    DeltaDecoder().decode(SPARSE, payload, base, out)
    assert torch.equal(out, new)
    out16 = base.clone()
    delta_sparse.decode_numpy(payload.numpy(), out16.view(torch.int16).numpy().view("uint16"))
    assert torch.equal(out16, new)  # a receiver without numba rebuilds the same bytes


@needs_numba
def test_sparse_gives_way_to_zstd_and_whole():
    torch.manual_seed(3)
    base = bf16_bytes(torch.randn(40_000) * 0.02)
    assert DeltaEncoder().encode(base.clone(), base)[0] == SAME
    many = base.clone()
    many.view(torch.int16)[::4] ^= 0x100  # 3 bytes for each 4th word: over SPARSE_MAX_RATIO
    kind, payload = DeltaEncoder().encode(many, base)
    assert kind == DELTA
    out = torch.empty_like(many)
    DeltaDecoder().decode(kind, payload, base, out)
    assert torch.equal(out, many)
    old, new = small_step(20_002, 5)  # 40004 bytes, not a multiple of 8: zstd
    assert DeltaEncoder().encode(new, old)[0] == DELTA


@needs_numba
@pytest.mark.parametrize("cut", ["truncated", "past the end", "zero xor"])
def test_malformed_sparse_is_refused(cut):
    base, new = small_step(20_000, 4)
    kind, payload = DeltaEncoder().encode(new, base)
    assert kind == SPARSE
    if cut == "truncated":
        broken = torch.cat([payload, torch.tensor([0x85], dtype=torch.uint8)])
    elif cut == "past the end":
        broken = torch.cat([payload, torch.tensor([0xFF, 0xFF, 0x7F, 1], dtype=torch.uint8)])
    else:
        broken = torch.cat([payload, torch.tensor([0, 0], dtype=torch.uint8)])
    with pytest.raises(ws.IntegrityError):
        DeltaDecoder().decode(SPARSE, broken, base, torch.empty_like(new))
    with pytest.raises(ws.IntegrityError):
        delta_sparse.decode_numpy(broken.numpy(), base.clone().view(torch.int16).numpy()
                                  .view("uint16"))


CHUNK = 4096  # bytes of the chunks the header checks are asked about


@pytest.mark.parametrize(("kind", "size", "has_base", "expected"), [
    (WHOLE, 2**40, True, "expected exactly the chunk's 4096"),
    (WHOLE, -8, True, "expected exactly"),
    (DELTA, 2**40, True, "expected 1 to 4095"),
    (SPARSE, -1, True, "expected 1 to 4095"),
    (DELTA, CHUNK, True, "expected 1 to 4095"),  # a delta is never as large as its chunk
    (SPARSE, 0, True, "expected 1 to 4095"),
    (SAME, 5, True, "expected 0"),
    (7, 100, True, "unknown chunk kind 7"),
    (-1, 0, True, "unknown chunk kind -1"),
    (SAME, 0, False, "holds no base"),
    (DELTA, 100, False, "holds no base"),
    (SPARSE, 100, False, "holds no base"),
])
def test_headers_no_encoder_writes_are_refused(kind, size, has_base, expected):
    assert expected in header_problem(kind, size, CHUNK, has_base)


def test_headers_every_encoder_writes_pass():
    assert header_problem(WHOLE, CHUNK, CHUNK, False) is None
    assert header_problem(SAME, 0, CHUNK, True) is None
    for kind in (DELTA, SPARSE):
        assert header_problem(kind, 1, CHUNK, True) is None
        assert header_problem(kind, CHUNK - 1, CHUNK, True) is None
    base, new = small_step(CHUNK // 2, 6)
    for sparse in (False, True) if delta_sparse.available() else (False,):
        for target in (base.clone(), new, torch.randint(0, 256, (CHUNK,), dtype=torch.uint8)):
            kind, payload = DeltaEncoder(sparse=sparse).encode(target, base)
            assert header_problem(kind, payload.numel(), CHUNK, True) is None


def zstd_frame_header(content_size: int) -> bytes:
    """A zstd frame header declaring ``content_size`` (8-byte field, one segment), followed
    by an empty last raw block."""
    return (b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + content_size.to_bytes(8, "little")
            + b"\x01\x00\x00")


def test_a_zstd_frame_is_bounded_by_its_chunk():
    import zstandard

    base = bf16_bytes(torch.randn(2048) * 0.02)
    n = base.numel()
    decoder = DeltaDecoder()

    def decode(frame: bytes) -> None:
        payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        decoder.decode(DELTA, payload, base, torch.empty_like(base))

    with pytest.raises(ws.IntegrityError, match=f"declares {2**40} bytes.*has {n}"):
        decode(zstd_frame_header(2**40))  # never allocated: refused from its header
    with pytest.raises(ws.IntegrityError, match="declares -1 bytes"):
        decode(zstandard.ZstdCompressor(write_content_size=False).compress(bytes(n)))
    with pytest.raises(ws.IntegrityError, match="no zstd frame"):
        decode(b"\x00" * 32)
    good = zstandard.ZstdCompressor().compress(bytes(n))
    decode(good)
    with pytest.raises(ws.IntegrityError, match="3 bytes follow"):
        decode(good + b"xyz")
    longer = bytearray(zstandard.ZstdCompressor().compress(bytes(n + 512)))
    assert longer[4] & 0xC0 == 0x40  # a 2-byte size field, holding size - 256
    longer[5:7] = (n - 256).to_bytes(2, "little")  # declares the chunk, holds more
    with pytest.raises(ws.IntegrityError, match="does not decompress"):
        decode(bytes(longer))


def varint(value: int, length: int | None = None) -> list[int]:
    """``value`` as LEB128, padded to ``length`` bytes (non-canonical) if given."""
    out = []
    while True:
        out.append(value & 127)
        value >>= 7
        if not value and (length is None or len(out) >= length):
            break
        out[-1] |= 128
    return out


def stream_of(*parts: list[int]) -> torch.Tensor:
    return torch.tensor([b for part in parts for b in part], dtype=torch.uint8)


def sparse_decoders() -> list:
    """Both decoders, each as ``decode(stream, base) -> rebuilt chunk`` (raising if refused)."""

    def with_numpy(stream: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        out = base.clone()
        delta_sparse.decode_numpy(stream.numpy(), out.view(torch.int16).numpy().view("uint16"))
        return out

    def with_kernel(stream: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(base)
        delta_sparse.decode(stream, base, out)
        return out

    return [pytest.param(with_numpy, id="numpy"),
            pytest.param(with_kernel, id="numba", marks=needs_numba)]


WORDS = 64  # 16-bit words of the chunk the hand-made streams are decoded onto
#: a gap past any chunk: 6 bytes, 2**42 - 1 words; enough such pairs overflow an int64 sum
HUGE_GAP = varint(2**42 - 1)
MALFORMED = {
    "xor 1 in 4 bytes (non-canonical)": stream_of(varint(0), varint(1, 4)),
    "xor 1 in 2 bytes (non-canonical)": stream_of(varint(0), varint(1, 2)),
    "gap 0 in 5 bytes (non-canonical)": stream_of(varint(0, 5), varint(1)),
    "gap 3 in 2 bytes (non-canonical)": stream_of(varint(3, 2), varint(1)),
    "gap in 6 bytes": stream_of(HUGE_GAP, varint(1)),
    "running index overflows": stream_of([*HUGE_GAP, 1]).repeat(2**21 + 8),
    "gap past the chunk": stream_of(varint(WORDS), varint(1)),
    "second change past the chunk": stream_of(varint(WORDS - 1), varint(1), varint(0), varint(1)),
    "more changes than words": stream_of(*[[0, 1]] * (WORDS + 1)),
    "xor 0": stream_of(varint(0), varint(0)),
    "xor over 16 bits": stream_of(varint(0), varint(0x10000)),
    "ends inside a varint": stream_of(varint(0), varint(1), [0x85]),
    "gap without its xor": stream_of(varint(0), varint(1), varint(2)),
    "empty": stream_of(),
}


@pytest.mark.parametrize("decode", sparse_decoders())
@pytest.mark.parametrize("name", list(MALFORMED))
def test_both_sparse_decoders_refuse_what_breaks_the_format(decode, name):
    base = torch.arange(2 * WORDS, dtype=torch.uint8)
    with pytest.raises(ws.IntegrityError, match="sparse delta is malformed"):
        decode(MALFORMED[name], base)


@pytest.mark.parametrize("decode", sparse_decoders())
def test_both_sparse_decoders_take_canonical_edges(decode):
    base = torch.zeros(2 * WORDS, dtype=torch.uint8)
    stream = stream_of(varint(0), varint(0xFFFF), varint(WORDS - 3), varint(0x80),
                       varint(0), varint(1))  # words 0, WORDS - 2 and the last one
    out = decode(stream, base).view(torch.int16).numpy().view("uint16")
    expected = [0] * WORDS
    expected[0], expected[WORDS - 2], expected[WORDS - 1] = 0xFFFF, 0x80, 1
    assert out.tolist() == expected


def sparse_outcome(decode, stream: torch.Tensor, base: torch.Tensor) -> bytes | None:
    """The rebuilt chunk's bytes, or None if the decoder refused the stream (any other
    exception escapes and fails the test)."""
    try:
        return decode(stream, base).numpy().tobytes()
    except ws.IntegrityError:
        return None


def mutated(rng: random.Random, stream: list[int]) -> list[int]:
    """``stream`` with one to three random edits (bytes flipped, set, inserted, deleted, a
    cut, a tail, a run repeated)."""
    out = list(stream)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(out) + 1)
        edit = rng.randrange(8)
        if edit == 0 and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif edit == 1 and at < len(out):
            out[at] = rng.choice([0x00, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif edit == 2:
            out.insert(at, rng.choice([0x00, 0x80, rng.randrange(256)]))
        elif edit == 3 and at < len(out):
            del out[at]
        elif edit == 4:
            out = out[:at]
        elif edit == 5:
            out += [rng.randrange(256) for _ in range(rng.randint(1, 4))]
        elif edit == 6:
            out[at:at] = out[max(0, at - 4):at]
        else:
            out[at:at] = varint(rng.randrange(1 << 16), rng.randint(1, 4))
    return out


def hand_built(rng: random.Random, words: int) -> list[int]:
    """Random (gap, XOR) pairs, mostly valid, some at or past the format's edges (a gap
    past the chunk, a XOR of 0 or 17 bits, a padded varint, a stray byte)."""
    out: list[int] = []
    for _ in range(rng.randint(0, 6)):
        edge = rng.random() < 0.1
        gap = (rng.choice([words - 1, words, 2**35 - 1, 2**35]) if edge
               else rng.randrange(max(1, words // 8)))
        xor = (rng.choice([0, 0xFFFF, 0x10000]) if rng.random() < 0.1
               else rng.choice([1, 0x7F, 0x80, rng.randrange(1, 1 << 16)]))
        for value in (gap, xor):
            canonical = len(varint(value))
            padded = rng.random() < 0.05
            out += varint(value, rng.choice([canonical + 1, 5, 6]) if padded else canonical)
        if rng.random() < 0.03:
            out.append(rng.randrange(256))
    return out


@needs_numba
def test_sparse_decoders_agree_on_fuzzed_streams():
    """Differential fuzz, seeded and bounded (~3 s, at most 40,000 streams): real streams
    mutated, and hand-built ones near the format's edges; the numba kernel and the numpy
    decoder must refuse the same streams and rebuild the same bytes from the others."""
    (numpy_decode,), (kernel_decode,) = (p.values for p in sparse_decoders())
    rng = random.Random(34)
    real = []
    for seed in range(4):
        base, new = small_step(2048, 10 + seed)
        new[seed * 64:seed * 64 + 8] ^= 0xC3  # some changes in both bytes: 3-byte XORs
        kind, payload = DeltaEncoder().encode(new, base)
        assert kind == SPARSE
        real.append((base, payload.tolist()))
    taken = refused = 0
    stop = time.monotonic() + 3.0
    for case in range(40_000):
        if time.monotonic() > stop:
            break
        if case % 2:
            base, payload = real[rng.randrange(len(real))]
            stream = mutated(rng, payload)
        else:
            words = rng.randint(1, 300)
            base = torch.randint(0, 256, (2 * words,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(case))
            stream = hand_built(rng, words)
        tensor = torch.tensor(stream, dtype=torch.uint8)
        with_numpy = sparse_outcome(numpy_decode, tensor, base)
        assert with_numpy == sparse_outcome(kernel_decode, tensor, base), (case, stream)
        taken += with_numpy is not None
        refused += with_numpy is None
    assert taken > 200 and refused > 200, (taken, refused)  # both sides of the rule ran
