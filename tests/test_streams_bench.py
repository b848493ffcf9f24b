"""benchmarks/streams.py --quick: the harness builds a dynamic-batch GLA, steps N = 1, 2, 4 streams, reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

from edgeattn.runtimes import open_session

ROOT = Path(__file__).resolve().parent.parent


def test_streams_quick_reports_every_n(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "streams.py"), "--quick", "--threads", "1"]
    res = subprocess.run(
        cmd + ["--workdir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[2].startswith("| N | aggregate tok/s")
    out = json.loads(lines[-1])
    assert out["benchmark"] == "streams" and [r["n"] for r in out["rows"]] == [1, 2, 4]
    (art,) = [p for p in tmp_path.iterdir() if p.name.endswith("-dyn")]
    state = open_session(art).get_state()  # batch 1: one stream's state
    for r in out["rows"]:
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert r["state_bytes_per_stream"] == sum(a.nbytes for a in state.values())
        assert isinstance(r["rss_growth_per_stream"], float)
