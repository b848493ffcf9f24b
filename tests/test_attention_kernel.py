"""edgeattn's CPU GroupQueryAttention kernel (edgeattn/runtimes/attention.cc) against ONNX Runtime's own kernel
for the same node (the reference: an independent implementation), bound in place as the runtime binds a KV
buffer. The Python runtime running it on the real SmolLM2-135M-Instruct: tests/test_smollm.py
``test_attention_kernel_agrees_with_onnxruntimes``."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

from edgeattn.runtimes import attention

# (B, S, H, Hkv, D, L, R, past per row): decode, chunked prefill over a past, a first prompt, rows at different
# positions, groups of 1-12 query heads, head sizes that are and are not multiples of 16, no rotary, partial
# rotary, long contexts that the kernel splits across threads (past 8000 and 4500), prefills of several blocks
# of 16 query tokens (40, 33) and one whose scores it splits (64 tokens over 6000)
CASES = [
    (1, 1, 8, 2, 256, 64, 64, [40]),
    (1, 16, 8, 2, 256, 64, 64, [20]),
    (1, 24, 8, 2, 256, 64, 64, [0]),
    (2, 1, 8, 2, 256, 64, 64, [5, 33]),
    (1, 3, 4, 2, 16, 32, 16, [7]),
    (2, 3, 4, 2, 16, 32, 16, [0, 0]),
    (1, 5, 6, 2, 32, 40, 32, [9]),
    (1, 1, 9, 3, 64, 64, 0, [50]),
    (1, 7, 9, 3, 64, 64, 0, [3]),
    (1, 1, 3, 3, 24, 20, 0, [4]),
    (1, 1, 16, 2, 64, 40, 64, [30]),
    (1, 1, 8, 2, 256, 9000, 64, [8000]),
    (1, 2, 16, 2, 64, 5000, 32, [4500]),
    (3, 1, 16, 2, 64, 5000, 32, [4500, 17, 2999]),
    (1, 40, 8, 2, 64, 100, 32, [30]),
    (1, 64, 8, 2, 128, 7000, 32, [6000]),
    (1, 33, 12, 1, 64, 200, 0, [50]),
]


@pytest.fixture(scope="module")
def lib(kernels_library):
    return kernels_library


def _model(H, Hkv, D, L, R, **extra) -> bytes:
    f, vi = TP.FLOAT, helper.make_tensor_value_info
    names = ["q", "k", "v", "pk", "pv", "sk", "tot"] + (["cos", "sin"] if R else [])
    attrs = {"do_rotary": 1, "rotary_interleaved": 0} if R else {}
    node = helper.make_node(
        "GroupQueryAttention", names, ["o", "ok", "ov"], domain="com.microsoft",
        num_heads=H, kv_num_heads=Hkv, scale=D**-0.5, **attrs, **extra,
    )  # fmt: skip
    shapes = {
        "q": (f, ["B", "S", H * D]), "k": (f, ["B", "S", Hkv * D]), "v": (f, ["B", "S", Hkv * D]),
        "pk": (f, ["B", Hkv, L, D]), "pv": (f, ["B", Hkv, L, D]), "sk": (TP.INT32, ["B"]),
        "tot": (TP.INT32, []), "cos": (f, [L, max(R, 2) // 2]), "sin": (f, [L, max(R, 2) // 2]),
    }  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [vi(n, *shapes[n]) for n in names], [vi(n, f, None) for n in ("o", "ok", "ov")]
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model.SerializeToString()


def _session(model: bytes, library=None, threads: int = 2):
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _feeds(B, S, H, Hkv, D, L, R, past, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    sk = np.array(past, np.int32) + S - 1
    feeds = {
        "q": rng.standard_normal((B, S, H * D)).astype(np.float32),
        "k": rng.standard_normal((B, S, Hkv * D)).astype(np.float32),
        "v": rng.standard_normal((B, S, Hkv * D)).astype(np.float32),
        "pk": rng.standard_normal((B, Hkv, L, D)).astype(np.float32),
        "pv": rng.standard_normal((B, Hkv, L, D)).astype(np.float32),
        "sk": sk,
        "tot": np.array(int(sk.max()) + 1, np.int32),
    }
    if R:
        angle = np.arange(L)[:, None] * (1e4 ** (-np.arange(R // 2) / (R // 2)))[None]
        feeds["cos"], feeds["sin"] = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    return feeds


def _run_in_place(sess, feeds: dict) -> np.ndarray:
    """Run with the caches bound as both past and present (what the runtime does); returns the output."""
    io, vals = sess.io_binding(), {}
    for name, a in feeds.items():
        vals[name] = ort.OrtValue.ortvalue_from_numpy(a)
        io.bind_ortvalue_input(name, vals[name])
    io.bind_output("o")
    io.bind_ortvalue_output("ok", vals["pk"])
    io.bind_ortvalue_output("ov", vals["pv"])
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-S{}-H{}/{}-D{}-L{}-R{}-past{}".format(*c))
def test_kernel_equals_onnxruntimes_groupqueryattention(lib, case):
    B, S, H, Hkv, D, L, R, past = case
    model = _model(H, Hkv, D, L, R)
    ref, ours = _feeds(*case), _feeds(*case)
    want = _run_in_place(_session(model), ref)
    got = _run_in_place(_session(model, lib), ours)
    assert got.shape == want.shape == (B, S, H * D)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the new keys (rotated) and values written into the buffer at the same slots, the rest untouched
    np.testing.assert_allclose(ours["pk"], ref["pk"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours["pv"], ref["pv"])
    untouched = _feeds(*case)
    for b, p in enumerate(past):
        np.testing.assert_array_equal(ours["pv"][b, :, :p], untouched["pv"][b, :, :p])
        np.testing.assert_array_equal(ours["pv"][b, :, p + S :], untouched["pv"][b, :, p + S :])


def test_kernel_output_does_not_depend_on_threads(lib):
    case = (1, 1, 8, 2, 256, 9000, 64, [8000])
    model = _model(*case[2:7])
    one = _run_in_place(_session(model, lib, threads=1), _feeds(*case))
    four = _run_in_place(_session(model, lib, threads=4), _feeds(*case))
    assert np.abs(one - four).max() <= 1e-6 * np.abs(one).max()


def test_a_form_it_does_not_take_refuses_at_load(lib):
    """local_window_size (sliding window): the library refuses the node when the session is made, so the
    runtime loads the graph without it (ONNX Runtime's kernel)."""
    with pytest.raises(Exception, match="unsupported: local_window_size"):
        _session(_model(8, 2, 64, 32, 0, local_window_size=8), lib)
    _session(_model(8, 2, 64, 32, 0, local_window_size=8))  # loads without the library


def test_environment_choice(monkeypatch):
    monkeypatch.setenv(attention.ENV, "onnxruntime")
    assert attention.chosen() == "onnxruntime"
    monkeypatch.setenv(attention.ENV, "fastest")
    with pytest.raises(
        ValueError, match="EDGEATTN_ATTENTION must be one of edgeattn, onnxruntime, got 'fastest'"
    ):
        attention.chosen()


def test_no_headers_or_no_compiler_is_a_reason_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(attention, "headers", lambda: None)
    path, why = attention.library(cache=tmp_path)
    assert path is None and "headers" in why
    monkeypatch.undo()
    if attention.headers() is None:
        pytest.skip("no ONNX Runtime headers here")
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    path, why = attention.library(cache=tmp_path)
    assert path is None and "could not build attention.cc" in why
    assert not list(tmp_path.glob("*.so"))  # nothing half-written left behind
