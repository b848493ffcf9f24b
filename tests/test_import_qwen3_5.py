"""Qwen3.5 imported from transformers: the artifact's logits, greedy tokens and resumed state against
transformers' own Qwen3_5ForCausalLM (fp32, sharded, bf16) on CPU."""

import copy
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

from edgeattn.convert import import_model
from edgeattn.export import export_model
from edgeattn.export.check import run_logits
from edgeattn.runtimes import open_session
from tests.hf_helpers import hf_greedy, hf_logits, qwen3_5_text, rel_err

PREFILL = 16
N = 200


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    model = qwen3_5_text()
    root = tmp_path_factory.mktemp("qwen")
    model.save_pretrained(root / "fp32")
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    return model, root


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 320, size=(1, N)).astype(np.int64)


def edge_logits(ckpt, ids):
    import torch

    from edgeattn.models import EdgeLM

    with torch.no_grad():
        return EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()


def export_hf(src, out, target="onnxruntime", **kw):
    import_model(src, out.with_name(out.name + "_ckpt"))
    # every position of the prefill graph against transformers: --prefill-logits all (one graph defaults to last)
    kw = {"prefill_logits": "all", **kw}
    return export_model(out.with_name(out.name + "_ckpt"), out, target=target, prefill_chunk=PREFILL, **kw)


@pytest.fixture(scope="module")
def artifact(hf, tmp_path_factory):
    return export_hf(hf[1] / "fp32", tmp_path_factory.mktemp("a") / "art")


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_logits_equal_transformers_prefill_then_steps(hf, ids, tmp_path, target):
    model, root = hf
    art = export_hf(root / "fp32", tmp_path / "art", target=target)
    sess = open_session(art)
    if target == "onnxruntime":  # the gated attention layers keep a preallocated, shared KV buffer
        ops = {n.op_type for n in onnx.load(str(art / "step.onnx")).graph.node}
        assert "GroupQueryAttention" in ops
        shared = [e for e in sess.manifest.state if e.shared]
        assert len(shared) == 2 and all(e.shape[2] == sess.manifest.max_length for e in shared)
    got = run_logits(sess, ids)
    assert got["prefill"].shape[1] == (N // PREFILL) * PREFILL and got["step"].shape[1] == N % PREFILL
    full = np.concatenate([got["prefill"], got["step"]], axis=1)
    assert rel_err(full, hf_logits(model, ids)) <= 1e-4


def test_sharded_checkpoint_imports_to_the_same_logits(hf, ids, tmp_path):
    model, root = hf
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    import_model(root / "sharded", tmp_path / "ckpt")
    assert rel_err(edge_logits(tmp_path / "ckpt", ids), hf_logits(model, ids)) <= 1e-4


def test_bf16_checkpoint_matches_transformers_on_the_same_weights(hf, ids, tmp_path):
    import torch
    from transformers import Qwen3_5ForCausalLM

    model, root = hf
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ref = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    import_model(tmp_path / "bf16", tmp_path / "ckpt")
    assert rel_err(edge_logits(tmp_path / "ckpt", ids), hf_logits(ref, ids)) <= 1e-4


def test_50_greedy_tokens_equal_transformers_generate(hf, artifact):
    model, _ = hf
    prompt = [5, 17, 260, 3, 99, 42, 7, 128, 64, 1, 300, 2, 8, 9, 10, 11, 12, 13, 14]
    want = hf_greedy(model, prompt, 50)
    got = list(open_session(artifact).generate_ids(prompt, 50, temperature=0))
    assert got == want


def test_state_saved_and_resumed_in_a_new_process_continues_identically(hf, ids, artifact, tmp_path):
    model, _ = hf
    sess = open_session(artifact)
    sess.prefill(ids[:, :120])
    sess.save_state(tmp_path / "s.state")
    script = textwrap.dedent(
        f"""
        import numpy as np
        from edgeattn.runtimes import open_session
        sess = open_session({str(artifact)!r})
        sess.load_state({str(tmp_path / "s.state")!r})
        ids = np.load({str(tmp_path / "ids.npy")!r})
        np.save({str(tmp_path / "out.npy")!r}, np.stack([sess.step(ids[:, t : t + 1])[0] for t in range(120, ids.shape[1])]))
        """
    )
    np.save(tmp_path / "ids.npy", ids)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    got = np.load(tmp_path / "out.npy")
    assert rel_err(got, hf_logits(model, ids)[0, 120:]) <= 1e-4


def test_vision_language_checkpoint_imports_its_text_model_and_skips_the_vision_tower(tmp_path, ids):
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.hf_helpers import QWEN_TINY, perturb, torch_only

    torch_only(modeling)
    torch.manual_seed(1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(QWEN_TINY), vision_config=vision))
    perturb(model.eval())
    model.save_pretrained(tmp_path / "vl")
    _, notes = import_model(tmp_path / "vl", tmp_path / "ckpt")
    assert any("vision tower" in n for n in notes)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids[:, :70])).logits.numpy()
    assert rel_err(edge_logits(tmp_path / "ckpt", ids[:, :70]), want) <= 1e-4


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_bf16_checkpoint_exports_at_lower_precision_and_check_passes(hf, tmp_path, precision):
    import torch

    from edgeattn.export.check import check_artifact

    model, _ = hf
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    art = export_hf(tmp_path / "bf16", tmp_path / "art", precision=precision)
    report = check_artifact(art, tokens=80)
    assert report.ok, report.graphs


def test_published_rope_layout_interleaved_mrope_exports_with_the_kv_buffer(ids, tmp_path):
    """The published configs carry M-RoPE sections (interleaved); text positions make it plain RoPE. With
    64-wide heads (16 rotary dims, as the published 256 x 0.25) GroupQueryAttention rotates q and k itself:
    no rotary ops around it, one cos/sin table pair for both attention layers."""
    from onnx import helper

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    rope |= {"mrope_section": [3, 3, 2], "mrope_interleaved": True}
    model = qwen3_5_text(seed=2, head_dim=64, num_hidden_layers=8, rope_parameters=rope)
    model.save_pretrained(tmp_path / "hf")
    art = export_hf(tmp_path / "hf", tmp_path / "art")
    graph = onnx.load(str(art / "step.onnx")).graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2
    assert all(
        {a.name: helper.get_attribute_value(a) for a in n.attribute}.get("do_rotary") == 1 for n in gqa
    )
    assert len({n.input[7] for n in gqa} | {n.input[8] for n in gqa}) == 2  # one shared cos/sin pair
    assert not {"Cos", "Sin"} & {n.op_type for n in graph.node}
    want = hf_logits(model, ids[:, :70])
    for backend in ("onnxruntime", "torch"):  # the torch backend rotates from the same tables
        sess = open_session(art, backend)
        assert any(e.shared for e in sess.manifest.state)
        got = run_logits(sess, ids[:, :70])
        full = np.concatenate([got["prefill"], got["step"]], axis=1)
        assert rel_err(full, want) <= 1e-4, backend
