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
    memcpy_ms: float  # the floor: one memcpy of the same bytes (Ray: one gloo p2p transfer)
    ratio: float  # median / floor

    @property
    def ratio_per_worker(self) -> float:
        return self.ratio / self.workers


def make_row(label: str, size: str, workers: int, times: Sequence[float], floor: float) -> BenchRow:
    """One table row: median and p90 of ``times`` (seconds) against ``floor`` (seconds)."""
    nbytes = SIZES[size]
    median = statistics.median(times)
    return BenchRow(label, size, nbytes, workers, median * 1e3, _percentile(times, 0.9) * 1e3,
                    nbytes / median / 1e9, floor * 1e3, median / floor)


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


def _socket_reader(sock: Any, nbytes: int, rounds: int) -> None:
    buffer = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        view = buffer
        while len(view):
            n = sock.recv_into(view)
            if n == 0:
                return
            view = view[n:]
        sock.sendall(b"k")


def socket_floor(nbytes: int, repeats: int = 3) -> float:
    """Median seconds to move ``nbytes`` from this process into another one's buffer over a
    bare Unix socket (no framing, no snapshot, no apply): MultiProcess's own floor here."""
    import socket

    from weightsync.transports.local_channel import _SOCKET_BUFFER

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (ours, theirs):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                end.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
    reader = mp.get_context("fork").Process(
        target=_socket_reader, args=(theirs, nbytes, repeats + 1), daemon=True)
    reader.start()
    payload = memoryview(bytearray(b"\1" * nbytes))
    times = []
    try:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            ours.sendall(payload)
            ours.recv(1)
            times.append(time.perf_counter() - t0)
    finally:
        ours.close()
        theirs.close()
        reader.join(30)
        if reader.is_alive():
            reader.kill()
    return statistics.median(times[1:])


def _bench_worker(scheme: Any, idx: int, nbytes: int, stop: Any, ready: Any) -> None:
    torch.set_num_threads(1)
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(make_weights(nbytes))
    receiver.connect(timeout=120)
    ready.put(idx)
    while not stop.is_set():  # a collector: a short env step, then poll() for new weights
        time.sleep(float(__import__("os").environ.get("POLL_S", "0.001")))
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
        rows += [make_row(f"file {phase} ({label})", size, 1, times, floor)
                 for phase, times in measured.items()]
    return rows


def _ray_bench_actor_class() -> Any:
    import ray

    from weightsync.integrations.ray import RayWeightReceiverMixin
    from weightsync.transports.ray import GroupInfo, WeightGroup

    @ray.remote(num_cpus=0)
    class BenchActor(RayWeightReceiverMixin):
        def __init__(self, scheme: Any, idx: int, nbytes: int) -> None:
            torch.set_num_threads(1)
            self.nbytes = nbytes
            self.weightsync_setup(scheme, idx, make_weights(nbytes), announce=False)
            self.p2p_buffer = torch.zeros(nbytes, dtype=torch.uint8)  # warm, like staging

        def apply(self) -> int:
            self.weightsync_receiver.poll()
            return self.weightsync_receiver.version

        def p2p_recv(self, info: dict[str, Any]) -> float:
            group = WeightGroup(GroupInfo(**info), 1)
            t0 = time.perf_counter()
            group.pg.recv([self.p2p_buffer], 0, 0).wait()
            return time.perf_counter() - t0

    return BenchActor


def bench_ray(
    nbytes: int, workers: int, repeats: int, node_local: bool = True,
) -> dict[str, list[float]]:
    """Seconds per Ray send (sender side), until every actor applied it, and per gloo
    point-to-point transfer of the same bytes (the floor), in one local Ray instance.
    ``node_local=False`` sends through the broadcast, as to actors on other nodes."""
    import datetime

    import ray
    import torch.distributed as dist

    from weightsync.schemes.ray import RayWeightSyncScheme
    from weightsync.transports.ray import GroupInfo, WeightGroup, node_address

    actor_cls = _ray_bench_actor_class()
    scheme = RayWeightSyncScheme(num_workers=workers, timeout=300, node_local=node_local)
    actors = [actor_cls.remote(scheme, i, nbytes) for i in range(workers)]
    weights = make_weights(nbytes, fill=1.0)
    times: dict[str, list[float]] = {"send": [], "applied": [], "p2p": []}
    try:
        with scheme.create_sender(actors) as sender:
            sender.register_model(weights)
            sender.connect(timeout=300)
            ray.get([a.apply.remote() for a in actors])
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                sender.send(timeout=300)
                t1 = time.perf_counter()
                ray.get([a.apply.remote() for a in actors])
                t2 = time.perf_counter()
                if i:
                    times["send"].append(t1 - t0)
                    times["applied"].append(t2 - t0)
        address = node_address()
        store = dist.TCPStore(address, 0, None, True, timeout=datetime.timedelta(seconds=120),
                              wait_for_workers=False)
        payload = torch.ones(nbytes, dtype=torch.uint8)
        for i in range(min(repeats, 5) + 1):
            info = GroupInfo(address, int(store.port), 2, 1000 + i, "gloo", {0: 1}, 120.0)
            ref = actors[0].p2p_recv.remote(info.__dict__)
            group = WeightGroup(info, 0, store=store)
            t0 = time.perf_counter()
            group.pg.send([payload], 1, 0).wait()
            ray.get(ref)
            if i:
                times["p2p"].append(time.perf_counter() - t0)
    finally:
        for actor in actors:
            ray.kill(actor)
    return times


def run_ray_bench(
    size: str, worker_counts: Sequence[int], repeats: int,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024)
    rows = []
    try:
        nbytes = SIZES[size]
        for path, node_local in (("node-local", True), ("broadcast", False)):
            for n in worker_counts:
                if progress:
                    progress(f"ray {path} {size} x{n}")
                measured = bench_ray(nbytes, n, repeats, node_local)
                floor = statistics.median(measured.pop("p2p"))
                rows += [make_row(f"ray {path} {phase} (vs gloo p2p)", size, n, times, floor)
                         for phase, times in measured.items()]
    finally:
        if started:
            ray.shutdown()
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
                rows.append(make_row(transport, size, n, times, floor))
            if transport == "mp":  # what the socket alone costs, beside the same memcpy
                floor = memcpy_floor(nbytes)
                rows.append(make_row("mp floor: 1 bare Unix-socket transfer", size, 1,
                                     [socket_floor(nbytes)], floor))
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    head = ("| transport | size | workers | median ms | p90 ms | GB/s | floor ms | "
            "x floor | x floor per worker |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.transport} | {r.size} | {r.workers} | {r.median_ms:.3f} | {r.p90_ms:.3f} | "
            f"{r.gbps:.2f} | {r.memcpy_ms:.3f} | {r.ratio:.2f} | {r.ratio_per_worker:.2f} |"
        )
    return "\n".join(lines)


def write_plot(rows: Sequence[BenchRow], path: str) -> str:
    """A horizontal bar per row: its median as a multiple of the floor measured beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.transport} {r.size} x{r.workers}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [r.ratio for r in rows], color="tab:blue")
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median / floor (memcpy; gloo p2p for ray), log scale")
    for i, r in enumerate(rows):
        ax.text(r.ratio, i, f" {r.median_ms:.3g} ms", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_json(rows: Sequence[BenchRow], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) | {"ratio_per_worker": r.ratio_per_worker} for r in rows], fh, indent=2)
