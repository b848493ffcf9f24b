"""benchmarks/gate_sums.py (issue 36): both forms of the gate sums against fla's references, as it reports
them; bad arguments are one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gate_sums.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_both_forms_against_fla_and_the_price_after_minus_1e4():
    res = run("--ops", "gla", "--T", "40")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    err = {(r["gates"], r["form"]): max(r["errors"].values()) for r in rows}
    assert len(err) == 4 and all(e < 1e-5 for k, e in err.items() if k != ("a fifth at -1e4", "float32"))
    assert 1e-4 < err[("a fifth at -1e4", "float32")] < 1e-2  # float32 sums near 1e4: a relative 1e-3


@pytest.mark.parametrize(
    "args, message", [(["--ops", "gla,nope"], "--ops: expected some of"), (["--K", "0"], "--K")]
)
def test_bad_arguments(args, message):
    res = run(*args)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.strip().count("\n") == 0
    assert message in res.stderr, res.stderr
