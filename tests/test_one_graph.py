"""One graph for step and prefill (onnxruntime target, fused mixers): equal to today's two graphs."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgeattn.export import Manifest, export_model
from edgeattn.export.check import run_logits
from edgeattn.export.exporter import ONE_GRAPH_MIXERS, TOKEN_AXIS
from edgeattn.runtimes import open_session
from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession
from tests.export_helpers import PREFILL, make_checkpoint, text_ids

TOL = dict(rtol=1e-5, atol=1e-5)


def close(a, b):
    np.testing.assert_allclose(a, b, **TOL)


def pair(tmp_path, mixer: str):
    """The same checkpoint exported as one graph (the default here) and as today's two graphs."""
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer)
    one = export_model(
        ckpt, tmp_path / "one", prefill_chunk=PREFILL, include_checkpoint=False, prefill_logits="all"
    )
    two = export_model(
        ckpt, tmp_path / "two", prefill_chunk=PREFILL, include_checkpoint=False, one_graph=False
    )
    return Manifest.load(one), Manifest.load(two)


@pytest.mark.parametrize("mixer", [*sorted(ONE_GRAPH_MIXERS), "gla,gated_deltanet", "gla,softmax", "softmax"])
def test_one_graph_equals_two_graphs(tmp_path, mixer):
    one, two = pair(tmp_path, mixer)
    data = json.loads((one.root / "edgeattn.json").read_text())
    assert data["graphs"] == {
        "step": {"path": "step.onnx", "tokens": 1},
        "prefill": {"path": "step.onnx", "tokens": PREFILL},
    }
    assert set(data["files"]) == {"step.onnx", "weights.bin"}
    assert two.graph_path("prefill") != two.graph_path("step")
    dim = onnx.load(str(one.graph_path("step")), load_external_data=False).graph.input[0].type.tensor_type
    assert dim.shape.dim[1].dim_param == TOKEN_AXIS

    s1 = open_session(one.root, threads=1)
    assert s1.sessions["step"] is s1.sessions["prefill"]  # one InferenceSession, one copy of the weights
    ids = text_ids(2 * PREFILL + 5)
    got = run_logits(s1, ids)
    # today's two graphs, prepacked as the one graph is (each its own copy): the same bits; with the two
    # graphs sharing one unpacked copy (the default for them), the same within float32 rounding
    for share, check in ((False, np.testing.assert_array_equal), (True, close)):
        s2 = OnnxRuntimeSession(two, threads=1, share_weights=share)
        want = run_logits(s2, ids)
        for g in ("prefill", "step"):
            check(got[g], want[g])
        a, b = s1.get_state(), s2.get_state()
        assert a.keys() == b.keys()
        for k in a:
            check(a[k], b[k])


