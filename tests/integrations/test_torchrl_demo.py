"""A short run of ``weightsync demo --collector torchrl``: TorchRL's MultiSyncCollector on a
weightsync scheme trains, versions advance, and the summary is printed and written."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("torchrl", reason="torchrl is not installed (scripts/env-torchrl.sh installs it)")
pytest.importorskip("gymnasium", reason="gymnasium is not installed")

from weightsync.demo.torchrl import run_demo, train

pytestmark = [pytest.mark.torchrl, pytest.mark.timeout(420)]


def test_short_run_demo_trains_and_reports(tmp_path, capsys) -> None:
    args = argparse.Namespace(transport="shm", workers=2, max_seconds=240.0, max_iterations=3,
                              seed=0, output_dir=str(tmp_path))
    assert run_demo(args) == 0  # a run capped by --max-iterations is not a failure
    out = capsys.readouterr().out
    assert "TorchRL's MultiSyncCollector (2 workers) over weightsync shm" in out
    data = json.loads((tmp_path / "weightsync-demo-torchrl-shm.json").read_text())
    assert data["iterations"] == 3 and data["final_version"] == 3
    assert [h["version"] for h in data["history"]] == [1, 2, 3]
    assert data["episodes"] >= 3 * 8
    assert data["median_send_ms"] > 0
    assert data["summary"] in out


def test_episodes_carry_the_version_that_played_them() -> None:
    lines: list[str] = []
    result = train("mp", workers=2, max_iterations=4, max_seconds=240.0, log=lines.append)
    assert result.iterations == 4 and result.final_version == 4
    tagged = [tagged for tagged, _ in result.episode_versions]
    assert all(0 <= tagged_v <= sent for tagged_v, sent in result.episode_versions)
    # TorchRL's sync collector asks for the next batch after the update: no lag beyond the
    # tail of an episode that straddled two batches
    assert all(sent - tagged_v <= 1 for tagged_v, sent in result.episode_versions)
    assert max(tagged) >= 3, "the workers never played a new version"
    assert lines[0].startswith("starting TorchRL's MultiSyncCollector")
