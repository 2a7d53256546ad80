"""The in-flight figures of the ``vllm-serve`` bench: three streams generate on the server
while the trainer sends a version every few seconds (full, then deltas, then vLLM's
``pause?mode=wait`` recipe), and each token's arrival is timed at the client:

* the baseline: the gap between tokens (p99) and tokens/s with no update;
* per update kind, the longest time with no token on any stream around each update;
* the take alone (the server's pause to resume, ``stats()["last"]["take_seconds"]``) against
  a memcpy of the served bytes measured in the same run;
* tokens/s with the updates, as a ratio to the baseline;
* the server host's staging memory (its private ``/dev/shm``) against the served bytes.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
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

    def tokens(self) -> int:
        return sum(n for stream in self.chunks for _, n in stream)

    def stream_gaps(self) -> list[float]:
        """Gaps between consecutive chunks of each stream."""
        return [b[0] - a[0] for stream in self.chunks for a, b in itertools.pairwise(stream)]


def _stream(url: str, index: int, stop: threading.Event, arrivals: Arrivals) -> None:
    """One client: streamed requests one after another until ``stop``; each chunk's
    arrival is noted."""
    import requests

    seed = index
    while not stop.is_set():
        seed += len(PROMPTS)
        body: dict[str, Any] = {
            "token_ids": PROMPTS[index], "stream": True,
            "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 1.0, "seed": seed,
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
    baseline_tps: float = 0.0
    stalls: dict[str, list[float]] = field(default_factory=dict)
    takes: dict[str, list[float]] = field(default_factory=dict)
    #: per update kind, each step of the takes (pause, load, label, reset, resume)
    phases: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    sends: dict[str, list[float]] = field(default_factory=dict)
    tps: dict[str, float] = field(default_factory=dict)
    memcpy: float = 0.0
    staging_bytes: int = 0
    failures: list[str] = field(default_factory=list)


def _staging_bytes(server: Any) -> int:
    """Bytes in use on the server host's private ``/dev/shm`` (its mount namespace, seen
    through the server process's root)."""
    proc = getattr(server, "proc", None)
    try:
        stat = os.statvfs(f"/proc/{proc.pid}/root/dev/shm") if proc is not None else None
    except OSError:
        return 0
    return 0 if stat is None else (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def measure_in_flight(server: Any, model: torch.nn.Module, step: Callable[[], float],
                      make_engine: Callable[..., Any], rate: str, updates: int,
                      interval: float, progress: Callable[[str], None] | None) -> InFlight:
    """The in-flight figures at one link rate: ``updates`` versions of each kind, one every
    ``interval`` seconds, under three streams; ``step()`` changes the model like an
    optimizer step; ``make_engine(delta=..., pause=...)`` starts a trainer session."""
    served = sum(p.numel() * p.element_size() for p in model.parameters())
    out = InFlight(rate, served, memcpy=memcpy_floor(served))
    if progress:
        progress(f"vllm-serve in-flight baseline {rate}")
    with Streams(server.url) as idle:
        time.sleep(interval * 2)
    out.baseline_p99_gap = percentile(idle.arrivals.stream_gaps(), 0.99)
    out.baseline_tps = idle.arrivals.tokens() / (idle.ended - idle.started)
    out.failures += idle.arrivals.failures
    for kind, delta, pause in (("full", False, "keep"), ("delta", True, "keep"),
                               ("pause=wait", True, "wait")):
        if progress:
            progress(f"vllm-serve in-flight {kind} {rate}")
        engine = make_engine(delta=delta, pause=pause)
        windows: list[tuple[float, float]] = []
        try:
            with Streams(server.url) as streams:
                for _ in range(updates):
                    time.sleep(interval)
                    step()
                    started = time.perf_counter()
                    engine.send_weights()
                    windows.append((started, time.perf_counter()))
                    last = engine.stats()["last"]
                    out.takes.setdefault(kind, []).extend(last["take_seconds"].values())
                    for steps in last["take_phases"].values():
                        for name, seconds in steps.items():
                            out.phases.setdefault(kind, {}).setdefault(name, []).append(seconds)
                    out.sends.setdefault(kind, []).append(windows[-1][1] - started)
                time.sleep(1.0)
            out.staging_bytes = max(out.staging_bytes, _staging_bytes(server))
        finally:
            engine.shutdown()
        merged = streams.arrivals.merged()
        out.stalls[kind] = [longest_stall(merged, a, b) for a, b in windows]
        out.tps[kind] = streams.arrivals.tokens() / (streams.ended - streams.started)
        out.failures += streams.arrivals.failures
    return out


def in_flight_table(figures: list[InFlight]) -> str:
    """The in-flight figures of every rate, one row per update kind."""
    lines = ["| link | update | longest stall per update: median / max | target | take: "
             "median | x memcpy | take's steps: median | send_weights: median | "
             "tokens/s x no updates |", "|" + "---|" * 9]
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
                f"{f.tps[kind] / f.baseline_tps:.2f} |")
    notes = [f"{f.rate}: baseline p99 gap between tokens {format_duration(f.baseline_p99_gap)}, "
             f"{f.baseline_tps:.1f} tokens/s with no update; memcpy of the {f.served_bytes / 1e6:.0f}"
             f" MB served {format_duration(f.memcpy)}; the server host's /dev/shm after the "
             f"updates {f.staging_bytes / 1e6:.0f} MB ({f.staging_bytes / f.served_bytes:.2f}x "
             f"the served bytes); failed requests: {len(f.failures)}" for f in figures]
    return "\n".join([*lines, "", *notes]) + "\n"
