"""benchmarks/prefill_chunks.py: a one-graph artifact's prefill in calls of each length, interleaved; every
length must give the session's own prefill logits (checked here against ``Session.prefill`` of artifacts
exported with each length as their --prefill-chunk)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from edgeattn.export import export_model
from edgeattn.runtimes import open_session
from tests.export_helpers import make_checkpoint, text_ids

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from prefill_chunks import prefill_in_calls  # noqa: E402


def test_prefill_in_calls_equals_the_session_prefill_of_that_chunk(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gated_deltanet")
    ids = text_ids(23, seed=5)
    base = open_session(export_model(ckpt, tmp_path / "c4", prefill_chunk=4, include_checkpoint=False))
    assert base.any_tokens  # one graph, any number of tokens per call
    for chunk in (4, 8, 23):
        other = open_session(
            export_model(ckpt, tmp_path / f"c{chunk}x", prefill_chunk=chunk, include_checkpoint=False)
        )
        want = other.prefill(ids)
        base.reset()
        got = prefill_in_calls(base, ids, chunk)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert base.position == other.position == ids.shape[1]


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
