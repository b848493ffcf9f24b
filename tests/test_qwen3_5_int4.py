"""Qwen3.5 (tied embeddings) at int4 on the onnxruntime target: the tied embedding stored once against the
export that stores it twice, and both against transformers' forward on CPU."""

import copy

import numpy as np
import onnx
import pytest

from edgeattn.convert import import_model
from edgeattn.export import export_model
from edgeattn.export.check import DEFAULT_TOLERANCE, run_logits
from edgeattn.runtimes import open_session
from tests.hf_helpers import hf_logits, qwen3_5_text, rel_err

PREFILL = 16
N = 70
V, D = 320, 64  # hf_helpers.QWEN_TINY's vocabulary and width


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    model = qwen3_5_text(seed=3, tie_word_embeddings=True)
    root = tmp_path_factory.mktemp("qwen_int4")
    model.save_pretrained(root / "hf")
    import_model(root / "hf", root / "ckpt")
    return model, root


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(1).integers(0, V, size=(1, N)).astype(np.int64)


def export(root, name, **quantization):
    return export_model(
        root / "ckpt",
        root / name,
        precision="int4",
        prefill_chunk=PREFILL,
        include_checkpoint=False,
        force=True,
        quantization=quantization,
        prefill_logits="all",  # every position compared (logits())
    )


def logits(art, ids) -> np.ndarray:
    return run_logits(open_session(art, threads=1), ids)["logits"]  # every position, whatever prefill_logits


def test_tied_int4_embedding_stored_once_same_logits(hf, ids):
    model, root = hf
    # blocks of 32: the width D = 64 holds whole blocks (the default 128 would pad them: next test)
    # ONNX Runtime's own blocks for both (with ``offsets`` the embedding kept apart has none: next tests)
    shared = export(root, "shared", block_size=32, offsets=False)
    apart = export(root, "apart", block_size=32, share_embedding=False, offsets=False)
    graph = onnx.load(str(shared / "step.onnx"), load_external_data=False).graph
    gbq = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    heads = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1] == gbq[0].input[0]]
    assert len(gbq) == 1 and len(heads) == 1  # the embedding reads the head's packed table
    sizes = {a.name: sum(f.stat().st_size for f in a.iterdir()) for a in (shared, apart)}
    assert sizes["apart"] - sizes["shared"] >= V * D // 2  # one packed table fewer (4 bits a weight)
    got, ref = logits(shared, ids), logits(apart, ids)
    assert np.array_equal(got, ref)  # the quantizer gives both tables the same blocks and scales
    assert rel_err(got, hf_logits(model, ids)) <= DEFAULT_TOLERANCE["int4"]


def test_blocks_wider_than_the_embedding_keep_its_own_table(hf, ids):
    """Blocks of 128 over D = 64: the quantizer pads each row's block, so the embedding cannot read the
    head's padded rows; it keeps its own table, and the logits stay within int4's tolerance."""
    model, root = hf
    art = export(root, "wide", block_size=128)
    graph = onnx.load(str(art / "step.onnx"), load_external_data=False).graph
    gbq = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    heads = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1] == gbq[0].input[0]]
    assert len(gbq) == 1 and not heads
    assert rel_err(logits(art, ids), hf_logits(model, ids)) <= DEFAULT_TOLERANCE["int4"]


