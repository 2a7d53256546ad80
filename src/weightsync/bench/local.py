"""SharedMem, MultiProcess and the network scheme (on loopback), timed as a user feels
them: until ``send()`` returns (the version is published) and until every worker's model
holds it (applied in ``poll()``).

Workers act like collectors: a short environment step, then ``poll()``; with a step of 0
they act like a user who wants each version at once and block in ``receive()`` (woken by
the trainer as it publishes). Each records in a shared array the version it applied, when
(``CLOCK_MONOTONIC``, the same clock in every process) and how long the ``poll()`` that
applied it took (a blocking ``receive()`` mostly waits, so it has no such row)."""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.bench.floors import (
    join_or_kill,
    memcpy_floor,
    pipe_times,
    socket_times,
    wake_times,
)
from weightsync.bench.rows import BenchRow, make_row
from weightsync.transports.mp.pipe import MIN_PAYLOAD_BYTES

logger = logging.getLogger(__name__)

#: how each worker's slot in the shared array is laid out
_VERSION, _APPLIED_AT, _POLL_SECONDS, _SLOT = 0, 1, 2, 3
#: the longest wait for every worker to apply one version before the run is declared stuck
APPLY_DEADLINE_S = 120.0


def make_model(nbytes: int, fill: float = 0.0, device: str = "cpu") -> torch.nn.Module:
    """A module of fp32 weights adding up to ``nbytes`` in up to 50 layers, like a model's."""
    numel = max(1, nbytes // 4)
    pieces = max(1, min(50, numel // (1 << 16)))
    sizes = [numel // pieces] * pieces
    sizes[-1] += numel - sum(sizes)
    model = torch.nn.Module()
    for i, n in enumerate(sizes):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.full((n,), fill, device=device), requires_grad=False)
        model.add_module(f"layer{i}", layer)
    return model


def supports_zero_copy(scheme: Any) -> bool:
    """Whether ``scheme.create_receiver`` takes ``zero_copy=`` (SharedMem's opt-in views)."""
    return "zero_copy" in inspect.signature(scheme.create_receiver).parameters


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _bench_worker(scheme: Any, idx: int, nbytes: int, zero_copy: bool, step_s: float,
                  device: str, stop: Any, ready: Any, applied: Any) -> None:
    """A collector: step, then ``poll()`` (``step_s`` 0: block in ``receive()``); record
    each version it applies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops us; Ctrl-C is its to handle
    from weightsync.core.errors import WeightSyncError

    torch.set_num_threads(1)
    try:
        receiver = (scheme.create_receiver(idx, zero_copy=True) if zero_copy
                    else scheme.create_receiver(worker_idx=idx))
        receiver.register_model(make_model(nbytes, device=device))
        receiver.connect(timeout=300)
    except Exception as exc:  # reported by the trainer, which skips this configuration
        ready.put((idx, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((idx, None))
    base = _SLOT * idx
    while not stop.value:  # a plain shared byte: an Event's lock would cost every loop
        if step_s > 0:
            time.sleep(step_s)
        t0 = _now()
        try:
            version = receiver.poll() if step_s > 0 else receiver.receive(timeout=0.2)
        except WeightSyncError:  # the trainer closed: the run is over
            break
        if version is not None:
            t1 = _now()
            applied[base + _APPLIED_AT] = t1
            applied[base + _POLL_SECONDS] = t1 - t0 if step_s > 0 else -1.0
            applied[base + _VERSION] = version  # last: the trainer reads it first
    receiver.close()


@dataclass
class LocalTimes:
    """Seconds per send of one configuration, per phase."""

    publish: list[float] = field(default_factory=list)
    applied: list[float] = field(default_factory=list)
    apply_in_worker: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)  # one copy of the same bytes per send
    skipped: str | None = None  # why this configuration did not run


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench_local(transport: str, nbytes: int, workers: int, repeats: int, floor: float,
                zero_copy: bool = False, step_s: float = 0.001, device: str = "cpu") -> LocalTimes:
    """Time ``repeats`` sends to ``workers`` collector processes through ``transport``, and
    before each send one copy of the same bytes in the trainer (the floor, taken under the
    same load: the workers are running). ``floor`` is a first estimate, for pacing."""
    from weightsync.schemes.registry import scheme_class

    scheme = scheme_class(transport)(num_workers=workers, timeout=300)
    if zero_copy and not supports_zero_copy(scheme):
        return LocalTimes(skipped="this build's SharedMem receivers take no zero_copy=")
    ctx = mp.get_context("spawn")
    stop, ready = ctx.RawValue("b", 0), ctx.Queue()
    applied = ctx.RawArray("d", _SLOT * workers)
    for w in range(workers):
        applied[_SLOT * w + _VERSION] = -1
    procs = [ctx.Process(target=_bench_worker, daemon=True,
                         args=(scheme, i, nbytes, zero_copy, step_s, device, stop, ready, applied))
             for i in range(workers)]
    for p in procs:
        p.start()
    result = LocalTimes()
    copy_src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    copy_dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    try:
        with scheme.create_sender() as sender:
            sender.register_model(make_model(nbytes, fill=1.0, device=device))
            sender.connect(timeout=300)
            errors = [error for _, error in (ready.get(timeout=300) for _ in range(workers))
                      if error is not None]
            if errors:
                return LocalTimes(skipped=errors[0])
            for i in range(repeats + 1):
                # a training step between sends: the trainer keeps its core busy (a sleep
                # would measure a cold CPU) while the workers apply the previous version
                _busy(0.005 + 3 * floor * workers)
                result.floor.append(_timed_copy(copy_dst, copy_src))
                t0 = _now()
                version = sender.send(timeout=300)
                t1 = _now()
                _wait_applied(applied, workers, version, procs)
                if i:  # the first send (and copy) warms up page tables and buffers
                    result.publish.append(t1 - t0)
                    result.applied.append(
                        max(applied[_SLOT * w + _APPLIED_AT] for w in range(workers)) - t0)
                    result.apply_in_worker += [applied[_SLOT * w + _POLL_SECONDS]
                                               for w in range(workers)
                                               if applied[_SLOT * w + _POLL_SECONDS] >= 0]
            _stop_workers(stop, procs)  # they say goodbye before the sender closes
    finally:
        _stop_workers(stop, procs)
    result.floor = result.floor[1:]
    return result


def _stop_workers(stop: Any, procs: Sequence[Any]) -> None:
    stop.value = 1
    join_or_kill(procs, 30)


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of one ``dst.copy_(src)``, waiting for the device if it is a GPU."""
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)
    t0 = _now()
    dst.copy_(src)
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)
    return _now() - t0


def _wait_applied(applied: Any, workers: int, version: int, procs: Sequence[Any]) -> None:
    """Until every worker's shared slot says it applied ``version``."""
    deadline = time.monotonic() + APPLY_DEADLINE_S
    for w in range(workers):
        while applied[_SLOT * w + _VERSION] < version:
            if not procs[w].is_alive():
                raise RuntimeError(f"bench worker {w} died (exit code {procs[w].exitcode}) "
                                   f"before applying version {version}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench worker {w} did not apply version {version} within "
                                   f"{APPLY_DEADLINE_S:.0f} s")
            time.sleep(0.0001)


def run_bench(
    transports: Sequence[str], sizes: Sequence[tuple[str, int]], worker_counts: Sequence[int],
    repeats: int = 10, progress: Callable[[str], None] | None = None,
    shm_modes: Sequence[str] = ("copy", "zero-copy"), step_s: float = 0.001,
    device: str = "cpu", notes: list[str] | None = None,
) -> list[BenchRow]:
    """Rows for every (size, transport, mode, workers): publish, applied everywhere and the
    apply inside a worker, each against the median of one copy of the same bytes per send.
    ``sizes`` holds (label, bytes) pairs; reasons for skipped configurations go to ``notes``."""
    torch.set_num_threads(1)
    floor_name = "memcpy" if device == "cpu" else "device copy"
    rows: list[BenchRow] = []
    if notes is not None:
        notes.append("workers " + (f"step {step_s * 1e3:g} ms, then poll()" if step_s > 0 else
                                   "block in receive(), woken as each version arrives"))
    for size, nbytes in sizes:
        for transport in transports:
            modes = shm_modes if transport == "shm" else ("copy",)
            for mode in modes:
                label = transport if mode == "copy" else f"{transport} {mode}"
                for n in worker_counts:
                    if progress:
                        progress(f"{label} {size} x{n}")
                    floor = memcpy_floor(nbytes, device=device)
                    times = bench_local(transport, nbytes, n, repeats, floor,
                                        zero_copy=mode == "zero-copy", step_s=step_s, device=device)
                    if times.skipped:
                        if notes is not None:
                            notes.append(f"{label} {size} x{n} skipped: {times.skipped}")
                        logger.info("%s %s x%d skipped: %s", label, size, n, times.skipped)
                        break  # the other worker counts would fail the same way
                    floor = statistics.median(times.floor)
                    for phase, values in (("publish", times.publish),
                                          ("applied everywhere", times.applied),
                                          ("apply in worker", times.apply_in_worker)):
                        if not values:  # workers blocked in receive(): no apply time of its own
                            continue
                        rows.append(make_row(f"{label} {phase}", size, nbytes, n, values, floor,
                                             floor_name))
            if transport == "shm" and step_s <= 0 and device == "cpu":
                rows += _publish_and_wake_floors(size, nbytes, worker_counts, repeats)
            if transport == "net":  # what loopback TCP alone costs, beside the same memcpy
                samples = socket_times(nbytes, repeats=max(5, min(repeats, 20)), tcp=True)
                rows.append(make_row("net floor: bare TCP loopback transfer", size, nbytes, 1,
                                     samples, memcpy_floor(nbytes)))
            if transport == "mp":  # what the socket alone costs, beside the same memcpy
                floor = memcpy_floor(nbytes)
                samples = socket_times(nbytes, repeats=max(5, min(repeats, 20)))
                rows.append(make_row("mp floor: bare Unix-socket transfer", size, nbytes, 1,
                                     samples, floor))
                piped = (pipe_times(nbytes, repeats=max(5, min(repeats, 20)))
                         if nbytes >= MIN_PAYLOAD_BYTES else None)  # large versions' path
                if piped:
                    rows.append(make_row("mp floor: bare page-mapping pipe transfer", size,
                                         nbytes, 1, piped, floor))
    return rows


def _publish_and_wake_floors(size: str, nbytes: int, worker_counts: Sequence[int],
                             repeats: int) -> list[BenchRow]:
    """The machine's floor of "applied everywhere" when the workers block in ``receive()``:
    one copy of the bytes into shared memory, then one wake of that many blocked processes
    until the last one runs (same run; none without futex)."""
    rows = []
    for n in worker_counts:
        samples = wake_times(n, repeats=max(10, repeats), nbytes=nbytes)
        if samples:
            rows.append(make_row("shm floor: one copy, then wake the blocked workers", size,
                                 nbytes, n, samples, memcpy_floor(nbytes)))
    return rows
