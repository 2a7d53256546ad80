"""The main job, short: versions advance, every batch carries its version, returns improve."""

from __future__ import annotations

import pytest

from weightsync.cli import main
from weightsync.demo import run_demo


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
@pytest.mark.parametrize("transport", ["mp", "file"])
def test_demo_other_transports(transport):
    result = run_demo(transport, workers=2, max_iterations=8, plot=None, live=False,
                      log=lambda line: None)
    assert result.final_version == 8 and len(result.batch_versions) == 64


def test_cli_demo_short_run_exits_zero(tmp_path):
    assert main(["demo", "--max-iterations", "3", "--workers", "1", "--no-live",
                 "--plot", str(tmp_path / "p.png")]) == 0


def test_cli_rejects_unknown_transport():
    with pytest.raises(SystemExit):
        main(["demo", "--transport", "carrier-pigeon"])
