"""benchmarks/peers.py --quick: the harness builds an edgeattn and an onnxruntime-genai model and measures both."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_genai") is None or importlib.util.find_spec("transformers") is None,
    reason="benchmarks/peers.py needs onnxruntime-genai and transformers (the bench extra)",
)
def test_peers_quick_measures_edgeattn_and_genai(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--quick", "--workdir", str(tmp_path)]
    cmd += ["--models", "edgeattn-gla,genai-llama"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "genai-llama" in out["errors"]:
        pytest.skip(
            f"onnxruntime-genai's builder cannot build on this machine: {out['errors']['genai-llama']}"
        )
    for name in ("edgeattn-gla@1", "genai-llama@1"):
        r = out["results"][name]
        assert set(r["contexts"]) == {"16", "64"}
        assert all(c["ms"] > 0 and c["rss_mib"] > 10 for c in r["contexts"].values())
        assert r["prefill_tps"] > 0
    # which kernels edgeattn's session ran, with why not its own (GLA at fp32: no KV buffer, no MatMulNBits)
    kernels = out["results"]["edgeattn-gla@1"]
    assert kernels["matmul"] == {"kernel": "onnxruntime", "why": "no MatMulNBits (precision fp32)"}
    assert kernels["attention"]["kernel"] == "onnxruntime" and "matmul" not in out["results"]["genai-llama@1"]
    # equal sizes: the peer's MLP width was chosen to match edgeattn's parameter count within 10%
    assert abs(out["params"]["genai-llama"] / out["params"]["edgeattn-gla"] - 1) < 0.1
    assert "| edgeattn `gla`" in res.stdout and "genai-llama / edgeattn-gla: decode@16" in res.stdout