def test_weights_on_a_4bit_grid_are_exact_with_block_offsets(hf, ids, tmp_path):
    """Weights that already lie on llama.cpp's Q4_1 grid (per block of 32 inputs a minimum and 16 steps, as a
    GGUF holds them): the int4 export's blocks with offsets (the default) give transformers' logits of those
    weights within fp32's tolerance, the tied embedding too (it reads the head's table and offsets);
    ONNX Runtime's symmetric blocks re-round them (the 30% perplexity SmolLM2's Q4_1 lost, issue 32)."""
    import torch

    model, _ = hf
    grid = copy.deepcopy(model)
    with torch.no_grad():
        for p in grid.parameters():
            if p.dim() == 2 and p.shape[-1] % 32 == 0:
                b = p.reshape(p.shape[0], -1, 32)
                lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
                d = (hi - lo) / 15
                p.copy_((lo + d * torch.round((b - lo) / d)).reshape(p.shape))
    grid.save_pretrained(tmp_path / "hf")
    import_model(tmp_path / "hf", tmp_path / "ckpt")
    want = hf_logits(grid, ids)
    errs = {}
    for offsets in (True, False):
        art = export_model(
            tmp_path / "ckpt",
            tmp_path / f"o{offsets}",
            precision="int4",
            prefill_chunk=PREFILL,
            include_checkpoint=False,
            prefill_logits="all",
            quantization={"block_size": 32, "accuracy_level": 0, "offsets": offsets},
        )
        graph = onnx.load(str(art / "step.onnx"), load_external_data=False).graph
        if offsets:  # the tied embedding still reads the head's packed table
            gbq = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
            assert len(gbq) == 1 and any(
                n.input[1] == gbq[0].input[0] for n in graph.node if n.op_type == "MatMulNBits"
            )
        errs[offsets] = rel_err(logits(art, ids), want)
    assert errs[True] <= DEFAULT_TOLERANCE["fp32"], errs
    assert errs[False] > 10 * DEFAULT_TOLERANCE["fp32"], errs
    # the head on the last token only (optimize.last_token_logits slices the offsets' input too)
    last = export_model(
        tmp_path / "ckpt",
        tmp_path / "last",
        precision="int4",
        prefill_chunk=PREFILL,
        include_checkpoint=False,
        prefill_logits="last",
        quantization={"block_size": 32, "accuracy_level": 0, "offsets": True},
    )
    got = open_session(last, threads=1).prefill(ids[:, :PREFILL])
    assert rel_err(got, want[:, PREFILL - 1]) <= DEFAULT_TOLERANCE["fp32"]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_float16_kv_buffer_within_its_bound(hf, ids, precision):
    """A float16 KV buffer for the attention layers: the logits within ``KV_TOLERANCE`` of the float32
    buffer's export, and within the precision's tolerance plus that bound of transformers."""

    model, root = hf
    kw = dict(precision=precision, prefill_chunk=PREFILL, force=True)
    arts = {
        kv: export_model(root / "ckpt", root / f"kv{kv}{precision}", kv_dtype=kv, **kw)
        for kv in ("float32", "float16")
    }
    graph = onnx.load(str(arts["float16"] / "step.onnx"), load_external_data=False).graph
    kv_inputs = [i for i in graph.input if i.name.endswith((".key", ".value"))]
    assert kv_inputs and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in kv_inputs)
    sess = open_session(arts["float16"], threads=1)
    assert {e.dtype for e in sess.manifest.state if e.shared} == {"float16"}
    _assert_within_kv_bound(arts, "float16", ids, model, precision)


def _assert_within_kv_bound(arts, kv_dtype, ids, model, precision):
    """The ``kv_dtype`` buffer's logits: within its stated bound of the float32 buffer's (and not equal),
    within the precision's tolerance plus that bound of transformers', and `edgeattn check` agrees."""
    from edgeattn.export.check import check_artifact
    from edgeattn.export.precision import KV_TOLERANCE

    got, ref = logits(arts[kv_dtype], ids), logits(arts["float32"], ids)
    assert 0 < rel_err(got, ref) <= KV_TOLERANCE[kv_dtype]
    tol = DEFAULT_TOLERANCE[precision] + KV_TOLERANCE[kv_dtype]
    assert rel_err(got, hf_logits(model, ids)) <= tol
    report = check_artifact(arts[kv_dtype], tokens=N)  # against the torch model's float32 buffer
    assert report.ok and report.tolerance == tol
    # edgeattn's attention kernel takes float32 buffers only: this one ran on ONNX Runtime's, and check says so
    why = f"the KV buffer is {kv_dtype} (the kernel takes float32)"
    assert report.attention == {"kernel": "onnxruntime", "why": why}
    notes = " ".join(report.notes)
    assert f"GroupQueryAttention ran on ONNX Runtime's kernel: {why}" in notes


