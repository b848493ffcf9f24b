"""The softmax baseline's preallocated KV buffer (onnxruntime target: GroupQueryAttention, past and present
one buffer) against the naive softmax loop and the portable export's growing cache."""

import json

import numpy as np
import onnx
import pytest
import torch

from edgeattn.export import export_model
from edgeattn.export.check import check_artifact, run_logits
from edgeattn.ops.softmax.kv_buffer import buffer_attention
from edgeattn.ops.softmax.naive import naive_softmax_attention
from edgeattn.runtimes import open_session
from edgeattn.runtimes.base import kv_zeros
from tests.export_helpers import PREFILL, make_checkpoint, text_ids


def test_buffer_attention_equals_the_naive_loop_in_chunks_and_steps():
    torch.manual_seed(0)
    B, T, H, D, L = 2, 37, 3, 8, 64
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    ref, _ = naive_softmax_attention(q, k, v, scale=D**-0.5, window=None, sink=0, initial_state=None)
    key, value, pos = torch.zeros(B, H, L, D), torch.zeros(B, H, L, D), torch.zeros(B)
    outs, t = [], 0
    for n in (9, 1, 1, 16, 1, 9):
        o, key, value, pos = buffer_attention(
            q[:, t : t + n], k[:, t : t + n], v[:, t : t + n], key, value, pos, scale=D**-0.5
        )
        outs.append(o)
        t += n
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-5)
    assert pos.tolist() == [T, T]
    torch.testing.assert_close(key[:, :, :T], k.transpose(1, 2))
    assert not key[:, :, T:].any()


