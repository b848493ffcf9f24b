"""Export: valid ONNX, logits equal to PyTorch over prefill chunks then steps, state files, bad input."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edgeattn.export import Manifest, export_model
from edgeattn.export.check import check_artifact, run_logits
from edgeattn.export.compat import tensorrt_report
from edgeattn.export.optimize import checkable
from edgeattn.models import EdgeLM
from edgeattn.runtimes import open_session
from tests.export_helpers import EXPORTABLE, HYBRID, PREFILL, make_checkpoint, text_ids


class _Checkpoints(dict):
    """Checkpoints made on first use, once per test module."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, mixer):
        self[mixer] = make_checkpoint(self.root / mixer.replace(",", "_"), mixer)
        return self[mixer]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("ckpt"))


def torch_logits(ckpt, ids):
    model = EdgeLM.load(ckpt).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids))[0].numpy()


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("mixer", [*EXPORTABLE, HYBRID])
def test_artifact_matches_pytorch_over_300_tokens(ckpts, tmp_path, mixer, target):
    # every position of the prefill graph against PyTorch: --prefill-logits all (one graph defaults to last)
    art = export_model(
        ckpts[mixer], tmp_path / "art", target=target, prefill_chunk=PREFILL, prefill_logits="all"
    )
    for g in sorted(p.name for p in art.glob("*.onnx")):  # one graph (fused mixers) or step and prefill
        model = onnx.load(str(art / g))
        onnx.checker.check_model(checkable(model), full_check=True)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
        if target == "portable":
            assert tensorrt_report(model) == []
    ids = text_ids(300)
    ref = torch_logits(ckpts[mixer], ids)
    got = run_logits(open_session(art), ids)
    n_prefill = got["prefill"].shape[1]
    assert n_prefill == (300 // PREFILL) * PREFILL and got["step"].shape[1] == 300 - n_prefill
    full = np.concatenate([got["prefill"], got["step"]], axis=1)
    scale = np.abs(ref).max()
    assert np.abs(full - ref).max() <= 1e-4 * max(scale, 1.0), np.abs(full - ref).max()


def test_fused_target_uses_the_contrib_op_and_portable_does_not(ckpts, tmp_path):
    fused = export_model(ckpts["gla"], tmp_path / "fused", target="onnxruntime", prefill_chunk=PREFILL)
    portable = export_model(ckpts["gla"], tmp_path / "portable", target="portable", prefill_chunk=PREFILL)
    assert not (fused / "prefill.onnx").exists()  # one graph serves step and prefill
    for g in ("step.onnx", "prefill.onnx"):
        if g == "step.onnx":
            ops = {(n.domain, n.op_type) for n in onnx.load(str(fused / g)).graph.node}
            assert ("com.microsoft", "LinearAttention") in ops
        ops = {(n.domain, n.op_type) for n in onnx.load(str(portable / g)).graph.node}
        assert all(d in ("", "ai.onnx") for d, _ in ops)
        assert not {"Loop", "Scan"} & {o for _, o in ops}


def test_rwkv_export_prints_no_unused_custom_opset_warning(ckpts, tmp_path, capfd):
    """torch's C++ exporter printed "Custom opset domain: 'com.microsoft' provided is not used in the model"
    (twice) for the RWKV export, whose traced graphs have no contrib op: the domain is no longer declared up
    front (torch declares com.microsoft version 1 when a traced op uses it, as the fused GLA's does)."""
    capfd.readouterr()
    art = export_model(ckpts["rwkv"], tmp_path / "rwkv", target="onnxruntime", prefill_chunk=PREFILL)
    err = capfd.readouterr().err
    assert "Custom opset domain" not in err and "com.microsoft" not in err, err
    fused = export_model(ckpts["gla"], tmp_path / "gla", target="onnxruntime", prefill_chunk=PREFILL)
    assert "Custom opset domain" not in capfd.readouterr().err
    graph = onnx.load(str(fused / "step.onnx"), load_external_data=False)
    assert ("com.microsoft", 1) in {(o.domain, o.version) for o in graph.opset_import}
    assert (art / "edgeattn.json").is_file()


@pytest.mark.parametrize("mixer", ["gla", "retnet", "linear"])
def test_one_head_exports_to_the_fused_op(tmp_path, mixer):
    """Regression: a one-head GLA crashed the torch ONNX exporter's peephole pass on the onnxruntime
    target (the traced body of the fused op); the graph now holds the contrib op and matches PyTorch."""
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer, n_heads=1)
    art = export_model(
        ckpt, tmp_path / "art", target="onnxruntime", prefill_chunk=PREFILL, prefill_logits="all"
    )
    ops = {
        (n.domain, n.op_type)
        for n in onnx.load(
            str(art / json.loads((art / "edgeattn.json").read_text())["graphs"]["prefill"]["path"])
        ).graph.node
    }
    assert ("com.microsoft", "LinearAttention") in ops
    ids = text_ids(2 * PREFILL + 5)
    ref = torch_logits(ckpt, ids)
    got = run_logits(open_session(art), ids)
    full = np.concatenate([got["prefill"], got["step"]], axis=1)
    assert np.abs(full - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0)


