"""The main job, short: versions advance, every batch carries its version, returns improve,
and what the demo prints and writes is what a user expects to see."""

from __future__ import annotations

import re
import time

import pytest

from weightsync.cli import main
from weightsync.demo.trainer import run_demo


@pytest.mark.slow
def test_demo_short_run_learns_and_tags_batches(tmp_path):
    lines: list[str] = []
    plot = tmp_path / "demo.png"
    result = run_demo("shm", workers=2, max_iterations=30, plot=str(plot), live=False,
                      log=lines.append)
    assert result.iterations == 30 and result.final_version == 30
    assert len(result.batch_versions) == 30 * 8
    assert all(0 <= v < 30 for v in result.batch_versions)
    assert max(result.batch_versions) >= 25  # collectors really switched to new versions
    assert result.last_mean_return > result.first_mean_return * 1.5, lines[-1]
    assert [h["version"] for h in result.history] == list(range(1, 31))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "CartPole-v1 over shm" in lines[-1]


@pytest.mark.slow
def test_demo_says_what_it_does_and_its_figures_agree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    result = run_demo("shm", workers=2, max_iterations=5, live=False, log=lines.append,
                      output_dir=tmp_path / "results")
    assert lines[0] == "starting 2 collectors over shm..."  # before any wait
    first = next(line for line in lines if "iteration    1 " in line)
    summary = lines[-1]
    first_return = re.search(r"mean return +([\d.]+)", first)
    summary_returns = re.search(r"mean return ([\d.]+) -> ([\d.]+)", summary)
    assert first_return and summary_returns, (first, summary)
    assert first_return.group(1) == summary_returns.group(1)  # the same number, twice
    assert result.history[0]["t"] < result.history[-1]["t"] == result.seconds
    assert re.search(r"median send [\d.]+ (ms|µs|s)", summary), summary  # human units
    assert "e-0" not in summary
    # the plot goes where it was asked, nothing into the working directory
    assert result.plot == str(tmp_path / "results" / "weightsync-demo-shm.png")
    assert (tmp_path / "results" / "weightsync-demo-shm.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["mp", "file"])
def test_demo_other_transports(transport):
    result = run_demo(transport, workers=2, max_iterations=8, plot=None, live=False,
                      log=lambda line: None)
    assert result.final_version == 8 and len(result.batch_versions) == 64


def test_cli_demo_short_run_exits_zero(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--max-iterations", "3", "--workers", "1", "--no-live"]) == 0
    out, err = capfd.readouterr()  # the collectors' output too
    assert "starting 1 collector over shm..." in out
    assert "lost" not in err and "sender closed" not in err, err  # a clean end, quietly
    # the default output folder, which .gitignore lists
    assert (tmp_path / "demo-output" / "weightsync-demo-shm.png").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-output"]


def test_cli_rejects_unknown_transport():
    with pytest.raises(SystemExit):
        main(["demo", "--transport", "carrier-pigeon"])


def test_ctrl_c_in_training_is_a_request_then_a_second_one_interrupts():
    """A first Ctrl-C never raises inside the trainer's step (a queue read cut in half hangs
    the collectors' stop); a second one does; the handler before is back afterwards."""
    import os
    import signal

    from weightsync.demo.collectors import StopRequest

    # Ctrl-C as a terminal's foreground job has it: this process may have inherited an
    # ignored SIGINT (a shell's background job does), under which armed() leaves it alone
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = StopRequest()
        with stop.armed():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs at the next bytecode: no exception here
            assert stop.requested
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup: left ignored
        with StopRequest().armed():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)
