"""benchmarks/prefill_chunks.py: a one-graph artifact's prefill in calls of each length, interleaved
(``Session.prefill(ids, chunk=C)``, checked in tests/test_one_graph.py against artifacts exported with each
length as their --prefill-chunk)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from edgeattn.export import export_model
from tests.export_helpers import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def test_prefill_chunks_script_prints_a_row_per_artifact_and_length(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", prefill_chunk=4, include_checkpoint=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prefill_chunks.py"), str(art), "--tokens", "20"]
    res = subprocess.run(
        [*cmd, "--chunks", "4,7", "--rounds", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["chunk"] for r in out["results"]] == [4, 7]
    assert all(len(r["runs"]) == 2 and r["tps"] > 0 and r["diff"] < 1e-4 for r in out["results"])
    bad = subprocess.run([*cmd, "--chunks", "4,x"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("got '4,x'")
