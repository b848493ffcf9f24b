"""Llama imported from a Hugging Face directory and from GGUF files, against transformers on CPU.

Tiny models built with transformers' own LlamaForCausalLM (random weights, perturbed norms) are saved as a
Hugging Face directory, and written as GGUF files the way llama.cpp's converter writes them (attn_q / attn_k
rows permuted for its interleaved RoPE, 2-D weights in one of the quantized types, a byte-level BPE
vocabulary in the metadata). The reference of a GGUF is transformers' own GGUF loader
(``from_pretrained(dir, gguf_file=...)``: its dequantization and un-permutation, not ours). Bad files are
refused in one line by the CLI. The real model (SmolLM2) is tests/test_smollm.py's.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tests.hf_helpers import import_export_cli, rel_err, stdlib_text, train_tokenizer

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TINY = dict(
    vocab_size=300,
    hidden_size=256,  # the K-quants' blocks are 256 weights along a row
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=5000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
N = 40
TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def tiny_llama(seed: int = 0, **kw):
    from tests.hf_helpers import llama

    return llama(TINY, seed, **kw)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d, vocab_size=300)
    return d


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 300, size=(1, N)).astype(np.int64)


def edge_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids))[0].numpy()


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (rotate-half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_blocks(rows: int, cols: int, qtype, rng):
    """Random K-quant rows (gguf has no quantizer for them): random bytes with small, finite f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.full((rows, cols // block, 1), 2e-4, np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin, scales[12], qs[128]
        data[..., 0:2], data[..., 2:4] = d, d
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
        data[..., 208:210] = d
    return data.reshape(rows, -1)


def write_gguf(model, path, tok_dir, qtype: str = "F32", *, drop=(), extra=None, raw=None, seed=0):
    """``model`` as llama.cpp writes a GGUF: metadata (``drop``: keys left out, ``extra``: more keys),
    tokenizer from ``tok_dir``'s tokenizer.json, 2-D weights as ``qtype`` (norms F32); ``raw``: tensor name ->
    GGMLQuantizationType written as random blocks of that type instead."""
    cfg = model.config
    H, Hkv, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {
        "llama.block_count": (w.add_uint32, L),
        "llama.context_length": (w.add_uint32, cfg.max_position_embeddings),
        "llama.embedding_length": (w.add_uint32, cfg.hidden_size),
        "llama.feed_forward_length": (w.add_uint32, cfg.intermediate_size),
        "llama.attention.head_count": (w.add_uint32, H),
        "llama.attention.head_count_kv": (w.add_uint32, Hkv),
        "llama.attention.layer_norm_rms_epsilon": (w.add_float32, cfg.rms_norm_eps),
        "llama.rope.freq_base": (w.add_float32, TINY["rope_theta"]),
        "llama.rope.dimension_count": (w.add_uint32, cfg.hidden_size // H),
        "llama.vocab_size": (w.add_uint32, cfg.vocab_size),
    }
    for key, (add, value) in keys.items():
        if key not in drop:
            add(key, value)
    for key, value in (extra or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["content"] for a in tj["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"])
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(L):
        for hf, g in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    rng = np.random.default_rng(seed)
    for hf, g in names.items():
        t = sd[hf]
        if g.endswith(("attn_q.weight", "attn_k.weight")):
            t = _permute(t, H if g.endswith("attn_q.weight") else Hkv)
        kind = gguf.GGMLQuantizationType[qtype] if t.ndim == 2 else gguf.GGMLQuantizationType.F32
        kind = (raw or {}).get(g, kind)
        if kind in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            w.add_tensor(g, _k_blocks(*t.shape, kind, rng), raw_dtype=kind)
        elif kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, t)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(g, t.astype(np.float16))
        else:
            w.add_tensor(g, gguf.quants.quantize(t, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


# ---- a Hugging Face directory ----


def test_hf_directory_imports_to_transformers_logits(tok_dir, ids, tmp_path):
    from edgeattn.convert import import_model
    from edgeattn.models import EdgeLM

    for tie in (True, False):
        model = tiny_llama(seed=int(tie), tie_word_embeddings=tie)
        src = tmp_path / f"hf{tie}"
        model.save_pretrained(src)
        train_tokenizer(src, vocab_size=300)
        cfg, _ = import_model(src, tmp_path / f"ckpt{tie}")
        assert cfg.mixers == ["softmax"] * 2 and cfg.n_kv_heads == 2 and cfg.tie_embeddings == tie
        edge = EdgeLM.load(tmp_path / f"ckpt{tie}").eval()
        assert rel_err(edge_logits(edge, ids), hf_logits(model, ids)) <= 1e-5


def test_hf_directory_scaled_rope_is_refused_naming_the_field(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5000.0}
    cfg.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    r = import_export_cli()("import", tmp_path / "hf", "--out", tmp_path / "ckpt")
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert "rope_scaling.rope_type" in r.output and "llama3" in r.output
    assert not (tmp_path / "ckpt").exists()


# ---- GGUF files ----


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_dequantizes_as_transformers_does(qtype, tok_dir, ids, tmp_path):
    """Every supported type: our import of the GGUF against transformers' GGUF loader of the same file."""
    from edgeattn.convert import load_source

    model = tiny_llama(seed=2, tie_word_embeddings=qtype != "Q4_1")
    path = write_gguf(model, tmp_path / "m.gguf", tok_dir, qtype)
    source = load_source(path)
    want = hf_logits(hf_from_gguf(path), ids)
    assert rel_err(edge_logits(source.model, ids), want) <= 1e-5
    if qtype in ("F32", "F16"):  # the file holds (almost) the original weights: so do the logits
        assert rel_err(want, hf_logits(model, ids)) <= (1e-5 if qtype == "F32" else 1e-2)


def test_gguf_tokenizer_and_template_equal_transformers(tok_dir, tmp_path):
    """tokenizer.json written from the metadata encodes as transformers' GGUF tokenizer of the file (and as
    the original tokenizer.json it came from), and the chat template and special ids travel."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from edgeattn.artifact.tokenizer import checkpoint_tokenizer
    from edgeattn.convert import import_model

    path = write_gguf(tiny_llama(), tmp_path / "m.gguf", tok_dir)
    cfg, _ = import_model(path, tmp_path / "ckpt")
    ours = checkpoint_tokenizer(tmp_path / "ckpt", cfg)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    original = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    text = stdlib_text(20000) + "<|im_start|>user\nhi<|im_end|>"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False) == original.encode(text)
    assert ours.decode(ours.encode(text)) == text
    assert list(ours.eos_token_ids) == [original.convert_tokens_to_ids("<|im_end|>")]
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == original.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_gguf_cli_import_and_export(tok_dir, ids, tmp_path):
    """The CLI's defaults: on the onnxruntime target (one graph) a call returns its last token's logits
    (``prefill_logits`` "last"), on the portable target every token's; both equal transformers' GGUF model,
    and ``check``'s perplexity (every position, stepped through a "last" artifact) equals transformers'."""
    from edgeattn.export.check import check_artifact, default_text, run_logits
    from edgeattn.runtimes import open_session

    model = tiny_llama(seed=4, tie_word_embeddings=False)
    path = write_gguf(model, tmp_path / "m.gguf", tok_dir, "Q8_0")
    hf = hf_from_gguf(path)
    want = hf_logits(hf, ids)
    cli = import_export_cli()
    r = cli("import", path, "--out", tmp_path / "ckpt")
    assert r.exit_code == 0, r.output
    for target, mode in (("onnxruntime", "last"), ("portable", "all")):
        art = tmp_path / target
        r = cli("export", path, "--out", art, "--target", target, "--prefill-chunk", 16, "--max-length", 64)
        assert r.exit_code == 0, r.output
        sess = open_session(art)
        assert (
            sess.manifest.prefill_logits
            == mode
            == json.loads((art / "edgeattn.json").read_text()).get("prefill_logits", "all")
        )
        got = run_logits(sess, ids)
        assert got["step"].shape[1] == N - 32 and rel_err(got["logits"], want) <= 1e-4
        if mode == "all":
            assert got["prefill"].shape[1] == 32
            assert rel_err(np.concatenate([got["prefill"], got["step"]], axis=1), want) <= 1e-4
        else:  # each prefill call's logits: its last token's, every token's through logits_count (run_logits)
            sess.reset()
            assert rel_err(sess.run_graph("prefill", ids[:, :16]), want[:, [15]]) <= 1e-4
            assert got["prefill"].shape[1] == 32 and rel_err(got["prefill"], want[:, :32]) <= 1e-4
    # check's perplexity over every token of its text, against transformers' on the same ids
    report = check_artifact(tmp_path / "onnxruntime", tokens=N)
    assert report.ok, report.graphs
    text_ids = open_session(tmp_path / "onnxruntime").tokenizer.encode(default_text(8 * (N + 1)))[: N + 1]
    z = hf_logits(hf, np.array([text_ids[:-1]], np.int64))[0].astype(np.float64)
    logp = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
    ppl = float(np.exp(-logp[np.arange(N), text_ids[1:]].mean()))
    assert report.perplexity["artifact"] == pytest.approx(ppl, rel=1e-4)
    assert report.perplexity["torch"] == pytest.approx(ppl, rel=1e-4)


def _type_offset(data: bytes, name: str) -> int:
    """The offset of tensor ``name``'s type field in a GGUF header: name, n_dims (u32), dims (u64 each)."""
    at = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


def _refused(cli_args, *needles):
    r = import_export_cli()(*cli_args)
    lines = r.output.strip().splitlines()
    assert r.exit_code != 0 and len(lines) == 1, r.output
    assert "Traceback" not in r.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_bad_gguf_files_are_refused_in_one_line(tok_dir, tmp_path):
    model = tiny_llama()
    good = write_gguf(model, tmp_path / "good.gguf", tok_dir, "Q8_0").read_bytes()
    out = tmp_path / "out"

    (tmp_path / "truncated.gguf").write_bytes(good[: len(good) // 2])
    _refused(("import", tmp_path / "truncated.gguf", "--out", out), "truncated.gguf", "not a readable GGUF")
    (tmp_path / "header.gguf").write_bytes(good[:100])
    _refused(("export", tmp_path / "header.gguf", "--out", out), "header.gguf", "not a readable GGUF")

    bad = bytearray(good)
    struct.pack_into("<I", bad, _type_offset(good, "blk.1.ffn_up.weight"), 99)
    (tmp_path / "type99.gguf").write_bytes(bad)
    _refused(("import", tmp_path / "type99.gguf", "--out", out), "type99.gguf", "unknown type", "99")

    path = write_gguf(
        model, tmp_path / "q50.gguf", tok_dir, raw={"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q5_0}
    )
    _refused(("import", path, "--out", out), "blk.0.attn_v.weight", "Q5_0", "supported: ")

    path = write_gguf(model, tmp_path / "nokey.gguf", tok_dir, drop=("llama.block_count",))
    _refused(("import", path, "--out", out), "llama.block_count is missing")

    path = write_gguf(model, tmp_path / "yarn.gguf", tok_dir, extra={"llama.rope.scaling.type": "yarn"})
    _refused(("import", path, "--out", out), "llama.rope.scaling.type", "yarn")

    (tmp_path / "text.gguf").write_text("not a model")
    _refused(("import", tmp_path / "text.gguf", "--out", out), "not a GGUF file")
    assert not out.exists()
