"""Every script in examples/ runs to completion (short settings), so none rots, and leaves
nothing behind in shared memory (there, a leftover costs the model's size in RAM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
ARGS = {
    "shared_memory_collectors.py": ["--steps", "5"],
    "transformers_double_buffer.py": ["--steps", "2"],
    "ray_actors.py": ["--steps", "3"],
    "torchrl_tear_check.py": ["--updates", "5"],
    "torchrl_llm.py": ["--steps", "2"],  # exits 0 with a message without vllm
    "fsdp_trainer.py": ["--steps", "3"],
}
NEEDS = {"torchrl_tear_check.py": "torchrl", "torchrl_llm.py": "torchrl"}


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path) -> None:
    if script.name in NEEDS:
        pytest.importorskip(NEEDS[script.name], reason=f"{script.name} needs {NEEDS[script.name]}")
    before = _leftovers()
    result = subprocess.run(
        [sys.executable, str(script), *ARGS.get(script.name, [])],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert _leftovers() - before == set(), "the example left these behind"


@pytest.mark.slow
def test_the_fsdp_example_over_shared_memory() -> None:
    script = Path(__file__).parent.parent / "examples" / "fsdp_trainer.py"
    result = subprocess.run([sys.executable, str(script), "--steps", "3", "--scheme", "shm"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "all checks passed" in result.stdout


def _leftovers() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("weightsync-example-*")} if shm.is_dir() else set()
