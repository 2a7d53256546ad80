"""``weightsync bench`` measures what users feel: publish and applied-everywhere times from
real worker processes, beside floors measured in the same run, in human units."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from weightsync.bench.floors import (
    copy_times,
    pipe_times,
    socket_times,
    split_copy_times,
    wake_times,
)
from weightsync.bench.local import bench_local, make_model, run_bench, supports_zero_copy
from weightsync.bench.plot import COLOURS, transport_of, write_plot
from weightsync.bench.rows import format_table, make_row
from weightsync.cli import main
from weightsync.schemes.shared_mem import SharedMemWeightSyncScheme
from weightsync.transports.memory.futex import supported
from weightsync.transports.mp.pipe import PipeWriter


def test_model_has_the_asked_size_in_layers():
    model = make_model(3_000_000)
    sizes = [p.numel() * 4 for p in model.parameters()]
    assert sum(sizes) == 3_000_000 and len(sizes) > 1
    assert all(name.startswith("layer") for name, _ in model.named_parameters())


def test_floors_are_several_samples():
    assert len(copy_times(1 << 20, repeats=4)) == 4
    assert len(socket_times(1 << 20, repeats=5)) == 5


def test_split_copy_floor_times_every_process_of_each_round():
    """Two real processes copy their halves at once: one span per round, from the first
    start to the last end."""
    times = split_copy_times(32 << 20, 2, repeats=3)
    assert len(times) == 3 and all(0 < t < 10 for t in times)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "mp"])
def test_every_worker_reports_the_version_it_applied(transport):
    times = bench_local(transport, 256_000, workers=2, repeats=4, floor=1e-4)
    assert times.skipped is None
    assert len(times.publish) == 4 and len(times.applied) == 4 and len(times.floor) == 4
    assert len(times.apply_in_worker) == 4 * 2  # one per worker and send
    assert all(t > 0 for t in times.publish + times.applied + times.apply_in_worker)


@pytest.mark.slow
def test_workers_blocked_in_receive_report_each_version_but_no_apply_time():
    """``--worker-step-ms 0``: workers block in ``receive()`` (woken as it is published), so the
    time until every worker holds a version is measured, and no "apply in worker" row."""
    times = bench_local("shm", 256_000, workers=2, repeats=3, floor=1e-4, step_s=0.0)
    assert times.skipped is None
    assert len(times.applied) == 3 and all(t > 0 for t in times.applied)
    assert times.apply_in_worker == []


@pytest.mark.slow
def test_zero_copy_rows_or_a_note_saying_why_not():
    times = bench_local("shm", 256_000, workers=1, repeats=3, floor=1e-4, zero_copy=True)
    if supports_zero_copy(SharedMemWeightSyncScheme(num_workers=1)):
        assert times.skipped is None and len(times.applied) == 3
    else:
        assert times.skipped is not None and "zero_copy" in times.skipped


@pytest.mark.slow
def test_cli_bench_prints_a_table_in_human_units_and_writes_json_and_chart(tmp_path, capsys):
    rows_path, chart = tmp_path / "rows.json", tmp_path / "chart.png"
    assert main(["bench", "--transports", "shm", "mp", "--sizes", "300KB", "--workers", "1",
                 "--repeats", "3", "--json", str(rows_path), "--plot", str(chart)]) == 0
    out = capsys.readouterr().out
    for label in ("shm publish", "shm applied everywhere", "shm apply in worker", "mp publish",
                  "mp applied everywhere", "mp floor: bare Unix-socket transfer"):
        assert f"| {label} | 300KB | " in out, out
    assert " ms " in out or " µs " in out
    rows = json.loads(rows_path.read_text())
    assert {r["nbytes"] for r in rows} == {300_000}
    floor_row = next(r for r in rows if r["transport"].startswith("mp floor"))
    assert floor_row["samples"] >= 5  # a median of several transfers, not one
    assert chart.read_bytes()[:4] == b"\x89PNG"


def test_table_rows_in_human_units():
    row = make_row("shm publish", "400MB", 400_000_000, 2, [0.036, 0.034, 0.035], 0.040)
    line = format_table([row]).splitlines()[-1]
    assert line.startswith("| shm publish | 400MB | 2 | 35.0 ms | ")
    assert "40.0 ms memcpy | 0.88 | 0.44 |" in line


def test_chart_has_a_colour_per_transport(tmp_path):
    labels = ["shm publish", "shm zero-copy applied everywhere", "mp publish",
              "mp floor: bare Unix-socket transfer", "ray node-local send", "file update (/dev/shm)"]
    keys = [transport_of(label) for label in labels]
    assert keys == ["shm", "shm zero-copy", "mp", "mp floor", "ray node-local", "file"]
    assert len({COLOURS[k] for k in keys}) == len(keys)
    rows = [make_row(label, "1MB", 10**6, 1, [0.001], 0.0005) for label in labels]
    assert write_plot(rows, str(tmp_path / "c.png")) == str(tmp_path / "c.png")


def test_bench_runs_without_the_demo_extra(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m.split(".")[0] in ("rich", "matplotlib")]:
        monkeypatch.delitem(sys.modules, name)  # loaded by an earlier test
    for name in ("rich", "rich.console", "rich.progress", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # what an uninstalled module looks like
    assert main(["bench", "--transports", "file", "--sizes", "100KB", "--repeats", "2",
                 "--disk-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "[1/2] measuring file /dev/shm 100KB..." in captured.err
    assert "| file update (/dev/shm) | 100KB | 1 |" in captured.out
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone


@pytest.mark.slow
def test_receive_loop_rows_hold_the_copy_and_wake_floor_measured_in_the_same_run():
    """Blocked workers: per worker count, a floor row of one copy of the bytes into shared
    memory followed by one wake of that many blocked processes until the last runs (the
    least "applied everywhere" can cost in that loop)."""
    rows = run_bench(["shm"], [("64KB", 64_000)], [1, 2], repeats=2, shm_modes=("copy",),
                     step_s=0.0)
    floors = [r for r in rows if r.transport.startswith("shm floor")]
    if not supported():
        assert floors == []
        return
    assert [(r.size, r.workers, r.samples) for r in floors] == [("64KB", 1, 10), ("64KB", 2, 10)]
    assert all(r.median_ms > 0 and r.floor == "memcpy" for r in floors)
    copied = wake_times(2, repeats=3, nbytes=1 << 20)
    woken = wake_times(2, repeats=3)
    for samples in (copied, woken):
        assert samples is not None and len(samples) == 3 and all(0 < t < 5 for t in samples)


def test_pipe_floor_times_each_transfer_where_such_a_pipe_exists():
    """The "bare page-mapping pipe" floor: what MultiProcess's large versions travel
    through, timed alone (None where the platform has no such pipe)."""
    samples = pipe_times(20_000_000, repeats=3)
    opened = PipeWriter.open()
    if opened is None:
        assert samples is None
        return
    opened[0].close()
    os.close(opened[1])
    assert samples is not None and len(samples) == 3 and all(t > 0 for t in samples)


def test_the_vllm_serve_bench_model_is_llama_shaped_and_sized():
    pytest.importorskip("transformers")
    import torch
    import transformers

    from weightsync.bench.vllm_serve import llama_config

    for nbytes in (40_000_000, 400_000_000):
        config = llama_config(nbytes)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        fp32 = sum(p.numel() for p in model.parameters()) * 4
        assert 0.8 * nbytes < fp32 < 1.2 * nbytes, (nbytes, fp32)


def test_the_in_flight_stall_is_the_longest_silence_around_an_update():
    """Token arrivals merged over the streams: the longest gap that overlaps the update's
    window counts, including the gap that straddles its start or end."""
    from weightsync.bench.vllm_inflight import InFlight, in_flight_table, longest_stall

    arrivals = [0.0, 0.1, 0.2, 1.0, 1.05, 1.1, 3.0]
    assert longest_stall(arrivals, 0.5, 0.9) == pytest.approx(0.8)  # 0.2 -> 1.0
    assert longest_stall(arrivals, 1.02, 1.08) == pytest.approx(0.05)
    assert longest_stall(arrivals, 1.2, 1.3) == pytest.approx(1.9)  # 1.1 -> 3.0
    figures = InFlight("1gbit", 400_000_000, baseline_p99_gap=0.05,
                       stalls={"full": [0.2, 0.3]}, takes={"full": [0.15]},
                       phases={"full": {"load": [0.1], "resume": [0.01]}},
                       sends={"full": [2.0]}, tps={"full": 95.0}, memcpy=0.05,
                       periods={"full": 5.5, "delta": 5.0}, quiet_tps={"full": 100.0},
                       pair_ratios={"full": [0.9, 1.0, 0.8]})
    figures.stalls["delta"], figures.sends["delta"], figures.tps["delta"] = [0.1], [1.0], 108.0
    figures.quiet_tps["delta"] = 120.0
    table = in_flight_table([figures])
    row = "| 1gbit | full | 250 ms / 300 ms | 300 ms | 150 ms | 3.0 | load 100 ms, resume 10.0 ms |"
    assert row in table, table
    # the update windows' length, their tokens/s against the quiet windows', the pairs' spread
    assert "| 5.5 s | 95 / 100 (0.95; per pair 0.90, 0.80-1.00) |" in table, table
    assert "| 5.0 s | 108 / 120 (0.90; per pair none) |" in table, table


def test_update_windows_alternate_with_quiet_windows_of_the_same_length(monkeypatch):
    """Each update opens a window of ``interval`` seconds (longer when its send runs past
    it, plus the settling second), a quiet window of ``interval`` follows, and each kind's
    tokens/s counts only its own windows' tokens."""
    from weightsync.bench import vllm_inflight

    clock = types.SimpleNamespace(now=0.0)
    # the module's own clock, not the process's: pytest keeps its time.perf_counter
    monkeypatch.setattr(vllm_inflight, "time", types.SimpleNamespace(
        perf_counter=lambda: clock.now,
        sleep=lambda seconds: setattr(clock, "now", clock.now + seconds)))
    sends = iter([7.0, 1.0] * 3)  # the first update of each kind is slow (a session's first)
    sent_windows: list[tuple[float, float]] = []

    class Engine:
        def send_weights(self):
            start = clock.now
            clock.now += next(sends)
            sent_windows.append((start, clock.now))

        def stats(self):
            return {"last": {"take_seconds": {"s": 0.1}, "take_phases": {"s": {"load": 0.1}}}}

        def shutdown(self):
            pass

    class FakeStreams:
        """Two tokens a second, one every half second of the whole run, but one a second
        while a send runs."""

        def __init__(self, url):
            self.arrivals = vllm_inflight.Arrivals(chunks=[[]])

        def __enter__(self):
            self.started = clock.now
            return self

        def __exit__(self, *exc):
            self.ended = clock.now
            t = self.started + 0.25  # off the windows' edges
            while t < self.ended:
                in_send = any(a <= t < b for a, b in sent_windows)
                if not in_send or round((t - 0.25) * 2) % 2 == 0:
                    self.arrivals.chunks[0].append((t, 1))
                t += 0.5

    monkeypatch.setattr(vllm_inflight, "Streams", FakeStreams)
    out = vllm_inflight.InFlight("1gbit", 100, memcpy=0.01)
    server = types.SimpleNamespace(url="http://server")
    vllm_inflight._measure_updates(out, server, lambda: None, lambda **_: Engine(), 2, 5.0, None)
    # full: a 7 s send (window 8 s: send + settle), then a 1 s send (window 5 s)
    assert out.periods["full"] == pytest.approx((8.0 + 5.0) / 2)
    assert out.quiet_tps["full"] == pytest.approx(2.0, rel=0.05)
    # a send halves the rate while it runs: (7 + 1) s at 1/s, (1 + 4) s at 2/s, of 13 s
    assert out.tps["full"] == pytest.approx((8 * 1 + 5 * 2) / 13.0, rel=0.08)
    assert len(out.pair_ratios["full"]) == 2 and out.stalls["full"]


