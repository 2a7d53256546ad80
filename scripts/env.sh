#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install weightsync into it.
# Needs only python3. torch is installed pinned (CPU build) and only when it is missing,
# so no range ever pulls the multi-GB CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${WEIGHTSYNC_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "installing torch 2.13.0 (CPU) into $VENV" >&2
  "$PY" -m pip install -q torch==2.13.0
fi
stamp="$VENV/.weightsync-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing weightsync and its extras into $VENV" >&2
  "$PY" -m pip install -q -e ".[dev,demo,ray,hf,delta,lora]"
  touch "$stamp"
fi
# Heavier test-only dependencies (vLLM's CPU build, TorchRL), each installed by its own
# script, which must be idempotent, pin what is known to work and never pull a CUDA torch.
if [ "${WEIGHTSYNC_SKIP_TEST_EXTRAS:-0}" != "1" ]; then
  for extra in scripts/env-*.sh; do
    [ -f "$extra" ] && VENV="$VENV" bash "$extra"
  done
fi
