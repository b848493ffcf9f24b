"""One copy of the weights (weights.bin shared by both graphs), --no-checkpoint, and int4 (MatMulNBits)."""

import hashlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from edgeattn.export import Manifest, export_model
from edgeattn.export.check import check_artifact, run_logits
from edgeattn.export.manifest import sha256_file
from edgeattn.export.weights import MIN_BYTES
from edgeattn.models import EdgeLM
from edgeattn.runtimes import open_session
from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession
from tests.export_helpers import PREFILL, make_checkpoint, text_ids

GRAPHS = ("step", "prefill")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {m: make_checkpoint(root / m.replace(",", "_"), m) for m in ("gla", "gla,softmax")}


def raw_logits(art: Manifest, ids, so_factory) -> np.ndarray:
    """Prefill chunks then steps through plain InferenceSessions that load the graphs as they are."""
    sessions = {g: ort.InferenceSession(str(art.graph_path(g)), so_factory()) for g in GRAPHS}
    state = {
        e.input: np.zeros([0 if isinstance(d, str) else d for d in e.shape], np.float32) for e in art.state
    }
    C, out, t = art.prefill_tokens, [], 0
    while t < ids.shape[1]:
        g, n = ("prefill", C) if ids.shape[1] - t >= C else ("step", 1)
        res = sessions[g].run(None, {"input_ids": ids[:, t : t + n], **state})
        out.append(res[0])
        state = {e.input: v for e, v in zip(art.state, res[1:])}
        t += n
    return np.concatenate(out, 1)


def options(prepack: bool):
    from edgeattn.runtimes import attention

    lib = attention.library()[0]  # the GroupQueryAttention kernel the runtime's CPU sessions register

    def make():
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        if lib is not None:
            so.register_custom_ops_library(str(lib))
        return so

    return make