def test_tokens_per_second_counts_only_what_arrived_in_the_window():
    """A stream's request runs to its end after the streams stop: its later tokens are not
    the window's (counting them inflated the no-update baseline by up to a request per
    stream, 29 tokens/s of 145-200 in the vllm-serve bench)."""
    from weightsync.bench.vllm_inflight import Arrivals

    arrivals = Arrivals(chunks=[[(0.5, 2), (1.5, 3), (2.5, 4)], [(1.0, 1), (9.0, 96)]])
    assert arrivals.rate(0.0, 2.0) == pytest.approx((2 + 3 + 1) / 2.0)
    assert arrivals.rate(1.0, 2.5) == pytest.approx((3 + 4 + 1) / 1.5)  # the ends count
    assert arrivals.rate(0.0, 10.0) == pytest.approx(106 / 10.0)


def test_checksum_bench_script_prints_both_functions_side_by_side():
    """scripts/bench_checksum.py (quoted by docs/performance.md) runs and prints the word
    sum beside lane32-weighted-v1 for each step, each against its memcpy."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, str(root / "scripts" / "bench_checksum.py"), "--mb", "4",
                           "--repeats", "1", "--threads", "2"],
                          capture_output=True, text=True, timeout=120, env=env, check=True)
    lines = done.stdout.splitlines()
    assert "torch threads 2" in lines[0] and "load average" in lines[0]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines if line.startswith("| ")}
    for step in ("checksum alone", "commit pack (copy + checksum)", "verify (`bucket_checksums`)"):
        cells = rows[step]
        assert len(cells) == 7 and all(float(cell.strip(" |")) > 0 for cell in cells[1:]), cells


def test_directory_ab_script_compares_builds_in_turn():
    """scripts/bench_directory_ab.py (quoted by docs/performance.md) runs a build's commit
    and apply beside their memcpy, in fresh processes, build by build, and sums them up."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = str(root / "src")
    done = subprocess.run([sys.executable, str(root / "scripts" / "bench_directory_ab.py"),
                           "--builds", src, src, "--runs", "1", "--mb", "4", "--rounds", "2",
                           "--warm", "1"], capture_output=True, text=True, timeout=300, check=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert all(line.startswith(f"run 1 {src}: commit ") for line in lines[:2]), lines
    for line in lines[2:]:
        assert line.startswith(f"{src}: median of 1 runs: commit ") and "x memcpy" in line, line
        ratio = float(line.split("commit ")[1].split("x")[0])
        assert ratio > 0, line
