#!/usr/bin/env bash
# Create .venv with everything the project needs (train, dev and bench extras), on a machine with only
# Python 3. Idempotent: re-running with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.edgeattn-installed"
want=$(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
echo "setting up $VENV (a few minutes the first time)..." >&2
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[train,dev,bench,serve,ray]"
echo "$want" > "$stamp"
