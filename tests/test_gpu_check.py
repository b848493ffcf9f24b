"""benchmarks/gpu_check.py (issue 36), the GPU half's one script, run here at tiny shapes in Triton's
interpreter (--tiny): every section writes its records, ours agrees with fla on the same inputs, a section
past its budget is killed (with what it started) while the next one runs, bad arguments exit 2 in one line.
On a GPU only the sizes change (gpu_check.SIZES)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

FAST_TEST = "test_chunk_gates_float32 and none"


def run_script(script: Path, out: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``script`` (gpu_check.py or gpu_profile.py) with --tiny and --out ``out``, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the scripts set it (for their children) when there is no GPU
    cmd = [sys.executable, str(script), "--tiny", "--out", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run(out: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, out, *args, timeout=timeout)


def assert_refused(res: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2 with one line on stderr holding ``message``, nothing on stdout."""
    assert res.returncode == 2 and res.stdout == "", res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0 and message in res.stderr, res.stderr


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in gpu_check.read_records(out / "results.jsonl") if r["kind"] == kind]


def check_run(out: Path, ops: list[str], models: list[str], libs=("fla", "edgeattn")) -> None:
    statuses = {r["section"]: r["status"] for r in records(out, "section")}
    assert statuses == dict.fromkeys(gpu_check.SECTIONS, "ok"), statuses
    errors = [r for r in records(out, "error")]
    assert not errors, errors
    assert records(out, "env")[0]["fla_core"]

    (summary,) = records(out, "tests_summary")
    assert summary["passed"] >= 1 and summary["failed"] == summary["error"] == 0, summary
    assert all(t["outcome"] == "passed" for t in records(out, "test"))

    times = {(r["op"], r["impl"]) for r in records(out, "kernel_time")}
    ours = {op: gpu_check.our_impls(op) for op in ops}
    assert ours.get("gated_delta", ("triton", "triton-wy", "triton-f32g", "triton-wy-f32g")) == (
        "triton", "triton-wy", "triton-f32g", "triton-wy-f32g",
    )  # fmt: skip
    assert ours.get("simple_gla", ("triton", "triton-f32g")) == ("triton", "triton-f32g")
    want = {(op, impl) for op in ops for impl in ("fla", "torch", *ours[op])} | {("sdpa", "sdpa")}
    assert times == want
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["gbs"] > 0 for r in records(out, "kernel_time"))
    assert all("vs_fla" in r for r in records(out, "kernel_time") if r["impl"] not in ("fla", "sdpa"))
    checks = {(r["op"], r["impl"]): r for r in records(out, "kernel_check")}
    assert sorted(checks) == sorted((op, impl) for op in ops for impl in ours[op])
    for op, r in checks.items():  # float32 here: ours and fla (an independent implementation) agree
        assert set(r["rel_rms"]) >= {"o", "dq", "dk", "dv", "dg"}
        assert r["max_rel_rms"] < 1e-4, (op, r["rel_rms"])

    train = {(r["model"], r["lib"]): r for r in records(out, "train")}
    assert sorted(train) == sorted((m, lib) for m in models for lib in libs)
    for m in models:  # the same shape by construction: fla's model imported (its output norm, one head wide
        # and shared by the heads, is tiled over them: a few parameters more)
        edge, fla = train[(m, "edgeattn")]["params"], train[(m, "fla")]["params"]
        assert fla <= edge <= fla * 1.01, (edge, fla)
        for lib in libs[1:]:
            assert train[(m, lib)]["tokens_per_s"] > 0 and train[(m, lib)]["vs_fla"] > 0

    decode = records(out, "decode")
    assert [r["context"] for r in decode] == list(gpu_check.SIZES["tiny"]["decode"]["contexts"])
    assert all(r["ms_per_token"] > 0 for r in decode)
    assert records(out, "decode_model")[0]["status"] == "ok"

    md = (out / "results.md").read_text()
    heads = (
        "| section | status |",
        "| op | impl | T |",
        "| op | T | fastest |",
        "| model | lib |",
        "| path | context |",
    )
    for head in heads:
        assert head in md
    assert "[tests] start" in (out / "gpu_check.log").read_text()


def test_tiny_run_of_every_section(tmp_path):
    out = tmp_path / "out"
    libs = ("fla", "edgeattn", "edgeattn-f32g")
    res = run(out, "--ops", "simple_gla,gated_delta", "--models", "gla", "--tests-k", FAST_TEST,
              "--train-libs", ",".join(libs))  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check_run(out, ["simple_gla", "gated_delta"], ["gla"], libs)
    assert "| path | context |" in res.stdout  # the tables are printed last


