"""benchmarks/gpu_profile.py (issue 36): the launch-setting sweep and the per-kernel breakdown, run here at
tiny shapes in Triton's interpreter (--tiny). On a GPU only the sizes change (gpu_profile.SIZES). The
interpreter ignores warps and stages, so here every setting must give the shipped setting's numbers exactly;
what a setting does on a GPU is measured there (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_profile.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_profile  # noqa: E402

from tests.test_gpu_check import assert_refused, run_script  # noqa: E402


def run(out: Path, *args: str, timeout: int = 600):
    return run_script(SCRIPT, out, *args, timeout=timeout)


def test_tiny_sweep_and_breakdown_of_ours_and_fla(tmp_path):
    out = tmp_path / "out"
    res = run(out, "--ops", "gla", "--configs", "8-4-2", "--jobs", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "profile.jsonl").read_text().splitlines()]
    kinds = lambda k: [r for r in recs if r["kind"] == k]  # noqa: E731
    assert not kinds("error") and not kinds("skipped"), kinds("error") + kinds("skipped")
    (ship,) = kinds("shipped")
    shipped16 = "-".join(str(x) for x in ship["launch"]["16bit"])
    # the shipped setting is added to those asked for; each compiled in its own process, fla's op too
    assert sorted(r["job"] for r in kinds("compile")) == sorted(
        ["config 8-4-2", f"config {shipped16}", "fla gla"]
    )
    assert all(r["rc"] == 0 for r in kinds("compile")), kinds("compile")
    sweep = {r["config"]: r for r in kinds("sweep")}
    assert set(sweep) == {"8-4-2", shipped16}
    for r in sweep.values():
        assert r["op"] == "gla" and r["ms"] > 0
        assert r["max_rel_rms_vs_shipped"] == 0.0  # the interpreter ignores warps and stages
    totals = {r["impl"]: r for r in kinds("breakdown_total")}
    assert set(totals) == {"triton", "triton-f32g", "fla"} and all(t["ms"] > 0 for t in totals.values())
    for impl in ("triton", "triton-f32g", "fla"):
        rows = [r for r in kinds("kernel") if r["impl"] == impl]
        assert rows and abs(sum(r["share"] for r in rows) - 1) < 1e-6
    md = (out / "profile.md").read_text()
    assert "| setting | gla |" in md and "**gla, triton**" in md and "**gla, fla**" in md
    assert "**gla, triton-f32g**" in md and "| gla | triton-f32g |" in md


def test_tiny_forms_of_the_delta_rule(tmp_path):
    out = tmp_path / "out"
    res = run(out, "--ops", "gated_delta", "--configs", "4-4-1", "--jobs", "2", "--no-fla")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "profile.jsonl").read_text().splitlines()]
    assert not [r for r in recs if r["kind"] in ("error", "skipped")]
    forms = {r["impl"]: r for r in recs if r["kind"] == "form"}
    assert set(forms) == {"triton", "triton-wy", "triton-f32g", "triton-wy-f32g"}
    assert all(r["op"] == "gated_delta" and r["ms"] > 0 for r in forms.values())
    assert forms["triton"]["max_rel_rms_vs_shipped"] == 0.0
    # two implementations of the WY part, two forms of the gate sums: one result (float32 here)
    for impl in ("triton-wy", "triton-f32g", "triton-wy-f32g"):
        assert 0 < forms[impl]["max_rel_rms_vs_shipped"] < 1e-5, (impl, forms[impl])
    assert "| gated_delta | triton-wy-f32g |" in (out / "profile.md").read_text()


def test_the_ncu_child_runs_one_warm_forward_and_backward(tmp_path):
    res = run(tmp_path / "out", "--ncu", "simple_gla", "--ncu-impl", "triton-f32g", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # a child under ncu writes nothing of its own


def test_a_setting_reaches_every_launch_and_is_restored():
    torch = pytest.importorskip("torch")
    from edgeattn.kernels import delta_chunk, gated_chunk

    before = gpu_profile.shipped()
    try:
        gpu_profile.set_config((16, 2, 3))
        for dtype in (torch.bfloat16, torch.float32):
            assert gated_chunk.wide(dtype) == {"num_warps": 16, "num_stages": 3}
            assert gated_chunk.narrow(dtype) == {"num_warps": 2, "num_stages": 3}
            assert delta_chunk.launch(dtype) == (16, 2, 3)  # the delta-rule kernels read the same table
    finally:
        gpu_profile.set_config(before)
    assert gated_chunk.LAUNCH == before
    assert gated_chunk.launch(torch.bfloat16) == before["16bit"] != (16, 2, 3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ops", "gla,bogus"], "unknown ['bogus']"),
        (["--configs", "8-4"], "'8-4' is not WIDE-NARROW-STAGES"),
        (["--configs", "6-4-2"], "warps must be powers of two"),
        (["--ncu", "nope"], "--ncu: unknown op 'nope'"),
        (["--ncu", "gla", "--ncu-impl", "triton-wy"], "--ncu-impl: 'triton-wy' is not a form of gla"),
        (["--budget", "-1"], "--budget must be a positive"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(tmp_path, args, message):
    assert_refused(run(tmp_path / "out", *args, timeout=120), message)
    assert not (tmp_path / "out").exists()
