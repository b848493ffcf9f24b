"""`edgeattn analyze` through CliRunner on a tiny checkpoint: the table, the JSON line, the plots, the
captured q/k/v, FAVOR+'s error shrinking with its features, and bad input (one error line, exit 2)."""

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from edgeattn.bench.approx import COST, approximation_error, capture_qkv, crossover
from edgeattn.cli import analyze
from edgeattn.models import EdgeLM
from edgeattn.ops import attention
from tests.export_helpers import make_checkpoint

runner = CliRunner()
app = typer.Typer()
analyze.register(app)
app.command("noop")(lambda: None)  # two commands, so that `analyze` is a subcommand as in main.py

FAST = ["--features", "4,128", "--buckets", "2,4", "--landmarks", "4,16", "--lengths", "32,64"]
FAST += [
    "--repeats",
    "1",
    "--seeds",
    "4",
    "--tokens",
    "96",
    "--length",
    "64",
    "--heads",
    "2",
    "--head-dim",
    "16",
]


def invoke(*args):
    return runner.invoke(app, ["analyze", *[str(a) for a in args]])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("c") / "ck", "softmax,gla")


@pytest.fixture(scope="module")
def result(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("plots")
    res = invoke(ckpt, *FAST, "--out", out)
    assert res.exit_code == 0, res.output
    return res.output, json.loads(res.output.strip().splitlines()[-1]), out


def test_table_json_and_plots(result):
    text, doc, out = result
    assert "relative Frobenius error" in text and "needs fewer FLOPs than softmax from T =" in text
    assert set(doc["errors"]) == {"random", "L0:softmax", "L1:gla"}
    for rows in doc["errors"].values():
        got = {(r["method"], r["value"]) for r in rows}
        assert got == {("linear", None), ("performer", 4), ("performer", 128), ("rff", 4), ("rff", 128)} | {
            ("lsh", 2),
            ("lsh", 4),
            ("nystrom", 4),
            ("nystrom", 16),
        }
    assert {(r["method"], r["T"]) for r in doc["cost"]} >= {("softmax", 32), ("linear", 64), ("lsh", 64)}
    assert all(r["time_s"] > 0 and r["flops"] > 0 for r in doc["cost"])
    for name in ("error_vs_features.png", "time_vs_length.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(doc["plots"]) == sorted(
        str(out / n) for n in ("error_vs_features.png", "time_vs_length.png")
    )


def test_favor_error_shrinks_with_features_on_the_checkpoint(result):
    _, doc, _ = result
    for source in ("L0:softmax", "L1:gla"):
        err = {r["value"]: r["error"] for r in doc["errors"][source] if r["method"] == "performer"}
        assert err[128] < err[4], (source, err)


def test_errors_are_those_of_the_checkpoints_qkv(ckpt, result):
    """The reported linear error of layer 0 recomputed by hand: embedding, the block's norm, the mixer's
    projections, then elu+1 linear attention against causal softmax."""
    _, doc, _ = result
    model = EdgeLM.load(ckpt).eval()
    import os
    from pathlib import Path

    ids = torch.tensor(list(Path(os.__file__).read_bytes()[:96]))[None]
    with torch.no_grad():
        x = model.blocks[0].norm1(model.embed(ids))
        m = model.blocks[0].mixer
        q, k, v = (p(x).view(1, 96, 2, 16) for p in (m.q_proj, m.k_proj, m.v_proj))
        want = approximation_error(attention(q, k, v, method="linear"), attention(q, k, v, method="softmax"))
        captured = capture_qkv(model, ids)
    got = next(r["error"] for r in doc["errors"]["L0:softmax"] if r["method"] == "linear")
    assert got == pytest.approx(want, rel=1e-6)
    assert [(i, n) for i, n, _ in captured] == [(0, "softmax"), (1, "gla")]
    assert torch.equal(captured[0][2][0], q)


def test_crossover_from_the_formulas():
    # linear: 4 T d^2 + 4 T d < 4 T^2 d  <=>  T > d + 1
    assert (
        crossover(lambda T: COST["linear"].flops(T, 32, {}), lambda T: COST["softmax"].flops(T, 32, {})) == 34
    )
    # performer: 8 T m d < 4 T^2 d  <=>  T > 2 m
    opts = {"m": 16}
    assert (
        crossover(lambda T: COST["performer"].flops(T, 8, opts), lambda T: COST["softmax"].flops(T, 8, opts))
        == 33
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/ckpt"], "is not a directory"),
        (["--features", "a,b"], "--features must be comma-separated integers"),
        (["--buckets", "3"], "--buckets must be 1 or even"),
        (["--no-random"], "nothing to analyze"),
        (["--lengths", "0"], "--lengths must be"),
    ],
)
def test_bad_input_is_one_error_line(args, message):
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("spread", [1.6, 300.0], ids=["within a decade", "several decades"])
def test_error_plot_legends_sit_below_and_labels_span_the_values(tmp_path, monkeypatch, spread):
    """error_vs_features.png: each legend lies outside its panel (it covered the lines), and the y axis is
    labelled with plain numbers on both sides of the values (a log axis was labelled at 0.8-1.0 only, as
    6x10^-1, while the values reached 1.3)."""
    pytest.importorskip("matplotlib")
    figures = []

    def keep(fig, path):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            box, legend = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
            ticks = [
                (t.get_position()[1], t.get_text())
                for t in ax.get_yticklabels()
                if t.get_text() and ax.get_ylim()[0] <= t.get_position()[1] <= ax.get_ylim()[1]
            ]
            ys = [y for line in ax.get_lines() for y in line.get_ydata()]
            figures.append((box, legend, ticks, ys, ax.get_yscale()))
        return str(path)

    monkeypatch.setattr(analyze, "_save_png", keep)
    rows = []
    for method, values in (("performer", (4, 128)), ("rff", (4, 128)), ("lsh", (2, 4)), ("nystrom", (4, 16))):
        rows += [
            {"method": method, "value": v, "error": 1.3 / spread ** (i / 1)} for i, v in enumerate(values)
        ]
    errors = {"random": rows, "L0:softmax": [dict(r, error=r["error"] * 0.9) for r in rows]}
    analyze._plots(tmp_path, errors, [{"method": "softmax", "T": 32, "time_s": 1e-3}])
    for box, legend, ticks, ys, scale in figures[:3]:  # the three panels of error_vs_features.png
        assert legend.y1 <= box.y0 or not legend.overlaps(box), (legend, box)
        assert len(ticks) >= 2 and all(float(text) > 0 for _, text in ticks)  # plain numbers
        labelled = sorted(float(text) for _, text in ticks)
        if scale == "log":
            step = max(b / a for a, b in zip(labelled, labelled[1:]))
            assert labelled[0] <= min(ys) * step and labelled[-1] >= max(ys) / step, (labelled, ys)
        else:
            step = max(b - a for a, b in zip(labelled, labelled[1:]))
            assert labelled[0] <= min(ys) + step and labelled[-1] >= max(ys) - step, (labelled, ys)
    assert figures[0][4] == ("log" if spread > 10 else "linear")
