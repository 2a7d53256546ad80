"""Time the numba checksum kernels on one thread, by data size: GB/s of the sum
(``range_share``, a reader's verify) and of the fused copy (``copy_share``, the commit
pack), the best of many runs (the least disturbed on a shared machine), beside torch's
int64 word sum of the same bytes. Small sizes stay in cache and show the kernels' own
speed; large ones show memory's.

Run: ``PYTHONPATH=src python scripts/bench_checksum_kernels.py [--mib 4 64]``
(docs/performance.md quotes it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weightsync.core import checksum as ck


def best_seconds(step: Callable[[], object], nbytes: int, tries: int = 25) -> float:
    """The fastest of ``tries`` timings of ``step``, each over enough calls for 64 MiB."""
    calls = max(3, (64 << 20) // nbytes)
    step()
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def steps(raw: np.ndarray, range_share: Any, copy_share: Any,
          lanes: np.ndarray) -> list[Callable[[], object]]:
    """The sum, the fused copy and torch's word sum of ``raw``."""
    size = raw.shape[0]
    out = np.empty_like(raw)
    words = torch.from_numpy(raw).view(torch.int64)
    return [lambda: range_share(raw, 0, size, 0, lanes, ck.BLOCK_LANES, ck.BLOCK_SEED),
            lambda: copy_share(raw, out, 0, lanes, ck.BLOCK_LANES, ck.BLOCK_SEED),
            lambda: words.sum()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 64], help="data sizes in MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = ck._kernels()
    if kernels is None:
        raise SystemExit("numba is not installed: there are no kernels to time")
    range_share, _, lanes, copy_share = kernels
    print("| data | sum GB/s | fused copy GB/s | torch word sum GB/s |")
    print("|---|---|---|---|")
    for mib in args.mib:
        size = mib << 20
        raw = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        rates = [size / best_seconds(step, size) / 1e9
                 for step in steps(raw, range_share, copy_share, lanes)]
        print(f"| {mib} MiB | " + " | ".join(f"{rate:.1f}" for rate in rates) + " |")

if __name__ == "__main__":
    main()
