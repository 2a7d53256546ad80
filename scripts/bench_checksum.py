"""Time the checksum at 400 MB against a memcpy in the same run: the function alone (numba
kernel and torch fallback, and the wrapping sum of 64-bit words it replaced), the
directory's commit pack (copy + checksum, piece by piece) and a reader's verify.

Run: ``PYTHONPATH=src python scripts/bench_checksum.py [--mb 400] [--repeats 10]``
(docs/performance.md quotes it). Medians; "x memcpy" divides by the memcpy of the same
bytes measured between the same steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from weightsync.core import checksum as ck
from weightsync.core.layout import Layout, TensorSpec
from weightsync.transports.directory.slots import bucket_checksums, file_layout, pack_with_checksums

_PIECE = 4 << 20


def word_sum(raw: torch.Tensor) -> int:
    """The previous checksum: the wrapping sum of the 64-bit words (length a multiple of 8)."""
    return int(raw.view(torch.int64).sum()) & ((1 << 64) - 1)


def pack_word_sums(layout: Layout, weights: Mapping[str, torch.Tensor], data: torch.Tensor) -> int:
    """The previous commit pack: copy each 4 MiB piece, then sum its words while in cache."""
    views = layout.tensor_views({"cpu": data})
    total = 0
    for name in layout.names:
        dst, src = views[name].reshape(-1), weights[name].reshape(-1)
        step = _PIECE // dst.element_size()
        for start in range(0, dst.numel(), step):
            piece = dst[start:start + step]
            piece.copy_(src[start:start + step])
            total += word_sum(piece.view(torch.uint8))
    return total


def median_ms(step: Callable[[], object], floor: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median ms of ``step``, median ms of ``floor``), alternating, after one warm-up each."""
    step(), floor()
    times, floors = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        floor()
        t2 = time.perf_counter()
        times.append(t1 - t0)
        floors.append(t2 - t1)
    return statistics.median(times) * 1e3, statistics.median(floors) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="megabytes (10**6 bytes)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    nbytes = args.mb * 10**6 // 8 * 8
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)

    def memcpy() -> None:
        dst.copy_(src)

    # a model-like dict: 100 fp32 tensors in one bucket
    count = 100
    per = nbytes // 4 // count
    weights = {f"layer{i}.weight": torch.randn(per) for i in range(count)}
    layout = file_layout(Layout([TensorSpec(n, (per,), torch.float32) for n in weights]))
    slot = torch.empty(layout.nbytes, dtype=torch.uint8)
    print(f"{args.mb} MB, {args.repeats} repeats, torch threads {torch.get_num_threads()}, "
          f"numba kernel: {ck.accelerated()}")
    rows: list[tuple[str, Callable[[], object]]] = [
        ("previous: word sum alone", lambda: word_sum(src)),
        ("checksum alone (numba)", lambda: ck.checksum(src)),
        ("previous: commit pack (copy + word sums)", lambda: pack_word_sums(layout, weights, slot)),
        ("commit pack (copy + checksum)", lambda: pack_with_checksums(layout, weights, slot)),
        ("verify (bucket_checksums)", lambda: bucket_checksums(layout, slot)),
    ]
    print("| step | median ms | memcpy ms | x memcpy |\n|---|---|---|---|")
    for name, step in rows:
        ms, floor = median_ms(step, memcpy, args.repeats)
        print(f"| {name} | {ms:.1f} | {floor:.1f} | {ms / floor:.2f} |", flush=True)
    ms, floor = median_ms(lambda: ck.torch_share(src), memcpy, max(1, args.repeats // 5))
    print(f"| checksum alone (torch fallback) | {ms:.1f} | {floor:.1f} | {ms / floor:.2f} |")
    if torch.cuda.is_available():
        gpu_src = src.cuda()
        gpu_dst = torch.empty_like(gpu_src)

        def gpu_copy() -> None:
            gpu_dst.copy_(gpu_src)
            torch.cuda.synchronize()

        assert ck.checksum(gpu_src) == ck.checksum(src)
        assert ck.checksum(gpu_src[3:]) == ck.checksum(src[3:])
        ms, floor = median_ms(lambda: ck.checksum(gpu_src), gpu_copy, args.repeats)
        print(f"| checksum on {torch.cuda.get_device_name()} (torch) | {ms:.1f} | {floor:.1f} "
              f"(device copy) | {ms / floor:.2f} |")


if __name__ == "__main__":
    main()