def test_buffer_attention_with_grouped_kv_heads_equals_the_naive_loop():
    torch.manual_seed(1)
    B, T, H, Hkv, D, L = 1, 21, 6, 2, 8, 32
    q = torch.randn(B, T, H, D)
    k, v = torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    kr, vr = (x.repeat_interleave(H // Hkv, dim=2) for x in (k, v))  # query head h reads KV head h // 3
    ref, _ = naive_softmax_attention(q, kr, vr, scale=D**-0.5, window=None, sink=0, initial_state=None)
    key, value, pos = torch.zeros(B, Hkv, L, D), torch.zeros(B, Hkv, L, D), torch.zeros(B)
    outs, t = [], 0
    for n in (7, 1, 13):
        o, key, value, pos = buffer_attention(
            q[:, t : t + n], k[:, t : t + n], v[:, t : t + n], key, value, pos, scale=D**-0.5
        )
        outs.append(o)
        t += n
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        buffer_attention(q, torch.randn(B, T, 4, D), torch.randn(B, T, 4, D), key, value, pos, scale=1.0)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    ckpt = make_checkpoint(root / "ckpt", "softmax,gla")
    return {
        t: export_model(ckpt, root / t, target=t, prefill_chunk=PREFILL, prefill_logits="all")
        for t in ("onnxruntime", "portable")
    }


def test_onnxruntime_target_uses_gqa_with_a_shared_buffer_and_equals_portable(artifacts):
    art = artifacts["onnxruntime"]
    ops = [n.op_type for n in onnx.load(str(art / "step.onnx")).graph.node]
    assert "GroupQueryAttention" in ops and "Concat" not in ops  # no cache grown by concatenation
    manifest = json.loads((art / "edgeattn.json").read_text())
    shared = [e for e in manifest["state"] if e.get("shared")]
    L = manifest["max_length"]
    assert [e["name"] for e in shared] == ["key", "value"] and all(e["shape"][2] == L for e in shared)
    sess = open_session(art)
    for e, bufs in zip(sess.manifest.state, sess._bufs):  # one buffer for past and present
        assert (bufs[0] is bufs[1]) == e.shared
    ids = text_ids(300)
    got = run_logits(sess, ids)
    ref = run_logits(open_session(artifacts["portable"]), ids)
    for g in ("prefill", "step"):
        np.testing.assert_allclose(got[g], ref[g], atol=1e-4 * max(1.0, np.abs(ref[g]).max()))
    report = check_artifact(art, tokens=100)  # against the torch checkpoint's growing cache
    assert report.ok
    from edgeattn.runtimes import attention

    # (it builds where g++ and the headers are: tests/test_attention_kernel.py)
    if attention.library()[0] is not None:
        assert sess.attention == report.attention == {"kernel": "edgeattn"}
        assert any(n.startswith("GroupQueryAttention ran on edgeattn's CPU kernel") for n in report.notes)


def test_state_files_continue_the_buffer_exactly(artifacts, tmp_path):
    art = artifacts["onnxruntime"]
    ids = text_ids(60)
    a = open_session(art)
    a.prefill(ids[:, :40])
    a.save_state(tmp_path / "s.st")
    want = [a.step(ids[:, t : t + 1]) for t in range(40, 60)]
    b = open_session(art)
    b.load_state(tmp_path / "s.st")
    assert b.position == 40
    got = [b.step(ids[:, t : t + 1]) for t in range(40, 60)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    torch_sess = open_session(art, backend="torch")  # the torch backend runs the same buffer layout
    torch_sess.load_state(tmp_path / "s.st")
    np.testing.assert_allclose(torch_sess.step(ids[:, 40:41]), want[0], atol=1e-4)


def test_the_buffer_refuses_tokens_beyond_max_length(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "softmax", max_seq_len=32)
    sess = open_session(export_model(ckpt, tmp_path / "art", prefill_chunk=PREFILL))
    sess.prefill(text_ids(30))
    with pytest.raises(ValueError, match="maximum of 32"):
        sess.prefill(text_ids(3))


def test_reset_and_set_state_write_only_the_filled_slots(artifacts):
    """The KV buffer costs what it holds: a reset writes no slot, a state of p tokens writes p slots; the
    stale slots past the position are never read (the logits equal a fresh session's) and read back as zeros."""
    art = artifacts["onnxruntime"]
    ids = text_ids(90)
    fresh = open_session(art)
    want = [fresh.prefill(ids[:, :40]), *(fresh.step(ids[:, t : t + 1]) for t in range(40, 45))]
    sess = open_session(art)
    sess.prefill(ids[:, 30:90])  # 60 tokens, then start over
    sess.reset()
    kv = [a for a in sess._kv_np if a is not None]
    assert kv and all(np.abs(a[:, :, 40:60]).max() > 0 for a in kv)  # stale tokens left in place
    got = [sess.prefill(ids[:, :40]), *(sess.step(ids[:, t : t + 1]) for t in range(40, 45))]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    state = sess.get_state()
    for e in sess.manifest.state:
        if e.shared:
            assert not state[e.input][:, :, 45:].any()
    other = open_session(art)
    other.set_state(state, position=45)
    assert all(not a[:, :, 45:].any() for a in other._kv_np if a is not None)  # past slot 45: never written
    np.testing.assert_array_equal(other.step(ids[:, 45:46]), sess.step(ids[:, 45:46]))


def test_kv_zeros_is_a_writable_zero_array_of_the_shape_and_dtype():
    # the KV buffers' zeros (4 KiB pages, no huge-page advice): what np.zeros gives, written in place
    for shape, dtype in [((1, 2, 4608, 16), np.float32), ((3, 5), np.float16), ((0, 4), np.float32)]:
        a = kv_zeros(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
        assert not a.any()
        if a.size:
            a[(0,) * len(shape)] = 1
            b = a.copy()
            assert b.sum() == 1


def test_a_session_buffer_of_small_heads_costs_what_it_holds():
    """SmolLM2-135M's layout (3 KV heads of 8040 x 64 float32 slots, 2 MiB a head, 60 buffers): the first 128
    slots of every head cost about what they hold, not a 2 MiB huge page per head (numpy's np.zeros asks for
    huge pages from 4 MiB on: 360 MiB resident here before session_kv_zeros)."""
    import psutil

    from edgeattn.runtimes.onnxruntime import session_kv_zeros

    proc = psutil.Process()
    before = proc.memory_info().rss
    bufs = [session_kv_zeros((1, 3, 8040, 64), np.float32) for _ in range(60)]
    for b in bufs:
        b[:, :, :128] = 1.0
    grown = proc.memory_info().rss - before
    held = 60 * 3 * 128 * 64 * 4  # 5.9 MB
    assert grown < held + (32 << 20), grown
    assert session_kv_zeros((1, 2, 16384, 256), np.float32).base is None  # a head of 16 MiB: np.zeros's pages
