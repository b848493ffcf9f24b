"""benchmarks/imported.py --quick: a Qwen3.5 model exported by edgeattn and built by onnxruntime-genai's
builder, fp32 and int4, all measured by benchmarks/peers.py's workers."""

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
    reason="benchmarks/imported.py needs onnxruntime-genai and transformers (the bench extra)",
)
def test_imported_quick_measures_edgeattn_and_genai_at_both_precisions():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "imported.py"), "--quick"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["params"] > 100_000 and out["errors"] == {}
    # genai's builder runs the published layout (M-RoPE sections): every model measured, none failing
    for name in ("edgeattn-qwen35", "genai-qwen35", "edgeattn-qwen35-int4", "genai-qwen35-int4"):
        r = out["results"][f"{name}@1"]
        assert set(r["contexts"]) == {"16", "64"}
        assert all(c["ms"] > 0 and c["rss_mib"] > 10 for c in r["contexts"].values())
        assert r["prefill_tps"] > 0
    assert set(out["ratios"]) == {"genai-qwen35@1", "genai-qwen35-int4@1"}
    assert "| edgeattn fp32 (ONNX Runtime session) |" in res.stdout
    assert "genai-qwen35-int4 / edgeattn-qwen35-int4: decode@16" in res.stdout
