"""``weightsync demo --llm`` against the real vLLM CPU engine: a short run whose versions
advance, whose every sample carries the version the engine held, whose greedy check against
the trainer holds, and which leaves no process behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.mark.parametrize("sync", ["weightsync", "reload"])
def test_a_short_llm_demo_run(tmp_path, sync):
    pytest.importorskip("vllm")
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "demo", "--llm", "--steps", "12", "--sync", sync,
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = re.search(r"(\d+) steps, version (\d+): .* (\d+) greedy checks passed", run.stdout)
    assert summary, run.stdout[-2000:]
    steps, version, checks = map(int, summary.groups())
    assert steps == 12 and version == 12 and checks >= 2
    assert (tmp_path / f"weightsync-demo-llm-tiny-{sync}.png").is_file()
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"processes left behind: {left}"


def test_a_short_lora_demo_run_syncs_the_adapter_alone(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    run = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "demo", "--llm", "--lora", "--steps", "12",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = re.search(r"(\d+) steps, version (\d+): .* \(lora\); (\d+) greedy checks passed",
                        run.stdout)
    assert summary, run.stdout[-2000:]
    steps, version, checks = map(int, summary.groups())
    assert steps == 12 and version == 12 and checks >= 2
    sizes = re.search(r"bytes per sync: ([\d.]+) MB \(LoRA adapter\) vs ([\d.]+) MB \(full model\)",
                      run.stdout)
    assert sizes, run.stdout[-2000:]
    adapter, full = map(float, sizes.groups())
    assert 0 < adapter < full
    assert (tmp_path / "weightsync-demo-llm-tiny-lora.png").is_file()