@pytest.mark.parametrize("mixer", ["gla", "mamba2"])
def test_int4_one_graph_equals_two_graphs(tmp_path, mixer):
    """int4 is one graph too (one session, one prepacked copy of the quantized weights): its logits and
    state are the bits of today's two int4 graphs."""
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer)
    kw = dict(precision="int4", prefill_chunk=PREFILL, include_checkpoint=False)
    with pytest.warns(Warning):  # a tiny random model quantizes poorly: the precision warning, both forms
        one = Manifest.load(export_model(ckpt, tmp_path / "one", prefill_logits="all", **kw))
        two = Manifest.load(export_model(ckpt, tmp_path / "two", one_graph=False, **kw))
    assert one.graph_path("prefill") == one.graph_path("step")
    assert two.graph_path("prefill") != two.graph_path("step")
    ops = {n.op_type for n in onnx.load(str(one.graph_path("step")), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    s1, s2 = open_session(one.root, threads=1), open_session(two.root, threads=1)
    assert s1.sessions["step"] is s1.sessions["prefill"]
    ids = text_ids(2 * PREFILL + 5)
    got, want = run_logits(s1, ids), run_logits(s2, ids)
    for g in ("prefill", "step"):
        np.testing.assert_array_equal(got[g], want[g])
    a, b = s1.get_state(), s2.get_state()
    for k in b:
        np.testing.assert_array_equal(a[k], b[k])


def test_one_graph_takes_any_number_of_tokens(tmp_path):
    """A raw ONNX Runtime run of 7 tokens in one call equals the two-graph session's 7 steps."""
    one, two = pair(tmp_path, "gla")
    ids = text_ids(7, seed=3)
    sess = ort.InferenceSession(str(one.graph_path("step")))
    zeros = {e.input: np.zeros(e.shape, np.float32) for e in one.state}
    out = sess.run(None, {"input_ids": ids, **zeros})
    s2 = open_session(two.root)
    want = np.concatenate([s2.run_graph("step", ids[:, t : t + 1]) for t in range(7)], 1)
    np.testing.assert_allclose(out[0], want, **TOL)
    state = s2.get_state()
    for e, v in zip(one.state, out[1:]):
        np.testing.assert_allclose(v, state[e.input], **TOL)


def test_prefill_chunk_equals_an_export_with_that_prefill_chunk(tmp_path):
    """``prefill(ids, chunk=C)`` on a one-graph artifact gives what an artifact exported with --prefill-chunk C
    gives from its own prefill; a two-graph artifact takes its own chunk only (one line), and a chunk must be
    a positive integer."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "gated_deltanet")
    ids = text_ids(23, seed=5)
    base = open_session(export_model(ckpt, tmp_path / "c4", prefill_chunk=4, include_checkpoint=False))
    assert base.any_tokens  # one graph, any number of tokens per call
    calls, run = [], base._run_tokens
    base._run_tokens = lambda x: calls.append(x.shape[1]) or run(x)
    for chunk, lengths in ((4, [4] * 5 + [3]), (8, [8, 8, 7]), (23, [23]), (64, [23])):
        other = open_session(
            export_model(ckpt, tmp_path / f"c{chunk}x", prefill_chunk=chunk, include_checkpoint=False)
        )
        want = other.prefill(ids)
        base.reset()
        calls.clear()
        np.testing.assert_allclose(base.prefill(ids, chunk=chunk), want, rtol=1e-5, atol=1e-5)
        assert calls == lengths  # the graph calls, chunk tokens each
        assert base.position == other.position == ids.shape[1]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk must be a positive integer"):
            base.prefill(ids, chunk=bad)
    two = open_session(
        export_model(
            make_checkpoint(tmp_path / "mixed", "gla,flash"), tmp_path / "two", prefill_chunk=PREFILL,
            include_checkpoint=False,
        )
    )  # fmt: skip
    assert not two.any_tokens
    with pytest.raises(ValueError, match=f"takes exactly {PREFILL} tokens a call, not {PREFILL + 1}"):
        two.prefill(ids, chunk=PREFILL + 1)
    np.testing.assert_array_equal(
        two.prefill(ids, chunk=PREFILL), open_session(two.manifest.root).prefill(ids)
    )


def test_state_round_trip_between_layouts(tmp_path):
    """A state saved by the one-graph session continues in a fresh one and in the two-graph session alike."""
    one, two = pair(tmp_path, "gated_deltanet")
    a = open_session(one.root)
    a.prefill(text_ids(PREFILL + 3))
    path = tmp_path / "state.npz"
    a.save_state(path)
    nxt = np.array([[7]], np.int64)
    want = a.step(nxt)
    for root in (one.root, two.root):
        b = open_session(root)
        b.load_state(path)
        np.testing.assert_allclose(b.step(nxt), want, **TOL)


def test_other_models_keep_two_graphs(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla,flash")
    art = Manifest.load(
        export_model(ckpt, tmp_path / "mixed", prefill_chunk=PREFILL, include_checkpoint=False)
    )
    assert art.graph_path("prefill").name == "prefill.onnx"
    gla = make_checkpoint(tmp_path / "gla", "gla")
    port = export_model(
        gla, tmp_path / "port", target="portable", prefill_chunk=PREFILL, include_checkpoint=False
    )
    assert Manifest.load(port).graph_path("prefill").name == "prefill.onnx"
    with pytest.raises(ValueError, match="one_graph needs"):
        export_model(ckpt, tmp_path / "x", one_graph=True, include_checkpoint=False)


def test_one_graph_is_as_lean_as_the_step_graph(tmp_path):
    """The optimizer folds the token-dependent reshape targets: no Shape arithmetic, the step graph's ops."""
    one, two = pair(tmp_path, "gla")

    def ops(path):
        return sorted(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)

    got, want = ops(one.graph_path("step")), ops(two.graph_path("step"))
    assert "Shape" not in got and "Concat" not in got
    # the two graphs store the tied table once, the step's Gather reads E^T by column and a Transpose
    # follows; the fp32 one graph keeps E for a row Gather (test_tied_embedding.py)
    want.remove("Transpose")
    assert [o for o in got if o != "Constant"] == [o for o in want if o != "Constant"]


@pytest.mark.parametrize("mixer", ["gla", "mamba2"])
def test_prefill_rest_is_one_call(tmp_path, mixer, monkeypatch):
    """The one-graph session prefills full chunks, then the rest in one call (not single steps); the logits
    and state equal the two-graph session's chunks and steps."""
    one, two = pair(tmp_path, mixer)
    ids = text_ids(3 * PREFILL + 5)
    s2 = OnnxRuntimeSession(two, threads=1, share_weights=False)
    want = s2.prefill(ids)
    s1 = OnnxRuntimeSession(one, threads=1)
    assert s1.any_tokens and not s2.any_tokens
    calls = []
    run = s1._run_tokens
    monkeypatch.setattr(s1, "_run_tokens", lambda x: calls.append(x.shape[1]) or run(x))
    close(s1.prefill(ids), want)
    assert calls == [PREFILL] * 3 + [5] and s1.position == ids.shape[1]
    a, b = s1.get_state(), s2.get_state()
    for k in a:
        close(a[k], b[k])
