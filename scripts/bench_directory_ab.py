"""The directory's commit (``update_weights``) and a copy-mode reader's apply (``poll``) at
400 MB (``--mb``) of random fp32 in /dev/shm, each beside a memcpy of the same size timed right after
it in the same round: the figure is the median over rounds of each round's ratio, so a
neighbour's load that slows a whole round cancels out.

``python scripts/bench_directory_ab.py`` measures the build on ``PYTHONPATH``.
``python scripts/bench_directory_ab.py --builds A/src B/src --runs 8`` runs each build's
``src`` (e.g. a ``git worktree`` of an older commit) in a fresh process, in turn, ``--runs``
times, and prints each build's runs and the median of its runs' figures."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(nbytes: int, rounds: int, warm: int) -> dict[str, float]:
    """Time ``rounds`` commits and applies of ``nbytes`` in this process: the medians of
    each round's ratio to its memcpy, and the medians in ms."""
    import torch

    from weightsync import VLLMDoubleBufferSyncScheme
    from weightsync.bench.local import make_model

    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    weights = dict(make_model(nbytes).state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in weights.values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
    scheme = VLLMDoubleBufferSyncScheme(root / "slots", num_workers=1)
    sender = scheme.create_sender()
    sender.register_model(weights)
    receiver = scheme.create_receiver(0)
    receiver.register_model(make_model(nbytes))
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    commit, apply, memcpy_c, memcpy_a = [], [], [], []
    try:
        for i in range(warm + rounds):
            t0 = time.perf_counter()
            sender.update_weights()
            t1 = time.perf_counter()
            dst.copy_(src)
            t2 = time.perf_counter()
            receiver.poll()
            t3 = time.perf_counter()
            dst.copy_(src)
            t4 = time.perf_counter()
            if i >= warm:
                commit.append(t1 - t0)
                memcpy_c.append(t2 - t1)
                apply.append(t3 - t2)
                memcpy_a.append(t4 - t3)
    finally:
        receiver.close()
        sender.close()
        shutil.rmtree(root, ignore_errors=True)
    m = statistics.median
    return {
        "commit_x": m([c / b for c, b in zip(commit, memcpy_c, strict=True)]),
        "apply_x": m([a / b for a, b in zip(apply, memcpy_a, strict=True)]),
        "commit_ms": m(commit) * 1e3,
        "apply_ms": m(apply) * 1e3,
        "memcpy_ms": m(memcpy_c + memcpy_a) * 1e3,
    }


def line(figures: dict[str, float]) -> str:
    return (f"commit {figures['commit_x']:.2f}x memcpy ({figures['commit_ms']:.1f} ms)  "
            f"apply {figures['apply_x']:.2f}x ({figures['apply_ms']:.1f} ms)  "
            f"memcpy {figures['memcpy_ms']:.1f} ms")


def compare(builds: list[str], runs: int, args: list[str]) -> None:
    """Each build in a fresh process, in turn; each build's runs, then their medians."""
    found: list[list[dict[str, float]]] = [[] for _ in builds]  # a build named twice: twice
    for run in range(runs):
        for index, build in enumerate(builds):
            env = dict(os.environ, PYTHONPATH=str(Path(build).resolve()))
            out = subprocess.run([sys.executable, __file__, *args, "--json"], env=env, check=True,
                                 capture_output=True, text=True, timeout=600).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            found[index].append(figures)
            print(f"run {run + 1} {build}: {line(figures)}", flush=True)
    for build, all_runs in zip(builds, found, strict=True):
        keys = all_runs[0].keys()
        med = {key: statistics.median(r[key] for r in all_runs) for key in keys}
        spread = {key: (min(r[key] for r in all_runs), max(r[key] for r in all_runs))
                  for key in ("commit_x", "apply_x")}
        print(f"{build}: median of {runs} runs: {line(med)}; commit {spread['commit_x'][0]:.2f}-"
              f"{spread['commit_x'][1]:.2f}x, apply {spread['apply_x'][0]:.2f}-"
              f"{spread['apply_x'][1]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", nargs="*", help="src folders to compare, in turn")
    parser.add_argument("--runs", type=int, default=6, help="processes per build (--builds)")
    parser.add_argument("--mb", type=int, default=400, help="model size, MB (10**6 bytes)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.builds:
        compare(args.builds, args.runs,
                ["--mb", str(args.mb), "--rounds", str(args.rounds), "--warm", str(args.warm)])
        return
    figures = measure(args.mb * 1_000_000, args.rounds, args.warm)
    print(json.dumps(figures) if args.json else line(figures))


if __name__ == "__main__":
    main()
