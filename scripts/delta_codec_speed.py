"""Time the Ray delta codec on one 8 MB bf16 chunk after one AdamW step: zstd against the
sparse format, encode and decode, single-threaded.

Run: ``PYTHONPATH=src python scripts/delta_codec_speed.py`` (docs/performance.md quotes it).
The chunk is 4 Mi N(0, 0.02) weights, cast to bf16 before and after one AdamW step on
gradient noise; lr 2e-6 and 1e-6 leave ~92.5% and ~96% of the words unchanged.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from weightsync.transports.delta.codec import (
    KIND_NAMES,
    DeltaDecoder,
    DeltaEncoder,
    unchanged_fraction,
)

WORDS = 4 * 1024 * 1024  # one 8 MB chunk of bf16


def seconds(fn: Callable[[], object], repeats: int = 30) -> float:
    """Mean seconds of ``fn`` after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for lr in (2e-6, 1e-6):
        weights = torch.nn.Parameter(torch.randn(WORDS) * 0.02)
        optimizer = torch.optim.AdamW([weights], lr=lr, weight_decay=0.0)
        base = weights.detach().to(torch.bfloat16)
        weights.grad = torch.randn(WORDS)
        optimizer.step()
        new = weights.detach().to(torch.bfloat16)
        new_bytes, base_bytes = new.view(torch.uint8), base.view(torch.uint8)
        out = torch.empty_like(new_bytes)
        for sparse in (False, True):
            encoder, decoder = DeltaEncoder(sparse=sparse), DeltaDecoder()
            kind, payload = encoder.encode(new_bytes, base_bytes)
            encode = seconds(functools.partial(encoder.encode, new_bytes, base_bytes))
            decode = seconds(functools.partial(decoder.decode, kind, payload, base_bytes, out))
            assert torch.equal(out, new_bytes)
            n = new_bytes.numel()
            print(f"lr {lr:g}, {100 * unchanged_fraction(new, base):.1f}% unchanged, "
                  f"{KIND_NAMES[kind]:6}: payload {100 * payload.numel() / n:.2f}% | encode "
                  f"{encode * 1e3:.2f} ms = {n / encode / 1e6:.0f} MB/s | decode "
                  f"{decode * 1e3:.2f} ms = {n / decode / 1e6:.0f} MB/s")


if __name__ == "__main__":
    main()
