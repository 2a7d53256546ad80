#!/usr/bin/env bash
# TorchRL for the weightsync.integrations.torchrl tests and the `--collector torchrl` demo.
# torchrl 0.14.1 pins tensordict<0.15, but its collectors and weight-update schemes run
# beside tensordict 0.15.3 (tested here), so it is installed with --no-deps: that also
# guarantees pip never replaces the CPU torch with a CUDA build. Its C++ extension is
# optional (only some replay buffers use it). Idempotent: a no-op when already installed.
set -euo pipefail
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
TORCHRL_VERSION="0.14.1"
installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("torchrl"))' 2>/dev/null || true)"
if [ "$installed" != "$TORCHRL_VERSION" ]; then
  echo "installing torchrl $TORCHRL_VERSION (--no-deps) into $VENV" >&2
  "$PY" -m pip install -q --no-deps "torchrl==$TORCHRL_VERSION"
fi
# torchrl's own pure-Python requirements besides torch/tensordict: install only the
# missing ones, each pinned to a version known to work, never with its dependencies.
for req in "cloudpickle==3.1.2" "packaging==26.3" "numpy==2.4.6"; do
  name="${req%%==*}"
  if ! "$PY" -c "import importlib.metadata as m; m.version('$name')" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps "$req"
  fi
done