def test_manifest_alone_drives_a_raw_inference_session(ckpts, tmp_path):
    art = export_model(ckpts["retnet"], tmp_path / "art", target="portable", prefill_chunk=PREFILL)
    manifest = json.loads((art / "edgeattn.json").read_text())
    ids = text_ids(40)
    sessions = {g: ort.InferenceSession(str(art / info["path"])) for g, info in manifest["graphs"].items()}
    state = {s["input"]: np.zeros(s["shape"], dtype=s["dtype"]) for s in manifest["state"]}
    C = manifest["graphs"]["prefill"]["tokens"]
    logits = []
    for start, graph in [(0, "prefill"), (C, "prefill")] + [(t, "step") for t in range(2 * C, 40)]:
        n = manifest["graphs"][graph]["tokens"]
        outs = sessions[graph].run(None, {"input_ids": ids[:, start : start + n], **state})
        logits.append(outs[0])
        state = {s["input"]: o for s, o in zip(manifest["state"], outs[1:])}
    sess = open_session(art)
    # not bitwise: a plain session prepacks its matrices, edgeattn's (one shared copy of the weights) does not
    np.testing.assert_allclose(np.concatenate(logits, 1)[:, -1], sess.prefill(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ["gla", "swa", "softmax", "gated_deltanet", "mamba2"])
def test_state_saved_mid_stream_continues_exactly_in_a_fresh_session(ckpts, tmp_path, mixer):
    art = export_model(ckpts[mixer], tmp_path / "art", prefill_chunk=PREFILL)
    ids = text_ids(60)
    a = open_session(art)
    a.prefill(ids[:, :37])
    a.save_state(tmp_path / "s.safetensors")
    expected = [a.step(ids[:, t : t + 1]) for t in range(37, 60)]
    b = open_session(art)
    b.load_state(tmp_path / "s.safetensors")
    assert b.position == 37
    got = [b.step(ids[:, t : t + 1]) for t in range(37, 60)]
    np.testing.assert_array_equal(np.stack(got), np.stack(expected))


def test_state_of_another_model_is_refused(ckpts, tmp_path):
    a = open_session(export_model(ckpts["gla"], tmp_path / "a", prefill_chunk=PREFILL))
    other = make_checkpoint(tmp_path / "other_ckpt", "gla", seed=1)
    b = open_session(export_model(other, tmp_path / "b", prefill_chunk=PREFILL))
    a.prefill(text_ids(5))
    a.save_state(tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match="another model"):
        b.load_state(tmp_path / "s.safetensors")


@pytest.mark.parametrize(
    "precision, weights, max_rel", [("fp16", None, 3e-2), ("int8", None, 0.3), ("int8", "u8", 0.3)]
)
def test_reduced_precision_keeps_state_float32_and_stays_close(ckpts, tmp_path, precision, weights, max_rel):
    """int8 by default is weight-only (8-bit MatMulNBits, one graph); ``u8`` ONNX Runtime's dynamic
    quantization (integer MatMuls, two graphs)."""
    q = {"weights": weights} if weights else None
    art = export_model(
        ckpts["gla"], tmp_path / "art", precision=precision, prefill_chunk=PREFILL, quantization=q
    )
    m = Manifest.load(art)
    for g in ("step", "prefill"):
        graph = onnx.load(str(m.graph_path(g))).graph
        io = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
        assert all(
            io[e.input] == onnx.TensorProto.FLOAT and io[e.output] == onnx.TensorProto.FLOAT for e in m.state
        )
    if precision == "int8":
        nodes = onnx.load(str(m.graph_path("step"))).graph.node
        ops = {n.op_type for n in nodes}
        if weights == "u8":
            assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
            assert m.graph_path("step") != m.graph_path("prefill")
        else:
            assert not ops & {"MatMulInteger", "DynamicQuantizeMatMul"}
            bits = {a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
            assert bits == {8} and m.graph_path("step") == m.graph_path("prefill")
    report = check_artifact(art, tokens=120)
    assert report.ok and all(r["rel"] <= max_rel for r in report.graphs.values())
    assert abs(report.bpb["artifact"] - report.bpb["torch"]) < 0.05 * report.bpb["torch"]


def test_aft_full_is_refused_with_a_pointer_to_aft(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ck", "aft_full", max_seq_len=32)
    with pytest.raises(ValueError, match="'aft'"):
        export_model(ckpt, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_interrupted_export_leaves_no_directory(ckpts, tmp_path, monkeypatch):
    import edgeattn.export.exporter as exporter

    calls = []
    real = exporter._export_graph

    def interrupt_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(exporter, "_export_graph", interrupt_on_second)
    with pytest.raises(KeyboardInterrupt):
        export_model(ckpts["gla"], tmp_path / "art", one_graph=False)  # two graphs: stop at the second
    assert list(tmp_path.iterdir()) == []


def test_edited_graph_and_future_manifest_are_refused(ckpts, tmp_path):
    art = export_model(ckpts["gla"], tmp_path / "art", prefill_chunk=PREFILL)
    data = json.loads((art / "edgeattn.json").read_text())
    data["format_version"] = 99
    (art / "edgeattn.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format_version 99"):
        open_session(art)
    data["format_version"] = 1
    (art / "edgeattn.json").write_text(json.dumps(data))
    with open(art / "step.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="sha256"):
        open_session(art)


def test_session_refuses_bad_token_ids_and_too_long_softmax_prompts(ckpts, tmp_path):
    sess = open_session(export_model(ckpts["gla"], tmp_path / "a", prefill_chunk=PREFILL))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        sess.step([[256]])
    with pytest.raises(ValueError, match="batch 1"):
        sess.prefill(np.zeros((2, 3), dtype=np.int64))
    soft = make_checkpoint(tmp_path / "soft", "softmax", max_seq_len=40)
    sess = open_session(export_model(soft, tmp_path / "s", prefill_chunk=PREFILL))
    sess.prefill(text_ids(40))
    with pytest.raises(ValueError, match="maximum of 40"):
        sess.step([[1]])


def test_too_old_onnxruntime_names_the_portable_target(ckpts, tmp_path, monkeypatch):
    art = export_model(ckpts["gla"], tmp_path / "a", prefill_chunk=PREFILL)
    monkeypatch.setattr(ort, "__version__", "1.30.0")
    with pytest.raises(ValueError, match="--target portable"):
        open_session(art)


# ----------------------------------------------------------------------------------------------------------
# fp16 of a trained model: gates far from their initial values, activations well above 1
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_gla(tmp_path_factory):
    """A small GLA trained for 30 steps on Python source: enough for fp16 to fail without float32 regions."""
    from edgeattn.export.check import default_text
    from tests.export_helpers import tiny_config

    torch.manual_seed(0)
    model = EdgeLM(tiny_config("gla", d_model=128, chunk_size=64))
    data = torch.frombuffer(bytearray(default_text(100_000)), dtype=torch.uint8).long()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
        batch = torch.stack([data[s : s + 129] for s in starts])  # [8, 129]
        logits, _ = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 3.5  # it learned something: bytes are no longer uniform (ln 256 = 5.5)
    return model.save(tmp_path_factory.mktemp("trained") / "gla")


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_fp16_of_a_trained_gla_passes_check(trained_gla, tmp_path, target):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the exporter's precision warning would fail the test
        art = export_model(
            trained_gla, tmp_path / "art", target=target, precision="fp16", prefill_chunk=PREFILL
        )
    for g in (
        "step.onnx",
        "prefill.onnx",
    ):  # valid ONNX: nodes in topological order (TensorRT's parser needs it)
        onnx.checker.check_model(checkable(onnx.load(str(art / g))), full_check=True)
    weights = [
        i
        for i in onnx.load(
            str(art / json.loads((art / "edgeattn.json").read_text())["graphs"]["prefill"]["path"])
        ).graph.initializer
        if len(i.dims) == 2
    ]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)  # still an fp16 graph
    report = check_artifact(art, tokens=120)
    assert report.ok, {g: r["rel"] for g, r in report.graphs.items()}
    assert abs(report.bpb["artifact"] - report.bpb["torch"]) < 0.01 * report.bpb["torch"]


def test_exporter_warns_when_reduced_precision_is_far_off(trained_gla, tmp_path, monkeypatch):
    """Without the float32 regions (the converter's own block list only) the trained model is off: say so."""
    import edgeattn.export.precision as precision

    monkeypatch.setattr(precision, "FP32_REGIONS", [])
    monkeypatch.setattr(precision, "_drop_round_trips", lambda model: None)
    with pytest.warns(precision.PrecisionWarning, match=r"differ from float32's by .* more than the 0.03"):
        art = export_model(
            trained_gla, tmp_path / "art", target="portable", precision="fp16", prefill_chunk=PREFILL
        )
    assert not check_artifact(art, tokens=120).ok  # and check agrees
