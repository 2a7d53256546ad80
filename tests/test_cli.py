"""The command line: the demo's short run must show versions advancing and loss falling."""

from __future__ import annotations

import pytest

from weightsync.cli import main
from weightsync.demo import run_demo


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "mp"])
def test_demo_short_run_syncs_real_weights(transport):
    lines: list[str] = []
    result = run_demo(transport, workers=2, steps=40, log=lines.append)
    assert result.final_version == 40
    assert result.worker_versions == {0: 40, 1: 40}
    assert result.final_loss < result.first_loss * 0.7, lines
    assert any("workers hold" in line for line in lines)


def test_cli_demo_exit_code():
    assert main(["demo", "--steps", "5", "--workers", "1"]) == 0


def test_cli_rejects_unknown_transport():
    with pytest.raises(SystemExit):
        main(["demo", "--transport", "carrier-pigeon"])