def initializer_bytes(path) -> dict[str, bytes]:
    """Every initializer of a self-contained graph, by name: its raw bytes."""
    return {i.name: numpy_helper.to_array(i).tobytes() for i in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("mixer", ["gla", "gla,softmax"])
def test_shared_weights_equal_todays_layout_bitwise(ckpts, tmp_path, mixer):
    # two graphs (gla alone would export one graph for both: tests/test_one_graph.py)
    two = dict(prefill_chunk=PREFILL, one_graph=False)
    shared = Manifest.load(export_model(ckpts[mixer], tmp_path / "shared", **two))
    legacy = Manifest.load(export_model(ckpts[mixer], tmp_path / "legacy", shared_weights=False, **two))
    assert shared.weights is not None and legacy.weights is None
    ids = text_ids(2 * PREFILL + 9)
    # the graphs are today's graphs: ONNX Runtime loading either layout by itself gives the same bits
    for prepack in (True, False):
        np.testing.assert_array_equal(
            raw_logits(shared, ids, options(prepack)), raw_logits(legacy, ids, options(prepack))
        )
    # the session that shares one OrtValue per weight between its two graphs (prepacking off) as well
    got = run_logits(open_session(shared.root), ids)
    want = raw_logits(legacy, ids, options(prepack=False))
    np.testing.assert_array_equal(np.concatenate([got["prefill"], got["step"]], 1), want)
    # and with share_weights=False each graph loads and prepacks its own copy, as a plain session does
    sess = OnnxRuntimeSession(shared, share_weights=False)
    got = run_logits(sess, ids)
    want = raw_logits(legacy, ids, options(prepack=True))
    np.testing.assert_array_equal(np.concatenate([got["prefill"], got["step"]], 1), want)


def test_weights_stored_once_and_covered_by_the_manifest(ckpts, tmp_path):
    two = dict(prefill_chunk=PREFILL, one_graph=False)  # two graphs sharing one weights.bin
    legacy = export_model(ckpts["gla"], tmp_path / "legacy", shared_weights=False, **two)
    art = export_model(ckpts["gla"], tmp_path / "shared", include_checkpoint=False, **two)
    data = json.loads((art / "edgeattn.json").read_text())
    assert set(data["files"]) == {"step.onnx", "prefill.onnx", "weights.bin"}
    for name, info in data["files"].items():
        assert info["sha256"] == sha256_file(art / name) and info["bytes"] == (art / name).stat().st_size
    # the large initializers of today's graphs, once each by content
    big = {b for g in ("step.onnx", "prefill.onnx") for b in initializer_bytes(legacy / g).values()}
    big = {b for b in big if len(b) >= MIN_BYTES}
    blob = (art / "weights.bin").read_bytes()
    stored = [blob[t["offset"] : t["offset"] + t["length"]] for t in data["weights"]["tensors"]]
    assert len(stored) == len(set(stored)) == len(big) and set(stored) == big
    assert len(blob) < sum(len(b) for b in big) + 4096 * len(big)  # no second copy, only alignment padding
    for g in ("step.onnx", "prefill.onnx"):
        graph = onnx.load(str(art / g), load_external_data=False).graph
        inline = [i for i in graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL]
        assert all(len(i.raw_data) < MIN_BYTES for i in inline)
        assert (art / g).stat().st_size < 0.2 * len(blob)
    assert not (art / "checkpoint").exists()
    # a corrupted weights file is refused like a corrupted graph
    with open(art / "weights.bin", "r+b") as f:
        f.seek(data["weights"]["tensors"][0]["offset"])
        f.write(b"\x01\x02")
    with pytest.raises(ValueError, match="weights.bin does not match its sha256"):
        open_session(art)


def test_no_checkpoint_artifact_runs_and_torch_and_check_say_what_they_need(ckpts, tmp_path):
    art = export_model(ckpts["gla"], tmp_path / "a", prefill_chunk=PREFILL, include_checkpoint=False)
    assert open_session(art).prefill(text_ids(20)).shape == (1, 256)
    with pytest.raises(ValueError, match="--no-checkpoint"):
        open_session(art, backend="torch")
    with pytest.raises(ValueError, match="check compares it with its PyTorch model .*--no-checkpoint"):
        check_artifact(art, tokens=20)


def test_cli_export_no_checkpoint_and_int4_options(ckpts, tmp_path):
    import typer
    from typer.testing import CliRunner

    from edgeattn.cli import check, export

    app = typer.Typer()
    export.register(app)
    check.register(app)
    runner = CliRunner()
    out = tmp_path / "a"
    res = runner.invoke(app, ["export", str(ckpts["gla"]), "--out", str(out), "--no-checkpoint"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["check", str(out), "--tokens", "20"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "--no-checkpoint" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(
        app,
        [
            "export",
            str(ckpts["gla"]),
            "--out",
            str(tmp_path / "b"),
            "--precision",
            "int4",
            "--target",
            "portable",
        ],
    )
    assert res.exit_code == 2 and "target 'onnxruntime'" in res.output, res.output
    res = runner.invoke(
        app,
        [
            "export",
            str(ckpts["gla"]),
            "--out",
            str(tmp_path / "c"),
            "--precision",
            "int4",
            "--int4-block-size",
            "48",
        ],
    )
    assert res.exit_code == 2 and "power of two" in res.output, res.output
    assert not (tmp_path / "c").exists()
    res = runner.invoke(
        app,
        ["export", str(ckpts["gla"]), "--out", str(tmp_path / "d"), "--precision", "int4"]
        + ["--int4-block-size", "16", "--int4-asymmetric"],
    )
    assert res.exit_code == 0, res.output
    nodes = onnx.load(str(tmp_path / "d" / "step.onnx"), load_external_data=False).graph.node
    attrs = {a.name: a for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute}
    assert attrs["block_size"].i == 16
    assert any(n.op_type == "MatMulNBits" and len(n.input) >= 4 and n.input[3] for n in nodes)  # zero points
    assert not any(n.name.endswith("_offsets") for n in nodes)  # no block offsets but from a GGUF's
    res = runner.invoke(
        app,
        ["export", str(ckpts["gla"]), "--out", str(tmp_path / "e"), "--precision", "int4", "--int4-offsets"],
    )
    assert res.exit_code == 0, res.output
    nodes = onnx.load(str(tmp_path / "e" / "step.onnx"), load_external_data=False).graph.node
    coded = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert coded and all(len(n.input) == 3 for n in coded)  # symmetric codes, offsets beside them:
    assert len([n for n in nodes if n.op_type == "MatMul" and n.name.endswith("_offsets")]) == 2 * len(coded)


INT4_MAX_REL = 0.15  # max |logit diff| / max |logit| against the fp32 PyTorch model, d_model 64


def test_int4_graph_uses_matmulnbits_and_stays_within_its_bound(tmp_path):
    # weights at the training init scale (std 0.02), d_model 64 so that a block of 32 is a fraction of a row
    torch.manual_seed(0)
    from tests.export_helpers import tiny_config

    ckpt = EdgeLM(tiny_config("gla", d_model=64, n_heads=2)).save(tmp_path / "ckpt")
    art = export_model(ckpt, tmp_path / "int4", precision="int4", prefill_chunk=PREFILL)
    m = Manifest.load(art)
    for g in GRAPHS:
        graph = onnx.load(str(m.graph_path(g)), load_external_data=False).graph
        weights = {i.name for i in graph.initializer}
        ops = [(n.domain, n.op_type) for n in graph.node]
        assert ("com.microsoft", "MatMulNBits") in ops and ("com.microsoft", "GatherBlockQuantized") in ops
        # no projection left in float32: every MatMul left multiplies two activations
        assert not [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & weights]
        assert not [n for n in graph.node if n.op_type == "Gather" and n.input[0] in weights]
    ids = text_ids(2 * PREFILL + 9)
    with torch.no_grad():
        want = EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()
    got = run_logits(open_session(art), ids)["logits"]  # every position (one graph: stepped through)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= INT4_MAX_REL, rel
    assert rel > 1e-4  # it really is quantized
    assert (
        hashlib.sha256((art / "weights.bin").read_bytes()).hexdigest()
        == m.data["files"]["weights.bin"]["sha256"]
    )


def test_share_weights_dedupes_by_content_and_renames_clashing_names(tmp_path):
    from onnx import TensorProto, helper

    from edgeattn.export.weights import share_weights

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 16, 16)).astype(np.float32)

    def graph(path, weights: dict):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])
        nodes = [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("MatMul", ["h", "w2"], ["y"]),
        ]
        inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
        onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits)), str(path))

    # g1: w1 = a, w2 = b; g2: the same name w1 holds b (a clash), w2 holds b again (a duplicate)
    graph(tmp_path / "g1.onnx", {"w1": a, "w2": b})
    graph(tmp_path / "g2.onnx", {"w1": b, "w2": b})
    x = rng.standard_normal((1, 16)).astype(np.float32)
    want = [x @ a @ b, x @ b @ b]
    table = share_weights(tmp_path, ["g1.onnx", "g2.onnx"])
    assert len(table["tensors"]) == 2 and (tmp_path / "weights.bin").stat().st_size <= 4096 + 2 * a.nbytes
    for g, w in zip(("g1.onnx", "g2.onnx"), want):
        got = ort.InferenceSession(str(tmp_path / g)).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, w, rtol=1e-5)
    names = {n for t in table["tensors"] for n in t["names"]}
    assert "w1" in names and "w2" in names and len(names) == 3  # g2's w1 got a new name


