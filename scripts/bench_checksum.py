"""Time the checksum at 400 MB against a memcpy in the same run, the previous function (a
wrapping sum of 64-bit words) beside this one (``lane32-weighted-v1``): the function
alone, the directory's commit pack (copy + checksum) and a reader's verify.

Run: ``PYTHONPATH=src python scripts/bench_checksum.py [--mb 400] [--repeats 10]
[--threads T]`` (docs/performance.md quotes it). Medians; each step is timed in turn with
the others, a memcpy of the same bytes after each, and "x memcpy" divides a step's median
by the memcpy's. ``--gap-ms`` waits that long after each memcpy, so that torch's copy
threads stop spinning before the next step starts (0: the step follows at once, as in a
training loop where the pack follows the optimizer's torch calls).
"""

from __future__ import annotations

import argparse
import os
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


def pack_pieces(layout: Layout, weights: Mapping[str, torch.Tensor], data: torch.Tensor) -> int:
    """This function's first commit pack: torch copies each 4 MiB piece, then one thread
    sums it (not fused)."""
    views = layout.tensor_views({"cpu": data})
    total, written = 0, 0
    for name in layout.names:
        dst, src = views[name].reshape(-1), weights[name].reshape(-1)
        step = _PIECE // dst.element_size()
        for start in range(0, dst.numel(), step):
            piece = dst[start:start + step]
            piece.copy_(src[start:start + step])
            size = piece.numel() * piece.element_size()
            total += ck.share(piece, written, parallel=False)
            written += size
    return total


def medians(steps: list[Callable[[], object]], floor: Callable[[], object], repeats: int,
            gap: float) -> list[tuple[float, float]]:
    """(median ms, median ms of the memcpy right after it) of each step, the steps taken
    in turn ``repeats`` times, after one warm-up each."""
    for step in steps:
        step()
        floor()
    times: list[list[float]] = [[] for _ in steps]
    floors: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for k, step in enumerate(steps):
            time.sleep(gap)
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            floor()
            t2 = time.perf_counter()
            times[k].append(t1 - t0)
            floors[k].append(t2 - t1)
    return [(statistics.median(t) * 1e3, statistics.median(f) * 1e3)
            for t, f in zip(times, floors, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="megabytes (10**6 bytes)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle milliseconds after each memcpy, before the next step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gap = args.gap_ms / 1e3
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
          f"numba kernel: {ck.accelerated()}, gap {args.gap_ms} ms, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    pairs: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("checksum alone", lambda: word_sum(src), lambda: ck.checksum(src)),
        ("commit pack (copy + checksum)", lambda: pack_word_sums(layout, weights, slot),
         lambda: pack_with_checksums(layout, weights, slot)),
        ("verify (`bucket_checksums`)", lambda: word_sum(slot), lambda: bucket_checksums(layout, slot)),
    ]
    extra: list[tuple[str, Callable[[], object]]] = [
        ("unfused pack: torch copies a piece, one thread sums it",
         lambda: pack_pieces(layout, weights, slot)),
    ]
    steps = [step for _, old, new in pairs for step in (old, new)] + [step for _, step in extra]
    results = medians(steps, memcpy, args.repeats, gap)
    print("| step | word sum: ms | memcpy ms | x memcpy | lane32-weighted-v1: ms | memcpy ms | x memcpy |")
    print("|---|---|---|---|---|---|---|")
    for k, (name, _, _) in enumerate(pairs):
        (old, old_floor), (new, new_floor) = results[2 * k], results[2 * k + 1]
        print(f"| {name} | {old:.1f} | {old_floor:.1f} | {old / old_floor:.2f} | {new:.1f} | "
              f"{new_floor:.1f} | {new / new_floor:.2f} |")
    for (name, _), (ms, floor) in zip(extra, results[2 * len(pairs):], strict=True):
        print(f"| {name} | | | | {ms:.1f} | {floor:.1f} | {ms / floor:.2f} |")
    ms, floor = medians([lambda: ck.torch_share(src)], memcpy, max(1, args.repeats // 5), gap)[0]
    print(f"| checksum alone, torch fallback (no numba) | | | | {ms:.1f} | {floor:.1f} | {ms / floor:.2f} |")
    if torch.cuda.is_available():
        gpu_src = src.cuda()
        gpu_dst = torch.empty_like(gpu_src)

        def gpu_copy() -> None:
            gpu_dst.copy_(gpu_src)
            torch.cuda.synchronize()

        assert ck.checksum(gpu_src) == ck.checksum(src)
        assert ck.checksum(gpu_src[3:]) == ck.checksum(src[3:])
        ms, floor = medians([lambda: ck.checksum(gpu_src)], gpu_copy, args.repeats, gap)[0]
        print(f"| checksum on {torch.cuda.get_device_name()} (torch; device copy as the floor) | | | | "
              f"{ms:.1f} | {floor:.1f} | {ms / floor:.2f} |")


if __name__ == "__main__":
    main()
