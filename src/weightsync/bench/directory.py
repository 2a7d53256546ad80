"""The double-buffered directory, timed: ``update_weights()`` into preallocated slots and
a receiver's apply, beside a memcpy and a plain copy into the same file system's pages, and
the naive alternative of memmapping fresh files for every update."""

from __future__ import annotations

import contextlib
import mmap
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from weightsync.bench.local import make_model
from weightsync.bench.rows import BenchRow, make_row


def bench_directory(nbytes: int, where: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per ``update_weights()`` into preallocated slots in ``where``, per receiver
    apply, and per update that writes fresh memmap files into a new directory instead."""
    import shutil
    import tempfile

    from tensordict import TensorDict

    from weightsync import VLLMDoubleBufferSyncScheme

    root = Path(tempfile.mkdtemp(prefix="weightsync-bench-", dir=where))
    weights = dict(make_model(nbytes, fill=1.0).state_dict())
    local = make_model(nbytes)
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
    size: str, nbytes: int, places: Mapping[str, str], repeats: int,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Rows for update, apply, fresh files and a plain mapped copy in each of ``places``."""
    rows = []
    for label, where in places.items():
        if progress:
            progress(f"file {label} {size}")
        measured = bench_directory(nbytes, where, repeats)
        floor = statistics.median(measured.pop("memcpy"))
        rows += [make_row(f"file {phase} ({label})", size, nbytes, 1, times, floor)
                 for phase, times in measured.items()]
    return rows