@pytest.mark.slow  # every op and model: test_tiny_run_of_every_section covers the same code with one of each
def test_tiny_run_of_every_op_and_model(tmp_path):
    out = tmp_path / "out"
    res = run(out, "--tests-k", FAST_TEST, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check_run(out, list(gpu_check.KERNEL_OPS), ["gla", "gated_deltanet"])


def test_a_section_past_its_budget_is_killed_and_the_next_runs(tmp_path, monkeypatch, capsys):
    import psutil

    out = tmp_path / "out"
    monkeypatch.setattr(gpu_check, "KILL_GRACE", 0.0)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # main sets it for its children; restored after
    # pytest alone takes longer than 4 s to start here: the tests section is killed, pytest with it
    rc = gpu_check.main(["--tiny", "--out", str(out), "--sections", "tests,decode", "--budgets", "tests=4"])
    assert rc == 1
    statuses = {r["section"]: r["status"] for r in records(out, "section")}
    assert statuses == {"tests": "timed out (killed)", "decode": "ok"}
    assert len(records(out, "decode")) == 2
    left = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]
    assert "| tests | timed out (killed) |" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sections", "tests,bogus"], "unknown ['bogus']"),
        (["--budgets", "tests=soon"], "'tests=soon' is not SECTION=SECONDS"),
        (["--budgets", "nope=3"], "unknown section 'nope'"),
        (
            ["--train-libs", "fla,torch"],
            "--train-libs: expected some of fla, edgeattn, edgeattn-wy, edgeattn-f32g",
        ),
    ],
)
def test_bad_arguments_exit_2_in_one_line(tmp_path, args, message):
    assert_refused(run(tmp_path / "out", *args, timeout=120), message)
    assert not (tmp_path / "out").exists()


def test_without_a_gpu_the_full_sizes_are_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "o")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert_refused(res, "--tiny")


def test_fla_autotuning_is_capped_to_configs_with_num_warps_near_4():
    triton = pytest.importorskip("triton")
    configs = [
        triton.Config({"BK": bk}, num_warps=w, num_stages=st)
        for bk in (32, 64)
        for w in (1, 2, 4, 8)
        for st in (2, 3, 4)
    ]  # fla 0.6's chunk_gla intra kernel: 24 configs
    got = gpu_check.pick_configs(configs, 4)
    assert [(c.kwargs["BK"], c.num_warps, c.num_stages) for c in got] == [
        (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2)
    ]  # fmt: skip
    assert gpu_check.pick_configs(configs, 0) == configs
    assert gpu_check.pick_configs(configs[:3], 4) == configs[:3]


def test_the_cap_comes_after_the_autotuners_own_pruning(monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.runtime import autotuner

    monkeypatch.setattr(
        autotuner.Autotuner, "prune_configs", autotuner.Autotuner.prune_configs
    )  # restored after
    configs = [triton.Config({}, num_warps=w, num_stages=st) for w in (1, 2, 4, 8) for st in (2, 3)]

    def only_one_warp(configs, named_args, **kwargs):  # an early_config_prune that drops num_warps 4
        return [c for c in configs if c.num_warps == 1]

    @triton.jit
    def kernel(x):
        pass

    tuned = triton.autotune(configs, key=[], prune_configs_by={"early_config_prune": only_one_warp})(kernel)
    tuned.nargs = {}
    assert "limited to 2 configs" in gpu_check.cap_autotune(2)
    got = tuned.prune_configs({})
    assert [(c.num_warps, c.num_stages) for c in got] == [(1, 2), (1, 3)]  # capping first would leave none
    assert [c.num_warps for c in gpu_check.pick_configs(configs, 2)] == [4, 4]


@pytest.mark.parametrize("script", ["gpu_check.py", "gpu_profile.py"])
def test_an_out_that_is_a_file_is_refused_and_left_alone(tmp_path, script):
    f = tmp_path / "results"
    f.write_text("keep")
    assert_refused(run_script(ROOT / "benchmarks" / script, f, timeout=120), "exists and is not a folder")
    assert f.read_text() == "keep"


def test_kernel_forms_are_set_inside_and_restored_after():
    import torch

    from edgeattn.kernels import delta_chunk, utils

    g = torch.zeros(1, 4, 1, 2)
    with gpu_check.kernel_forms(**gpu_check.FORMS["-wy-f32g"]):
        assert delta_chunk.wy_form() == "triton"
        assert utils.chunk_local_cumsum(g, 16).shape == (1, 4, 1, 2, 1)  # float32 sums
    assert delta_chunk.wy_form() == "torch" and utils.chunk_local_cumsum(g, 16).shape == (1, 4, 1, 2, 2)
    seen = gpu_check.in_forms(lambda: (delta_chunk.WY, utils.GATE_SUM), gate_sum="float32")()
    assert seen == ("torch", "float32") and utils.GATE_SUM == "pair"


def test_our_kernels_compile_in_the_background_before_the_kernels_section(tmp_path):
    out = tmp_path / "out"
    res = run(out, "--sections", "kernels", "--ops", "simple_gla", "--lengths", "16", "--precompile", "on")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    pre = records(out, "precompile")
    assert sorted(j for r in pre for j in r["jobs"]) == ["simple_gla:triton", "simple_gla:triton-f32g"]
    assert all(r["rc"] == 0 and sorted(r["done"]) == sorted(r["jobs"]) for r in pre), pre
    assert {r["impl"] for r in records(out, "kernel_time")} >= {"triton", "triton-f32g"}
    assert "**precompile**" in (out / "results.md").read_text()


def test_the_fastest_form_of_ours_per_op_and_length():
    row = dict(kind="kernel_time", op="gla", T=2048, tflops=1.0, gbs=1.0)
    recs = [
        {**row, "impl": "fla", "ms": 1.5},
        {**row, "impl": "triton", "ms": 2.0, "vs_fla": 0.75},
        {**row, "impl": "triton-f32g", "ms": 1.0, "vs_fla": 1.5},
        {**row, "impl": "torch", "ms": 0.5},  # not one of ours
    ]
    md = gpu_check.markdown(recs)
    assert "| gla | 2048 | triton-f32g | 1.000 | 1.50 | 2.00 |" in md