def test_a_small_initializer_is_never_shadowed_by_another_graphs_shared_one(tmp_path):
    """Graph a keeps a small initializer "w" inline; graph b's large "w" is shared: a session of a must
    still see its own "w" when the shared tensors are handed to it by name."""
    from onnx import helper

    from edgeattn.export.weights import share_weights

    def graph(name, n):
        w = numpy_helper.from_array(np.full(n, 2.0 if n > 8 else 3.0, np.float32), "w")
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n])
        y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [n])
        g = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], name, [x], [y], [w])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / name))

    graph("a.onnx", 4)  # 16 bytes: stays inside the graph
    graph("b.onnx", MIN_BYTES)  # 4 KiB: moves to weights.bin
    table = share_weights(tmp_path, ["a.onnx", "b.onnx"])
    names = [n for t in table["tensors"] for n in t["names"]]
    assert names and "w" not in names  # the shared one was renamed, as were b's nodes
    so = ort.SessionOptions()
    data = np.fromfile(tmp_path / table["path"], np.uint8)
    values = []  # they must outlive the sessions
    for t in table["tensors"]:
        values.append(
            ort.OrtValue.ortvalue_from_numpy(data[t["offset"] : t["offset"] + t["length"]].view(np.float32))
        )
        for n in t["names"]:
            so.add_initializer(n, values[-1])
    for g, n, want in (("a.onnx", 4, 3.0), ("b.onnx", MIN_BYTES, 2.0)):
        s = ort.InferenceSession(str(tmp_path / g), so, providers=["CPUExecutionProvider"])
        assert np.all(s.run(None, {"x": np.ones(n, np.float32)})[0] == want)


def test_int4_accuracy_level_is_an_export_option(ckpts, tmp_path):
    """``--int4-accuracy-level``: MatMulNBits' attribute on every int4 product (the default 4 where it is not
    given); off int4, or outside 0..4, refused in one line with nothing written."""
    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    ckpt = str(ckpts["gla,softmax"])
    runner = CliRunner()
    for extra, words in [
        (["--precision", "int4", "--int4-accuracy-level", "7"], "accuracy_level is int4's"),
        (["--int4-accuracy-level", "1"], "--int4-accuracy-level (accuracy_level): for --precision int4 only"),
        (
            ["--precision", "fp32", "--int8-weights", "u8"],
            "--int8-weights (weights): for --precision int8 only",
        ),
    ]:
        res = runner.invoke(app, ["export", ckpt, "--out", str(tmp_path / "bad"), *extra])
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output
        assert not (tmp_path / "bad").exists()
    torch.manual_seed(0)  # the model of the int4 bound's test (weights at the init scale, d_model 64)
    from tests.export_helpers import tiny_config

    ckpt = str(EdgeLM(tiny_config("gla", d_model=64, n_heads=2)).save(tmp_path / "ckpt"))
    ids = text_ids(48)
    want = run_logits(open_session(export_model(ckpt, tmp_path / "fp32")), ids)["logits"]
    for name, extra, level in [("a1", ["--int4-accuracy-level", "1"], 1), ("a4", [], 4)]:
        res = runner.invoke(
            app, ["export", ckpt, "--out", str(tmp_path / name), "--precision", "int4", *extra]
        )
        assert res.exit_code == 0, res.output
        graph = onnx.load(str(tmp_path / name / "step.onnx"), load_external_data=False).graph
        levels = [
            a.i
            for n in graph.node
            if n.op_type == "MatMulNBits"
            for a in n.attribute
            if a.name == "accuracy_level"
        ]
        assert levels and set(levels) == {level}
        got = run_logits(open_session(tmp_path / name), ids)["logits"]
        assert np.abs(got - want).max() <= INT4_MAX_REL * np.abs(want).max()
