"""benchmarks/decode_floor.py: the weights-only graph holds every weight product of a model and nothing else,
wired as the model wires it (checked against numpy and against the model's own outputs), the head on one
token; the attention-only graph is the model's GroupQueryAttention over its own buffers (against numpy); the
verdict adds the attention to the products; bad options are one line."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "decode_floor.py"


def _module():
    spec = importlib.util.spec_from_file_location("decode_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(tmp_path: Path) -> tuple[Path, dict]:
    """x [1, T, 256] -> q = x @ Wq (a weight product), s = q @ q^T (two activations: not one), small =
    x @ Ws (256 x 8: under the weight size), h = RMS-free head: x[:, :, :16] @ Wh (16 x 8192: the head)."""
    rng = np.random.default_rng(0)
    w = {
        "Wq": rng.standard_normal((256, 256)).astype(np.float32),
        "Ws": rng.standard_normal((256, 8)).astype(np.float32),
        "Wh": rng.standard_normal((16, 8192)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q_proj"),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "qt"], ["s"], name="scores"),
        helper.make_node("MatMul", ["x", "Ws"], ["small"], name="small"),
        helper.make_node("Slice", ["x", "st", "en", "ax"], ["x16"]),
        helper.make_node("MatMul", ["x16", "Wh"], ["logits"], name="head"),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()]
    inits += [
        numpy_helper.from_array(np.array([0], np.int64), "st"),
        numpy_helper.from_array(np.array([16], np.int64), "en"),
        numpy_helper.from_array(np.array([2], np.int64), "ax"),
    ]
    graph = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 256])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("s", "small", "logits")],
        inits,
    )
    d = tmp_path / "genai-tiny"
    d.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(d / "model.onnx"))
    return d, w


def test_weight_products_are_the_models_own_and_the_head_runs_on_one_token(tmp_path):
    mod = _module()
    d, w = _model(tmp_path)
    model, count, nbytes, inputs = mod.weight_products(mod.graph_path(str(d)))
    assert count == 2  # q_proj and the head: not the scores (two activations), not the small product
    assert nbytes == w["Wq"].nbytes + w["Wh"].nbytes
    assert inputs == {"x256": [1, "T", 256], "head16": [1, 1, 16]}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x, h = (
        rng.standard_normal((1, 5, 256)).astype(np.float32),
        rng.standard_normal((1, 1, 16)).astype(np.float32),
    )
    outs = sess.run(None, {"x256": x, "head16": h})
    np.testing.assert_allclose(outs[0], x @ w["Wq"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs[1], h @ w["Wh"], rtol=1e-4, atol=1e-4)


def test_block_offset_products_are_wired_as_the_export_wires_them(tmp_path):
    """edgeattn's int4 with block offsets (``offset_blocks``): codes plus the two offset products give the
    original projection's output; without ``offsets`` only the MatMulNBits remains."""
    from edgeattn.export.precision import offset_blocks

    mod = _module()
    rng = np.random.default_rng(2)
    W = rng.standard_normal((256, 512)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")],
        "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, "W")],
    )
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    offset_blocks(m, 32, 0)
    d = tmp_path / "edgeattn-tiny"
    d.mkdir()
    onnx.save(m, str(d / "step.onnx"))
    x = rng.standard_normal((1, 3, 256)).astype(np.float32)
    want = ort.InferenceSession(str(d / "step.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]
    ref = x @ W
    assert np.sqrt(np.mean((want - ref) ** 2) / np.mean(ref**2)) < 0.2  # the int4 projection itself is sane

    plain, n_plain, _, _ = mod.weight_products(d / "step.onnx")
    assert n_plain == 1 and plain.graph.node[0].op_type == "MatMulNBits"
    full, n_full, _, inputs = mod.weight_products(d / "step.onnx", offsets=True)
    assert n_full == 3 and inputs == {"x256": [1, "T", 256]}
    outs = ort.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x256": x}
    )
    codes = [o for n, o in zip(full.graph.node, outs) if n.op_type == "MatMulNBits"][0]
    offsets = outs[[n.name for n in full.graph.node].index(full.graph.node[-1].name)]
    np.testing.assert_allclose(codes + offsets, want, rtol=1e-5, atol=1e-4)


def test_empty_chain_is_n_nodes_of_one_add_each():
    mod = _module()
    m = mod.empty_chain(37)
    assert len(m.graph.node) == 37
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"a0": np.zeros(1, np.float32)})[0].tolist() == [37.0]


