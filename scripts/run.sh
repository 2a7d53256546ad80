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

# pytest on WEIGHTSYNC_TEST_WORKERS pytest-xdist workers (2; 0: one process), each module run
# whole by one of them (tests/conftest.py: lanes), then the tests marked serial, alone.
# $1: the tier's marker expression ("": every test); the rest: pytest's own arguments.
run_tests() {
  local tier="$1" workers="${WEIGHTSYNC_TEST_WORKERS:-2}" status=0 code=0
  shift
  local parallel="not serial" serial="serial"
  if [ -n "$tier" ]; then parallel="($tier) and not serial"; serial="($tier) and serial"; fi
  if [ "$workers" = "0" ]; then
    "$VENV/bin/python" -m pytest -q ${tier:+-m "$tier"} "$@" || status=$?
    return "$status"
  fi
  "$VENV/bin/python" -m pytest -q -n "$workers" --dist loadscope -m "$parallel" "$@" || status=$?
  "$VENV/bin/python" -m pytest -q -m "$serial" "$@" || code=$?
  [ "$code" = "5" ] && code=0  # 5: no serial test among those asked for
  [ "$status" = "0" ] && status="$code"
  return "$status"
}
case "$cmd" in
  demo) exec "$VENV/bin/weightsync" demo "$@" ;;
  test) run_tests "not full" "$@" ;;
  test-all) run_tests "" "$@" ;;
  bench) exec "$VENV/bin/weightsync" bench "$@" ;;
  *) echo "usage: scripts/run.sh demo|test|test-all|bench [args]" >&2; exit 2 ;;
esac
