"""Dynamic-batch export: symbolic leading dimension, batch-N calls equal N batch-1 calls (KV buffers at a
position per row), what cannot batch refused."""

import json

import numpy as np
import onnxruntime as ort
import pytest

from edgeattn.export import Manifest, export_model
from edgeattn.runtimes import open_session
from tests.export_helpers import PREFILL, make_checkpoint, text_ids

B = 3


def _random_feeds(m: Manifest, tokens: int, rng) -> dict:
    feeds = {"input_ids": rng.integers(0, 256, (B, tokens)).astype(np.int64)}
    for e in m.state:
        shape = [B] + [2 if isinstance(d, str) else d for d in e.shape[1:]]
        feeds[e.input] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        if e.name == "position":  # a different position per row (FLASH's chunk, the window's ring)
            feeds[e.input] = np.array([0.0, 5.0, 11.0][:B], np.float32).reshape(shape)
    return feeds


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
@pytest.mark.parametrize("mixer", ["gla", "gated_deltanet", "mamba2", "flash", "swa", "aft_local"])
def test_batch_n_call_equals_n_batch_one_calls(tmp_path, mixer, target):
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer)
    art = export_model(ckpt, tmp_path / "art", target=target, prefill_chunk=PREFILL, dynamic_batch=True)
    m = Manifest.load(art)
    assert m.dynamic_batch and m.batch_size == 1
    assert json.loads((art / "edgeattn.json").read_text())["dynamic_batch"] is True
    rng = np.random.default_rng(0)
    for graph, tokens in (("prefill", PREFILL), ("step", 1)):
        sess = ort.InferenceSession(str(m.graph_path(graph)))
        for a in [*sess.get_inputs(), *sess.get_outputs()]:
            assert a.shape[0] == "batch", (a.name, a.shape)
        feeds = _random_feeds(m, tokens, rng)
        together = sess.run(None, feeds)
        for b in range(B):
            alone = sess.run(None, {k: v[b : b + 1] for k, v in feeds.items()})
            for x, y in zip(together, alone):
                np.testing.assert_allclose(x[b : b + 1], y, rtol=0, atol=1e-5)


def test_dynamic_artifact_runs_in_a_batch_one_session_like_a_fixed_one(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    fixed = export_model(ckpt, tmp_path / "fixed", prefill_chunk=PREFILL)
    dyn = export_model(ckpt, tmp_path / "dyn", prefill_chunk=PREFILL, dynamic_batch=True)
    assert Manifest.load(fixed).dynamic_batch is False
    ids = text_ids(PREFILL + 3)
    a, b = open_session(fixed), open_session(dyn)
    np.testing.assert_allclose(a.prefill(ids), b.prefill(ids), rtol=0, atol=1e-5)
    np.testing.assert_allclose(a.step(ids[:, :1]), b.step(ids[:, :1]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp16", "int4", "int8"])  # int8: its default weight-only blocks
def test_reduced_precision_streams_equal_single_sessions(tmp_path, precision):
    from edgeattn.runtimes.streams import Streams

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", precision=precision, prefill_chunk=PREFILL, dynamic_batch=True)
    streams = Streams(art)
    prompts = [text_ids(5 + 7 * i, i)[0] for i in range(3)]
    sids = [streams.add(p, temperature=0, max_new_tokens=6, stop_ids=[]) for p in prompts]
    while streams.live:
        streams.step()
    for sid, p in zip(sids, prompts):
        assert streams.generated(sid) == list(
            open_session(art).generate_ids(p, 6, temperature=0, stop_ids=[])
        )


def test_int8_with_a_dynamic_batch_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    with pytest.raises(ValueError, match="int8 quantizes activations with one scale per tensor"):
        export_model(
            ckpt, tmp_path / "art", precision="int8", dynamic_batch=True, quantization={"weights": "u8"}
        )


def test_gqa_kv_buffer_steps_sequences_at_different_positions_in_one_batch(tmp_path):
    # softmax layers on a GroupQueryAttention KV buffer (onnxruntime target) take a position per row
    ckpt = make_checkpoint(tmp_path / "ckpt", "gated_deltanet,softmax", max_seq_len=64)
    art = export_model(
        ckpt, tmp_path / "art", target="onnxruntime", prefill_chunk=PREFILL, dynamic_batch=True
    )
    m = Manifest.load(art)
    assert m.dynamic_batch and any(e.shared for e in m.state)
    sess = ort.InferenceSession(str(m.graph_path("step")))
    feeds = _random_feeds(m, 1, np.random.default_rng(1))
    together = sess.run(None, feeds)
    for b in range(B):
        alone = sess.run(None, {k: v[b : b + 1] for k, v in feeds.items()})
        for x, y in zip(together, alone):
            np.testing.assert_allclose(x[b : b + 1], y, rtol=0, atol=1e-5)
    moved = dict(feeds, **{e.input: feeds[e.input] + 3 for e in m.state if e.name == "position"})
    assert np.abs(sess.run(None, moved)[0] - together[0]).max() > 1e-3  # the positions matter


def test_manifest_with_a_non_boolean_dynamic_batch_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", prefill_chunk=PREFILL, dynamic_batch=True)
    data = json.loads((art / "edgeattn.json").read_text())
    data["dynamic_batch"] = "yes"
    (art / "edgeattn.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="dynamic_batch"):
        Manifest.load(art)


def test_cli_export_dynamic_batch_then_run_and_check(tmp_path):
    from tests.test_cli_export import assert_bad_input, invoke

    ckpt = make_checkpoint(tmp_path / "ckpt", "retnet")
    res = invoke("export", ckpt, "--out", tmp_path / "art", "--prefill-chunk", PREFILL, "--dynamic-batch")
    assert res.exit_code == 0, res.output
    assert Manifest.load(tmp_path / "art").dynamic_batch
    res = invoke("run", tmp_path / "art", "--prompt", "def ", "-n", 5, "--seed", 0)
    assert res.exit_code == 0, res.output
    res = invoke("check", tmp_path / "art", "--tokens", 40)
    assert res.exit_code == 0 and "OK" in res.output, res.output
    res = invoke(
        "export",
        ckpt,
        "--out",
        tmp_path / "q_art",
        "--dynamic-batch",
        "--precision",
        "int8",
        "--int8-weights",
        "u8",
    )
    assert_bad_input(res, "int8 quantizes activations")
    assert not (tmp_path / "q_art").exists()