def test_report_of_a_log_gives_the_verdict_per_precision_class(tmp_path):
    """A log of two rounds: the int4 target from llama.cpp Q4_0 alone, the fp32 one from Q8_0 alone."""

    def floor(ms, tps):
        w = {"products": 1, "weight_bytes": 2**20, "ms_1": ms, "tps_prefill": tps}
        return {"weights": w, "nodes": 10, "empty_nodes_ms": 0.01}

    def whole(ms, tps):
        return {"whole": {"contexts": {}}, "decode_ms": ms, "prefill_tps": tps, "other": 0.0}

    attention = {"nodes": 2, "ms_1": 0.5, "prefill_ms": 100.0, "chunk": 256}
    rows = [
        ("edgeattn-x-int4", {**whole(8.0, 700.0), "floor": {**floor(4.0, 900.0), "attention": attention}}),
        ("llama-x-q4_0", whole(6.0, 800.0)),
        ("edgeattn-x", {**whole(20.0, 700.0), "floor": floor(19.0, 900.0)}),
        ("llama-x-q8_0", whole(12.0, 600.0)),
    ]
    log = tmp_path / "floor.jsonl"
    log.write_text(
        "".join(json.dumps({"model": m, "round": r, "result": res}) + "\n" for r in (0, 1) for m, res in rows)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(log)], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    v = out["verdict"]
    assert v["int4"]["decode_target_ms"] == pytest.approx(5.0) and v["int4"][
        "prefill_target_tps"
    ] == pytest.approx(960.0)
    assert v["fp32"]["decode_target_ms"] == pytest.approx(10.0) and v["fp32"][
        "prefill_target_tps"
    ] == pytest.approx(720.0)
    # with the attention: 4.0 + 0.5 ms within 5.0; 512 / (512 / 900 + 0.1) = 765 tok/s below 960
    assert v["int4"]["models"]["edgeattn-x-int4"] == {
        "decode_floor_under_target": True,
        "prefill_floor_over_target": False,
        "decode_floor_with_attention_under_target": True,
        "prefill_floor_with_attention_over_target": False,
    }
    row = next(r for r in out["rows"] if r["model"] == "edgeattn-x-int4")
    assert row["floor_ms_1"]["median"] == pytest.approx(4.5)
    assert row["floor_tps_prefill"]["median"] == pytest.approx(512 / (512 / 900 + 0.1))
    assert v["fp32"]["models"]["edgeattn-x"] == {
        "decode_floor_under_target": False,
        "prefill_floor_over_target": True,
    }
    assert out["rounds"] == 2


def test_attention_only_graph_is_the_models_attention_over_its_own_buffers(tmp_path):
    """A model whose GroupQueryAttention (4 query heads on 2 KV heads of 8, no rotary) reads KV buffers of 32
    slots: the attention-only graph has that node, buffers of the graph's own shape, and over a 5-token
    prefill from an empty buffer gives numpy's causal grouped attention and writes the keys into the buffer."""
    mod = _module()
    H, KV, D, L, T = 4, 2, 8, 32, 5
    node = helper.make_node(
        "GroupQueryAttention",
        ["qin", "kin", "vin", "past_key_values.0.key", "past_key_values.0.value", "seqlens", "total"],
        ["attn", "present.0.key", "present.0.value"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=KV,
    )
    kv_shape = [1, KV, L, D]
    graph = helper.make_graph(
        [node],
        "m",
        [
            helper.make_tensor_value_info("qin", TensorProto.FLOAT, [1, "T", H * D]),
            helper.make_tensor_value_info("kin", TensorProto.FLOAT, [1, "T", KV * D]),
            helper.make_tensor_value_info("vin", TensorProto.FLOAT, [1, "T", KV * D]),
            helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, kv_shape),
            helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, kv_shape),
            helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output],
    )
    path = tmp_path / "model.onnx"
    onnx.save(
        helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        ),
        str(path),
    )
    model, buffers, widths = mod.attention_nodes(path, 1000)
    assert [n.op_type for n in model.graph.node] == ["GroupQueryAttention"]
    assert buffers == {"past0.key": kv_shape, "past0.value": kv_shape}
    assert widths == {"q": H * D, "k": KV * D, "v": KV * D}
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, T, n * D)).astype(np.float32) for n in (H, KV, KV))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    zeros = np.zeros(kv_shape, np.float32)
    out, key, _ = sess.run(
        None,
        {
            "q": q,
            "k": k,
            "v": v,
            "past0.key": zeros,
            "past0.value": zeros,
            "seqlens_k": np.array([T - 1], np.int32),
            "total_sequence_length": np.array(T, np.int32),
        },
    )
    qh, kh, vh = (x.reshape(T, -1, D).transpose(1, 0, 2) for x in (q, k, v))
    want = []
    for h in range(H):
        s = qh[h] @ kh[h // (H // KV)].T / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        want.append((p / p.sum(-1, keepdims=True)) @ vh[h // (H // KV)])
    want = np.stack(want, 1).reshape(1, T, H * D)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(key[0, :, :T], kh, rtol=0, atol=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", str(ROOT / "docs")], "error: " + str(ROOT / "docs") + " holds neither step.onnx"),
        (["--model", str(ROOT / "docs"), "--llama", "x.gguf"], "error: --llama needs --llama-python"),
        (["--report", str(ROOT / "README.md")], "error: --report "),
        ([], "error: give at least one --model"),
        (["--model", str(ROOT / "docs"), "--log", "/nonexistent/floor.jsonl"], "error: --log /nonexistent/"),
    ],
)
def test_a_bad_option_is_one_line(args, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(message) and len(res.stderr.strip().splitlines()) == 1, res.stderr
