#!/usr/bin/env bash
# The project's two entry points, each setting up .venv first:
#   scripts/run.sh demo [args]   the main job (weightsync demo)
#   scripts/run.sh test [args]   the default test suite (pytest, without the full tier)
#   scripts/run.sh test-all      every test (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
VENV="${WEIGHTSYNC_VENV:-.venv}"
cmd="${1:-}"; shift || true
case "$cmd" in
  demo) exec "$VENV/bin/weightsync" demo "$@" ;;
  test) exec "$VENV/bin/python" -m pytest -q -m "not full" "$@" ;;
  test-all) exec "$VENV/bin/python" -m pytest -q "$@" ;;
  bench) exec "$VENV/bin/weightsync" bench "$@" ;;
  *) echo "usage: scripts/run.sh demo|test|test-all|bench [args]" >&2; exit 2 ;;
esac
