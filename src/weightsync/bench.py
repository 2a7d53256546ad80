"""``weightsync bench``: time ``send()`` until every worker has the version delivered, beside
one memcpy of the same bytes measured in the same run (the machine's floor)."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SIZES = {"1MB": 1 << 20, "400MB": 400 * 1000 * 1000}


@dataclass
class BenchRow:
    transport: str
    size: str
    nbytes: int
    workers: int
    median_ms: float
    p90_ms: float
    gbps: float
    memcpy_ms: float
    ratio: float  # median / one memcpy of the same bytes

    @property
    def ratio_per_worker(self) -> float:
        return self.ratio / self.workers


def make_weights(nbytes: int, fill: float = 0.0) -> dict[str, torch.Tensor]:
    """fp32 tensors adding up to ``nbytes`` (in up to 50 pieces, like a model's layers)."""
    numel = nbytes // 4
    pieces = max(1, min(50, numel // (1 << 16)))
    sizes = [numel // pieces] * pieces
    sizes[-1] += numel - sum(sizes)
    return {f"layer{i}.weight": torch.full((n,), fill) for i, n in enumerate(sizes)}


def memcpy_floor(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of one copy of ``nbytes`` between two warm buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _bench_worker(scheme: Any, idx: int, nbytes: int, stop: Any, ready: Any) -> None:
    torch.set_num_threads(1)
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(make_weights(nbytes))
    receiver.connect(timeout=120)
    ready.put(idx)
    while not stop.is_set():  # a collector: a short env step, then poll() for new weights
        time.sleep(0.001)
        try:
            receiver.poll()
        except Exception:  # the sender closed: the run is over
            break
    receiver.close()


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_local(
    transport: str, nbytes: int, workers: int, repeats: int, floor: float,
) -> list[float]:
    """Seconds of each ``send()`` to ``workers`` processes through ``transport``."""
    from weightsync import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    scheme_cls = {"shm": SharedMemWeightSyncScheme, "mp": MultiProcessWeightSyncScheme}[transport]
    scheme = scheme_cls(num_workers=workers, timeout=300)
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_bench_worker, args=(scheme, i, nbytes, stop, ready), daemon=True)
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    weights = make_weights(nbytes, fill=1.0)
    times = []
    try:
        with scheme.create_sender() as sender:
            sender.register_model(weights)
            sender.connect(timeout=300)
            for _ in range(workers):
                ready.get(timeout=300)
            for i in range(repeats + 1):
                # a training step between sends: the trainer keeps its core busy (a sleep
                # would measure a cold CPU), while the workers apply the previous version
                _busy(0.005 + 3 * floor * workers)
                t0 = time.perf_counter()
                sender.send(timeout=300)
                if i:  # the first send warms up page tables and buffers
                    times.append(time.perf_counter() - t0)
            stop.set()
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return times


def bench_directory(nbytes: int, where: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per ``update_weights()`` into preallocated slots in ``where``, per receiver
    apply, and per update that writes fresh memmap files into a new directory instead."""
    import shutil
    import tempfile

    from tensordict import TensorDict

    from weightsync import VLLMDoubleBufferSyncScheme

    root = Path(tempfile.mkdtemp(prefix="weightsync-bench-", dir=where))
    weights = make_weights(nbytes, fill=1.0)
    local = make_weights(nbytes)
    times: dict[str, list[float]] = {
        "update": [], "apply": [], "fresh files": [], "plain copy into a mapped file": [],
        "memcpy": [],
    }
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    mapped_path = root / "plain-copy.bin"
    with open(mapped_path, "wb") as fh:
        fh.truncate(nbytes)
    mapped_fh = open(mapped_path, "r+b")  # noqa: SIM115 - closed in the finally below
    mapped = mmap.mmap(mapped_fh.fileno(), nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    mapped_dst = torch.frombuffer(mapped, dtype=torch.uint8)
    try:
        scheme = VLLMDoubleBufferSyncScheme(root / "slots", num_workers=1)
        with scheme.create_sender() as sender:
            sender.register_model(weights)
            receiver = scheme.create_receiver(0)
            receiver.register_model(local)
            for i in range(repeats + 2):
                t0 = time.perf_counter()
                sender.update_weights()
                t1 = time.perf_counter()
                receiver.poll()
                t2 = time.perf_counter()
                dst.copy_(src)  # the floor, measured between the same steps
                t3 = time.perf_counter()
                mapped_dst.copy_(src)  # what a copy into this file system's pages costs
                t4 = time.perf_counter()
                if i > 1:  # both slots written once: warm
                    times["update"].append(t1 - t0)
                    times["apply"].append(t2 - t1)
                    times["memcpy"].append(t3 - t2)
                    times["plain copy into a mapped file"].append(t4 - t3)
            receiver.close()
        td = TensorDict(weights, batch_size=[])
        for i in range(min(repeats, 5) + 1):
            target = root / f"fresh-{i}"
            t0 = time.perf_counter()
            td.memmap(prefix=str(target))
            if i:
                times["fresh files"].append(time.perf_counter() - t0)
            shutil.rmtree(root / f"fresh-{i - 1}", ignore_errors=True)
    finally:
        del mapped_dst
        with contextlib.suppress(BufferError):
            mapped.close()
        mapped_fh.close()
        shutil.rmtree(root, ignore_errors=True)
    return times


def run_directory_bench(
    size: str, places: Mapping[str, str], repeats: int,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    nbytes = SIZES[size]
    rows = []
    for label, where in places.items():
        if progress:
            progress(f"file {label} {size}")
        measured = bench_directory(nbytes, where, repeats)
        floor = statistics.median(measured.pop("memcpy"))
        for phase, times in measured.items():
            median = statistics.median(times)
            rows.append(BenchRow(
                f"file {phase} ({label})", size, nbytes, 1, median * 1e3,
                _percentile(times, 0.9) * 1e3, nbytes / median / 1e9, floor * 1e3, median / floor,
            ))
    return rows


def run_bench(
    transports: Sequence[str], sizes: Sequence[str], worker_counts: Sequence[int],
    repeats: int = 10, progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    torch.set_num_threads(1)
    rows = []
    for size in sizes:
        nbytes = SIZES[size]
        for transport in transports:
            for n in worker_counts:
                floor = memcpy_floor(nbytes)
                if progress:
                    progress(f"{transport} {size} x{n}")
                times = bench_local(transport, nbytes, n, repeats, floor)
                median = statistics.median(times)
                rows.append(BenchRow(
                    transport, size, nbytes, n, median * 1e3, _percentile(times, 0.9) * 1e3,
                    nbytes / median / 1e9, floor * 1e3, median / floor,
                ))
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    head = ("| transport | size | workers | median ms | p90 ms | GB/s | memcpy ms | "
            "x memcpy | x memcpy per worker |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.transport} | {r.size} | {r.workers} | {r.median_ms:.3f} | {r.p90_ms:.3f} | "
            f"{r.gbps:.2f} | {r.memcpy_ms:.3f} | {r.ratio:.2f} | {r.ratio_per_worker:.2f} |"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[BenchRow], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) | {"ratio_per_worker": r.ratio_per_worker} for r in rows], fh, indent=2)
