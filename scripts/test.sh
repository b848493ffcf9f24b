#!/usr/bin/env bash
# The test suite: sets up .venv if needed, then runs pytest (fast cases; `-m slow` for the long ones).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# one worker per core, each test file on one worker (its module fixtures built once); -n 0 runs in-process
exec .venv/bin/python -m pytest -q -n "${EDGEATTN_TEST_WORKERS:-$(nproc)}" --dist loadfile "$@"
