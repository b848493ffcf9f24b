#!/usr/bin/env bash
# The test suite: sets up .venv if needed, then runs pytest (fast cases; `-m slow` for the long ones).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q "$@"
