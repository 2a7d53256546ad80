"""The vLLM backend's engine says nothing at interpreter exit: vLLM frees its worker (and
the engine with it) while Python tears modules down, their globals already None, so the
engine's ``__del__`` may use builtins only. A fresh process, no vLLM engine started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: the engine, made without vLLM's arguments, holds something to close, and is held by a
#: module's globals (as a vLLM worker holds it): it is freed while modules are torn down
SCRIPT = """
import sys, types

holder = types.ModuleType("engine_holder")  # imported before the backend: torn down after it
sys.modules["engine_holder"] = holder

from weightsync.integrations.vllm import backend

class Owned:
    closed = []
    def close(self):
        self.closed.append(True)

holder.engine = object.__new__(backend.WeightSyncWeightTransferEngine)
holder.engine.host = Owned()
print("made", flush=True)
"""

def test_the_engine_is_freed_at_exit_without_an_exception():
    pytest.importorskip("vllm", reason="vLLM is not installed; bash scripts/env.sh installs it")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and "made" in done.stdout, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