def test_released_weight_pages_fault_back_unchanged(hf, ids):
    """The session drops the resident pages of the mapped weights file after loading
    (``release_mapped_pages``); dropping them again between calls changes no logit."""
    import sys

    from edgeattn.runtimes.onnxruntime import release_mapped_pages

    _, root = hf
    art = export(root, "released")
    a, b = open_session(art, threads=1), open_session(art, threads=1)
    want = [a.prefill(ids[:, :20]), *(a.step(ids[:, t : t + 1]) for t in range(20, 30))]
    got = [b.prefill(ids[:, :20])]
    advised = release_mapped_pages(art)
    got += [b.step(ids[:, t : t + 1]) for t in range(20, 30)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    assert advised > 0 or not sys.platform.startswith("linux")


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_last_token_prefill_equals_every_token_prefill_and_transformers(hf, ids, precision):
    """``prefill_logits="last"`` (the head on the last token of a call only): prefill and steps give the
    logits of the export that computes every token's, and transformers' (fp32: within 1e-4)."""
    from edgeattn.export.check import check_artifact

    model, root = hf
    kw = dict(precision=precision, prefill_chunk=PREFILL, force=True)
    arts = {
        p: export_model(root / "ckpt", root / f"logits{p}{precision}", prefill_logits=p, **kw)
        for p in ("all", "last")
    }
    graph = onnx.load(str(arts["last"] / "step.onnx"), load_external_data=False).graph
    assert graph.output[0].type.tensor_type.shape.dim[1].dim_param == "logits"
    assert "logits_count" in [i.name for i in graph.input] and "logits_count" in [
        i.name for i in graph.initializer
    ]
    want = hf_logits(model, ids)
    runs = {}
    for p, art in arts.items():
        sess = open_session(art, threads=1)
        runs[p] = [sess.prefill(ids[:, :40]), *(sess.step(ids[:, t : t + 1]) for t in range(40, 50))]
        runs[p] = np.stack(runs[p], 1)  # [B, 11, V]: positions 39 .. 49
    assert rel_err(runs["last"], runs["all"]) <= 1e-5
    assert runs["last"].shape[1] == 11
    # the logits_count input: a call's every position on request (scoring, speculative verify), one by default
    every = {}
    for p, art in arts.items():
        sess = open_session(art, threads=1)
        every[p] = sess.run_graph("prefill", ids[:, :PREFILL], every=True)
        assert sess.run_graph("prefill", ids[:, PREFILL : 2 * PREFILL]).shape[1] == (
            1 if p == "last" else PREFILL
        )
        every[p] = np.concatenate([every[p], sess._verify(ids[:, 2 * PREFILL : 2 * PREFILL + 5])], axis=1)
    assert every["last"].shape == every["all"].shape == (1, PREFILL + 5, want.shape[2])
    assert rel_err(every["last"], every["all"]) <= 1e-5
    tol = 1e-4 if precision == "fp32" else DEFAULT_TOLERANCE["int4"]
    assert rel_err(runs["last"], want[:, 39:50]) <= tol
    report = check_artifact(arts["last"], tokens=N)
    assert report.ok and report.graphs["prefill"]["tokens"] == (N - 1) // PREFILL * PREFILL
    with pytest.raises(ValueError, match="prefill_logits"):
        export_model(root / "ckpt", root / "bad", prefill_logits="first", **kw)


@pytest.fixture(scope="module")
def int8_kv(hf):
    """The fp32 export with float32 and int8 KV buffers (int8: ONNX Runtime's quantized cache)."""
    _, root = hf
    kw = dict(precision="fp32", prefill_chunk=PREFILL, force=True)
    return {
        kv: export_model(root / "ckpt", root / f"kv8{kv}", kv_dtype=kv, **kw) for kv in ("float32", "int8")
    }


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_int8_kv_buffer_within_its_bound(hf, ids, int8_kv, precision):
    """An int8 KV buffer with calibrated per-channel scales: the graph reads and writes int8 buffers with
    the scales the manifest lists, and its logits are within ``KV_TOLERANCE["int8"]`` of the float32 buffer's
    and within the precision's tolerance plus that bound of transformers' (``edgeattn check`` too)."""

    model, root = hf
    arts = int8_kv
    if precision != "fp32":
        kw = dict(precision=precision, prefill_chunk=PREFILL, force=True)
        arts = {
            kv: export_model(root / "ckpt", root / f"kv8{kv}{precision}", kv_dtype=kv, **kw) for kv in arts
        }
    graph = onnx.load(str(arts["int8"] / "step.onnx"), load_external_data=False).graph
    kv_inputs = [i for i in graph.input if i.name.endswith((".key", ".value"))]
    assert kv_inputs and all(i.type.tensor_type.elem_type == onnx.TensorProto.INT8 for i in kv_inputs)
    inits = {i.name: i for i in graph.initializer}
    sess = open_session(arts["int8"], threads=1)
    shared = [e for e in sess.manifest.state if e.shared]
    for node in (n for n in graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
        assert attrs["kv_cache_bit_width"] == 8
        for i, scale in ((3, node.input[12]), (4, node.input[13])):  # the node's scales are the manifest's
            e = next(e for e in shared if e.input == node.input[i])
            want = np.asarray(e.scale, np.float32)[None, :, None, :]
            assert np.array_equal(onnx.numpy_helper.to_array(inits[scale]), want)
    assert {e.dtype for e in shared} == {"int8"}
    _assert_within_kv_bound(arts, "int8", ids, model, precision)


def test_int8_kv_state_round_trip(hf, ids, int8_kv):
    """get_state dequantizes an int8 KV buffer (times its scales): each slot within half a step of the float32
    buffer's, clipped to the scale's range [-128, 127] steps (ONNX Runtime's quantized cache); set_state
    quantizes it back to the same int8 values, so a session continued from it (or from its state file) gives
    the same logits as the one that made it."""
    _, root = hf
    a, b, f = (open_session(art, threads=1) for art in (int8_kv["int8"], int8_kv["int8"], int8_kv["float32"]))
    a.prefill(ids[:, :40])
    f.prefill(ids[:, :40])
    state, state32 = a.get_state(), f.get_state()
    for e in (e for e in a.manifest.state if e.shared):
        assert state[e.input].dtype == np.float32
        step = np.asarray(e.scale, np.float32)[None, :, None, :]
        held = np.clip(state32[e.input], -128 * step, 127 * step)
        assert np.all(np.abs(state[e.input] - held) <= step / 2 * (1 + 1e-5) + 1e-7)
        assert np.abs(state[e.input][:, :, :40]).max() > 0 and not state[e.input][:, :, 40:].any()
    b.set_state(state, position=a.position)
    np.testing.assert_array_equal(b._kv_np[-1], a._kv_np[-1])  # the same int8 slots
    tail = ids[:, 40:46]
    want = [a.step(tail[:, t : t + 1]) for t in range(tail.shape[1])]
    np.testing.assert_array_equal([b.step(tail[:, t : t + 1]) for t in range(tail.shape[1])], want)
    path = root / "int8.state"
    b.reset()
    b.set_state(state, position=40)
    b.save_state(path)
    c = open_session(int8_kv["int8"], threads=1)
    c.load_state(path)
    np.testing.assert_array_equal([c.step(tail[:, t : t + 1]) for t in range(tail.shape[1])], want)


def test_int8_kv_bad_input(hf, tmp_path, monkeypatch):
    """One-line errors: --kv-dtype int8 on a model without KV buffers; an int8 buffer whose logits leave
    the stated bound fails the export; streams, which hold int8 KV buffers in their batch rows, refuse an int8
    state tensor that is not a KV buffer (no export makes one: a manifest edited here)."""
    from typer.testing import CliRunner

    from edgeattn.artifact.manifest import Manifest
    from edgeattn.cli.main import app
    from edgeattn.export import precision
    from edgeattn.runtimes.streams import SerialStreams, Streams, open_streams
    from tests.export_helpers import make_checkpoint

    _, root = hf
    gla = make_checkpoint(tmp_path / "gla", "gla")
    res = CliRunner().invoke(app, ["export", str(gla), "--out", str(tmp_path / "o"), "--kv-dtype", "int8"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "no KV buffers" in lines[0] and "--kv-dtype float32" in lines[0]
    monkeypatch.setitem(precision.KV_TOLERANCE, "int8", 1e-9)  # a bound no int8 buffer meets
    with pytest.raises(ValueError, match=r"int8 KV buffer: its logits differ .* --kv-dtype float32") as err:
        export_model(root / "ckpt", tmp_path / "tight", prefill_chunk=PREFILL, kv_dtype="int8")
    assert "\n" not in str(err.value) and not (tmp_path / "tight").exists()
    monkeypatch.undo()
    art = export_model(
        root / "ckpt", tmp_path / "dyn", dynamic_batch=True, kv_dtype="int8", prefill_chunk=PREFILL
    )
    streams, reason = open_streams(art)  # batched: no fallback to one stream at a time
    assert type(streams) is Streams and reason is None
    m = streams.manifest
    data = copy.deepcopy(m.data)
    data["max_length"] += 1  # the int8 buffers' slot axis no longer the buffer length
    with pytest.raises(ValueError, match=r"is int8 but not a KV buffer .* --kv-dtype float32") as err:
        Streams(Manifest(m.root, data))
    assert "\n" not in str(err.value)
    streams, reason = open_streams(Manifest(m.root, data))  # the server's fallback, through a session
    assert isinstance(streams, SerialStreams) and "int8" in reason


def test_int8_kv_streams_equal_the_session(hf, ids, tmp_path):
    """Streams over the int8-KV export (--dynamic-batch) hold the KV buffers in int8, a quarter of float32's
    bytes, and give each prompt the greedy tokens of ``Session.generate_ids`` on the same artifact, with the
    session's state after the same tokens. The prompts have one length: rows at different positions get
    keys rotated apart from the lone session's (``test_rotary_rows_at_different_positions``)."""
    from edgeattn.runtimes.streams import Streams

    _, root = hf
    art = export_model(
        root / "ckpt", tmp_path / "dyn", dynamic_batch=True, kv_dtype="int8", prefill_chunk=PREFILL
    )
    streams = Streams(art, max_streams=3)
    kv = [(e, a) for e, a in zip(streams.manifest.state, streams._bufs[0]) if e.shared]
    assert kv and all(e.dtype == "int8" and a.dtype == np.int8 for e, a in kv)
    assert all(a.nbytes == 3 * np.prod(e.shape) for e, a in kv)  # 3 rows of 1 byte a slot, not float32's 4
    prompts = [ids[0, s : s + PREFILL + 5] for s in (0, 20, 40)]
    sids = [streams.add(p, temperature=0, max_new_tokens=8, stop_ids=[]) for p in prompts]
    while streams.live:
        streams.step()
    for p, sid in zip(prompts, sids):
        sess = open_session(art, threads=1)
        want = list(sess.generate_ids(p, 8, temperature=0, stop_ids=[]))
        assert streams.generated(sid) == want
        got, ref = streams.get_state(sid), sess.get_state()
        for e in streams.manifest.state:
            step = 0 if e.scale is None else np.asarray(e.scale, np.float32)[None, :, None, :] * (1 + 1e-5)
            assert got[e.input].dtype == np.float32
            assert np.all(np.abs(got[e.input] - ref[e.input]) <= step + 1e-5 + 1e-5 * np.abs(ref[e.input]))


def test_rotary_rows_at_different_positions(hf, ids, tmp_path):
    """A batch-N step of rows at different positions equals each row's lone session: every row's keys and
    queries are rotated from its own position. (The rotary the graph runs itself, for rotary dims that
    GroupQueryAttention's tables do not take, rotated every row from row 0's position: the rows below the
    longest got logits ~1e-2 apart.)"""
    from edgeattn.runtimes.streams import Streams

    _, root = hf
    art = export_model(root / "ckpt", tmp_path / "dyn32", dynamic_batch=True, prefill_chunk=PREFILL)
    streams = Streams(art, max_streams=2)
    prompts = [ids[0, :21], ids[0, 30:33]]
    sids = [streams.add(p, temperature=0) for p in prompts]
    refs = [open_session(art, threads=1) for _ in prompts]
    logits = [r.prefill(p[None])[0] for r, p in zip(refs, prompts)]
    got = streams.step()
    for sid, r, lg in zip(sids, refs, logits):
        assert got[sid] == int(np.argmax(lg))
        np.testing.assert_allclose(streams.logits(sid), r.step(np.array([[got[sid]]]))[0], atol=1e-4)


def test_check_reports_perplexity_as_transformers_gives_it(hf, tmp_path):
    """`edgeattn check`'s perplexity (the torch model's and the artifact's, over the check text's tokens)
    equals exp of the mean negative log-likelihood of transformers' own logits over those tokens."""
    import torch

    from edgeattn.export.check import check_artifact

    model, root = hf
    art = export_model(root / "ckpt", tmp_path / "fp32", prefill_chunk=PREFILL, force=True)
    text = b"def area(width, height):\n    return width * height\n" * 4
    report = check_artifact(art, tokens=40, text=text)
    ids = np.asarray(open_session(art).tokenizer.encode(text.decode())[:41], np.int64)[None]
    logp = torch.log_softmax(torch.from_numpy(hf_logits(model, ids[:, :-1])[0]).double(), -1)
    want = float(torch.exp(-logp[torch.arange(ids.shape[1] - 1), torch.from_numpy(ids[0, 1:])].mean()))
    assert report.perplexity["torch"] == pytest.approx(want, rel=1e-4)
    assert report.perplexity["artifact"] == pytest.approx(want, rel=1e-4)
