"""`edgeattn bench`: files, schema, memory slopes, comparison, round-robin order, fresh exports, the base
install (no torch) path, and every bad input (one line, exit 2). Tiny models and short contexts."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.bench import presets, runner, schema, theory
from edgeattn.cli import bench
from edgeattn.export.manifest import Manifest
from tests.export_helpers import PREFILL, make_checkpoint, tiny_config

cli = CliRunner()
app = typer.Typer()
bench.register(app)

FAST = ["--bandwidth-mib", "16", "--threads", "1", "--warmup", "4"]
SLOPE_CONTEXTS = "16,64,256,1024,4096"


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args])


def quick(*args, contexts="16", steps=4, repeats=1, prefill=32, step_tokens=8):
    """A short bench: few contexts, steps and repeats, a small bandwidth array."""
    return [
        *args,
        "--contexts",
        contexts,
        "--steps",
        steps,
        "--repeats",
        repeats,
        "--prefill-tokens",
        prefill,
        "--step-tokens",
        step_tokens,
        *FAST,
    ]


def last_json(res) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from edgeattn.export import export_model

    root = tmp_path_factory.mktemp("bench")
    arts = {}
    for mixer, kw in (("gla", {}), ("softmax", {"max_seq_len": 8192})):
        ckpt = make_checkpoint(root / f"{mixer}.ckpt", mixer, **kw)
        # softmax on the portable target: the growing KV cache whose memory slope the bench measures (the
        # onnxruntime target's preallocated GQA buffer is flat; test_skips_contexts... benches that one)
        target = "portable" if mixer == "softmax" else "onnxruntime"
        arts[mixer] = export_model(ckpt, root / mixer, prefill_chunk=PREFILL, target=target)
    return arts


@pytest.fixture(scope="module")
def run_out(artifacts, tmp_path_factory):
    """One bench of both tiny artifacts: 2 repeats, contexts up to 4096, --out and --eval."""
    out = tmp_path_factory.mktemp("out")
    text = out.parent / "heldout.txt"
    text.write_bytes(Path(os.__file__).read_bytes()[:600])
    args = quick(
        artifacts["gla"], artifacts["softmax"], contexts=SLOPE_CONTEXTS, steps=8, repeats=2, prefill=64
    )
    res = invoke(*args, "--eval", text, "--eval-bytes", 300, "--out", out)
    assert res.exit_code == 0, res.output
    return out, res


def test_bench_writes_every_file_and_plot(run_out):
    import matplotlib.image

    out, res = run_out
    for name in ("results.json", "results.csv", "latency_vs_context.png", "memory_vs_context.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in ("latency_vs_context.png", "memory_vs_context.png"):
        img = matplotlib.image.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind
    rows = (out / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2 * len(SLOPE_CONTEXTS.split(","))
    assert "Theory" in res.stdout and "Decode" in res.stdout and "O(T d)" in res.stdout


def test_results_json_follows_the_schema(run_out):
    out, _ = run_out
    doc = json.loads((out / "results.json").read_text())
    assert schema.validate(doc) == []
    assert doc["machine"]["bandwidth_bytes_per_s"] > 0 and doc["machine"]["libraries"]["onnxruntime"]
    for r in doc["results"]:
        assert not r["errors"]
        assert 0 < r["bits_per_byte"] < 20 and r["eval_bytes"] == 300
        for c in r["contexts"]:
            assert c["skipped"] is None
            lat = c["latency_s"]
            assert len(lat["p50"]["values"]) == 2  # one per repeat: every figure carries its spread
            assert lat["p50"]["min"] <= lat["p50"]["median"] <= lat["p50"]["max"] <= lat["p99"]["max"]
            assert c["floor_multiple"]["median"] > 0
        assert r["prefill_tokens_per_s"]["median"] > 0 and r["load_s"]["median"] > 0
    # the validator catches what is wrong, with a path
    broken = json.loads((out / "results.json").read_text())
    del broken["results"][0]["contexts"][0]["latency_s"]["p90"]
    broken["machine"]["memory_bytes"] = "lots"
    problems = schema.validate(broken)
    assert any("latency_s: lacks the key 'p90'" in p for p in problems)
    assert any("machine.memory_bytes: expected integer" in p for p in problems)
    with pytest.raises(ValueError, match="not an edgeattn bench results file"):
        schema.check(broken)


def test_memory_slope_gla_flat_softmax_grows_by_its_kv_cache(run_out):
    _, res = run_out
    head = {r["mixer"]: r for r in last_json(res)["results"]}
    cfg = tiny_config("softmax")
    kv_bytes_per_token = 2 * cfg.n_layers * cfg.d_model * 4
    assert head["gla"]["bytes_per_token"] < 64, head["gla"]
    assert head["softmax"]["bytes_per_token"] >= kv_bytes_per_token, head["softmax"]
    assert set(head["gla"]["decode_ms"]) == set(SLOPE_CONTEXTS.split(","))


def test_compare_prints_the_ratio_of_every_figure(run_out, artifacts, tmp_path):
    out, _ = run_out
    res = invoke(
        *quick(artifacts["gla"], contexts="16,64"), "--compare", out / "results.json", "--out", tmp_path
    )
    assert res.exit_code == 0, res.output
    assert "decode_p50_ms@16" in res.stdout and "prefill_tokens_per_s" in res.stdout
    cmp = json.loads((tmp_path / "results.json").read_text())["comparison"]
    figures = {row["figure"] for row in cmp["rows"]}
    assert {"decode_p50_ms@64", "rss_mib@64", "load_s", "artifact_bytes"} <= figures
    assert all(row["name"] == "gla" for row in cmp["rows"])
    assert next(r for r in cmp["rows"] if r["figure"] == "artifact_bytes")["ratio"] == 1.0


def test_skips_contexts_beyond_the_softmax_max_length(tmp_path):
    from edgeattn.export import export_model

    ckpt = make_checkpoint(tmp_path / "c", "softmax", max_seq_len=96)
    art = export_model(ckpt, tmp_path / "sm", prefill_chunk=PREFILL)
    res = invoke(*quick(art, contexts="16,128"))
    assert res.exit_code == 0, res.output
    assert last_json(res)["results"][0]["skipped"] == [128]
    assert "skipped: context 128" in res.stdout


def test_round_robin_order_across_repeats(artifacts, monkeypatch):
    calls = []

    def fake_worker(cfg, timeout=None):
        calls.append((Path(cfg["artifact"]).name, cfg["backend"]))
        lat = {q: 1e-3 for q in ("p50", "p90", "p99", "mean")}
        ctx = dict(
            context=16,
            skipped=None,
            tokens=20,
            rss_bytes=1,
            peak_rss_bytes=1,
            device_bytes=None,
            latency_s=lat,
        )
        return dict(
            device="cpu",
            load_s=0.1,
            rss_after_load_bytes=1,
            memory_slope_bytes_per_token=0.0,
            prefill_tokens_per_s=1.0,
            step_tokens_per_s=1.0,
            contexts=[ctx],
        )

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    targets = runner.load_targets([artifacts["gla"], artifacts["softmax"]])
    s = runner.Settings(backends=["onnxruntime", "torch"], contexts=[16], repeats=3, bandwidth_mib=1)
    doc = runner.run(targets, s, command=["test"])
    configs = [("gla", "onnxruntime"), ("gla", "torch"), ("softmax", "onnxruntime"), ("softmax", "torch")]
    assert calls == configs + configs[1:] + configs[:1] + configs[2:] + configs[:2]
    assert schema.validate(doc) == []
    assert doc["results"][0]["contexts"][0]["latency_s"]["p50"]["values"] == [1e-3] * 3


def test_theory_softmax_grows_linear_families_do_not(artifacts):
    gla, sm = (theory.cost(Manifest.load(artifacts[m])) for m in ("gla", "softmax"))
    cfg = tiny_config("gla")
    assert gla.state_bytes(16) == gla.state_bytes(16384) == 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim**2
    assert gla.flops(16) == gla.flops(16384) > 2 * gla.matrix_params
    kv = 2 * cfg.n_layers * cfg.d_model * 4
    assert sm.state_bytes(1000) - sm.state_bytes(0) == 1000 * kv
    assert sm.flops(1000) > sm.flops(10)
    row = sm.at(4096, bandwidth=1e10, matmul_rate=1e11)
    assert row["floor_s"] == max(row["memory_floor_s"], row["compute_floor_s"])
    assert row["memory_floor_s"] == pytest.approx((sm.weight_bytes + sm.state_bytes(4096)) / 1e10)
    assert theory.complexity("softmax")["decode"] == "O(T d)"
    assert theory.complexity("gla")["state"] == "O(d^2/H)"
    assert "O(W d)" in theory.complexity("hybrid(gla,swa)")["decode"]


def test_presets_have_equal_parameter_counts():
    planned = presets.plan(["gla", "retnet", "linear", "softmax", "flash"], "tiny", max_seq_len=2048)
    counts = [p.params for p in planned if p.config is not None]
    assert len(counts) == 5
    assert max(counts) / min(counts) < 1.05, counts


def test_fresh_models_with_a_missing_family(monkeypatch, tmp_path):
    from edgeattn.layers import MIXER_REGISTRY

    monkeypatch.delitem(MIXER_REGISTRY, "retnet")  # as if the family were not written yet
    args = quick("--mixers", "gla,retnet", "--size", "tiny", contexts="16,32", prefill=64)
    res = invoke(*args, "--out", tmp_path / "out", "--export-dir", tmp_path / "arts")
    assert res.exit_code == 0, res.output
    assert "parameters" in res.stdout and "missing" in res.stdout
    head = last_json(res)
    assert [r["mixer"] for r in head["results"]] == ["gla"] and head["missing"] == ["retnet"]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["missing"][0]["command"].startswith(
        "edgeattn bench --mixers retnet --size tiny --contexts 16,32"
    )
    # --export-dir keeps the artifacts (and nothing else) for copying to a device
    assert [p.name for p in (tmp_path / "arts").iterdir()] == ["gla"]
    assert doc["results"][0]["artifact"] == str(tmp_path / "arts" / "gla")
    Manifest.load(tmp_path / "arts" / "gla")


def test_base_install_path_imports_no_torch(artifacts, tmp_path):
    """Existing artifacts need only the base install: torch cannot be imported here or in the workers."""
    blocker = tmp_path / "block" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import typer\nfrom edgeattn.cli import bench\n"
        "app = typer.Typer(); bench.register(app); app()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker.parent), os.getcwd()])}
    args = [*quick(artifacts["gla"]), "--out", tmp_path / "o"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    head = json.loads(proc.stdout.strip().splitlines()[-1])
    assert head["results"][0]["decode_ms"]["16"] > 0 and (tmp_path / "o" / "results.json").is_file()
    # and what needs torch says so in one line
    cmd = [sys.executable, "-c", code, "--mixers", "gla", "--size", "tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "edgeattn[train]" in proc.stderr


def assert_bad_input(res, message):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in lines[0], res.output


def test_bad_inputs_are_one_line_errors(artifacts, tmp_path):
    not_art = tmp_path / "empty"
    not_art.mkdir()
    assert_bad_input(invoke(not_art), "not an exported edgeattn artifact")
    assert_bad_input(invoke(tmp_path / "nowhere"), "does not exist")
    assert_bad_input(invoke(artifacts["gla"], "--backend", "cuda"), "unknown backend 'cuda'")
    if importlib.util.find_spec("tensorrt") is None:  # not installed here: says which extra to install
        assert_bad_input(invoke(artifacts["gla"], "--backend", "onnxruntime,tensorrt"), "edgeattn[tensorrt]")
    assert_bad_input(invoke(artifacts["gla"], "--contexts", "16,abc"), "--contexts")
    assert_bad_input(invoke(), "give artifact directories")
    assert_bad_input(invoke("--mixers", "gla,nope", "--size", "tiny"), "unknown mixer 'nope'")
    (tmp_path / "old.json").write_text('{"format": "edgeattn-bench"}')
    res = invoke(artifacts["gla"], "--compare", tmp_path / "old.json")
    assert_bad_input(res, "not an edgeattn bench results file")
    assert_bad_input(invoke(artifacts["gla"], "--eval", tmp_path / "none.txt"), "does not exist")


def test_torch_backend_runs_through_the_same_worker(artifacts):
    res = invoke(*quick(artifacts["gla"], "--backend", "torch", steps=2))
    assert res.exit_code == 0, res.output
    assert np.isfinite(last_json(res)["results"][0]["decode_ms"]["16"])


def test_a_failing_worker_is_reported_and_the_rest_still_runs(artifacts, tmp_path):
    import shutil

    from edgeattn.export.manifest import sha256_file

    broken = tmp_path / "broken"
    shutil.copytree(artifacts["gla"], broken)
    (broken / "step.onnx").write_bytes(b"not an onnx graph")  # hashes updated: only the runtime can tell
    manifest = json.loads((broken / "edgeattn.json").read_text())
    manifest["files"]["step.onnx"] = {"sha256": sha256_file(broken / "step.onnx"), "bytes": 17}
    (broken / "edgeattn.json").write_text(json.dumps(manifest))
    args = quick(steps=2, repeats=2)
    res = invoke(artifacts["gla"], broken, *args)
    assert res.exit_code == 0, res.output
    head = last_json(res)
    assert [r["errors"] for r in head["results"]] == [0, 1]  # tried once, not once per repeat
    assert "failed" in res.stdout and "onnxruntime cannot load" in res.stdout
    assert_bad_input(invoke(broken, *args), "onnxruntime cannot load")


def test_outputs_are_checked_before_benchmarking(artifacts, tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before its outputs were checked")

    monkeypatch.setattr(runner, "run_worker", no_run)
    busy = tmp_path / "results"
    busy.write_text("mine")
    assert_bad_input(invoke(*quick(artifacts["gla"]), "--out", busy), "exists and is not a directory")
    assert_bad_input(invoke(*quick(artifacts["gla"]), "--out", busy / "sub"), "is not a directory")
    assert_bad_input(invoke(*quick(artifacts["gla"]), "--export-dir", busy), "exists and is not a directory")
    assert busy.read_text() == "mine"


def test_the_plot_hint_names_the_bench_extra(artifacts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on an install without the bench extra
    res = invoke(*quick(artifacts["gla"], steps=2), "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert "pip install 'edgeattn[bench]' for the plots" in res.stdout


def test_the_demo_decode_benchmark_warms_up_before_timing():
    """A session whose first 100 steps are cold (5 ms, then 1 ms): the figures at both marks are the warm
    1 ms, measured from the empty state after the warm-up (it once timed the cold steps: "0.50x the time per
    token" at long context)."""
    spec = importlib.util.spec_from_file_location("demo_decode", Path("benchmarks/demo_decode.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)

    class ColdSession:
        def __init__(self):
            self.now, self.calls, self.position, self.positions = 0.0, 0, 0, []

        def step(self, ids):
            self.now += 0.005 if self.calls < 100 else 0.001
            self.calls += 1
            self.position += 1
            self.positions.append(self.position)
            return np.zeros((1, 8), np.float32)

        def reset(self):
            self.position = 0

    sess = ColdSession()
    figures = demo.decode_figures(sess, [64, 256], clock=lambda: sess.now, rss=lambda: 1.0)
    assert figures[64]["ms_per_token"] == pytest.approx(1.0) and figures[256][
        "ms_per_token"
    ] == pytest.approx(1.0)
    assert sess.positions[-256:] == list(range(1, 257))  # the timed run starts from the empty state


def test_the_demo_ends_with_one_sentence_of_result_before_its_json():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_decode", Path("benchmarks/demo_decode.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)

    def fig(ms, mib):
        return {"ms_per_token": ms, "rss_mib": mib}

    results = {
        "artifact": {128: fig(1.0, 70.0), 8192: fig(1.1, 70.2)},
        "softmax": {128: fig(1.0, 70.0), 8192: fig(3.0, 102.0)},
    }
    line = demo.result_sentence("gla.onnx", results, 128, 8192)
    assert "\n" not in line and line.endswith(".")
    assert "gla.onnx's memory stayed flat (+0.2 MiB, 1.10x" in line
    assert "softmax baseline's memory grew by +32.0 MiB" in line and "3.00x" in line
    results["artifact"][8192] = fig(1.1, 90.0)
    assert "memory changed (+20.0 MiB" in demo.result_sentence("gla.onnx", results, 128, 8192)
    script = Path("scripts/demo.sh").read_text()
    assert "--steps" in script and "--time-budget" not in script
