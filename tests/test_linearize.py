"""`edgeattn linearize` on a tiny random Llama built with transformers: the transfer targets are transformers'
own attention outputs, the hedgehog_window mixer is its formula (and softmax attention itself when the window
covers the sequence), a few steps lower both losses, the checkpoint exports and its artifact equals its torch
model, a run killed after a save resumes to the uninterrupted result, and bad options are one line."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_helpers import train_tokenizer

pytest.importorskip("transformers")
import torch  # noqa: E402

from edgeattn.models import EdgeConfig, EdgeLM  # noqa: E402
from edgeattn.train import linearize as L  # noqa: E402

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
FAST = dict(
    seq_len=48, window=8, feature_dim=8, max_train_tokens=20_000, held_out_tokens=2_000, save_every=100
)


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory):
    """(transformers LlamaForCausalLM, its saved directory with a tokenizer)."""
    from tests.hf_helpers import llama

    d = tmp_path_factory.mktemp("teacher")
    train_tokenizer(d, vocab_size=300)
    model = llama(TINY)
    model.save_pretrained(d)
    return model, d


def _ids(n=40, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 300, size=(2, n)))


def test_transfer_targets_are_transformers_attention_outputs(hf_teacher):
    hf, d = hf_teacher
    want = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, kw_out, i=i: want.__setitem__(i, kw_out[0]))
        for i, layer in enumerate(hf.model.layers)
    ]
    ids = _ids()
    with torch.no_grad():
        hf_logits = hf(ids).logits
    for h in hooks:
        h.remove()
    teacher, _ = L.load_teacher(d)
    io, logits = L.attention_io(teacher, ids, [0, 1])
    for i in (0, 1):
        torch.testing.assert_close(io[i][1], want[i], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=1e-4)


def _naive_hedgehog_window(mixer, x):
    """o_t from the module docstring's formula, one query at a time over the whole past (no state)."""
    from edgeattn.layers.gated import rotary
    from edgeattn.layers.hedgehog import hedgehog_features

    B, T, _ = x.shape
    H, Hkv, Dh, W = mixer.n_heads, mixer.n_kv_heads, mixer.head_dim, mixer.window
    pos = torch.arange(T, dtype=torch.float32)[None].expand(B, T)
    q = rotary(mixer.q_proj(x).view(B, T, H, Dh), pos, Dh, mixer.cfg.rope_theta).transpose(1, 2)
    k = rotary(mixer.k_proj(x).view(B, T, Hkv, Dh), pos, Dh, mixer.cfg.rope_theta).transpose(1, 2)
    v = mixer.v_proj(x).view(B, T, Hkv, Dh).transpose(1, 2)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    fq = hedgehog_features(q, mixer.q_map, mixer.q_map_bias)
    fk = hedgehog_features(k, mixer.k_map, mixer.k_map_bias)
    f = torch.sigmoid(mixer.window_factor)[None, :, None]
    out = []
    for t in range(T):
        lo = max(0, t - W + 1)
        s = (q[:, :, t : t + 1] @ k[:, :, lo : t + 1].transpose(-1, -2))[:, :, 0] * Dh**-0.5  # [B, H, n]
        a_win = f * torch.exp(s - s.max(-1, keepdim=True).values)
        a_lin = (fq[:, :, t : t + 1] @ fk[:, :, :lo].transpose(-1, -2))[:, :, 0]  # [B, H, lo]
        a = torch.cat([a_lin, a_win], -1)
        out.append((a[..., None] * v[:, :, : t + 1]).sum(2) / a.sum(-1, keepdim=True))
    o = torch.stack(out, 2)  # [B, H, T, Dh]
    return mixer.o_proj(o.transpose(1, 2).reshape(B, T, H * Dh))


def _mixer_cfg(window):
    return EdgeConfig(
        vocab_size=300,
        d_model=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        head_size=16,
        mixer="hedgehog_window",
        rope_theta=10000.0,
        window=window,
        feature_dim=8,
    )


def test_hedgehog_window_is_its_formula_in_pieces():
    from edgeattn.layers.hedgehog import HedgehogWindow

    m = HedgehogWindow(_mixer_cfg(5))
    with torch.no_grad():  # a feature map away from the identity, unequal window factors
        for p in (m.q_map, m.k_map, m.q_map_bias, m.k_map_bias, m.window_factor):
            p.add_(torch.randn(p.shape) * 0.5)
    x = torch.randn(2, 23, 64)
    with torch.no_grad():
        want = _naive_hedgehog_window(m, x)
        full, _ = m(x)
        state, parts = None, []
        for a, b in ((0, 1), (1, 4), (4, 11), (11, 12), (12, 23)):  # shorter and longer than the window
            y, state = m(x[:, a:b], state)
            parts.append(y)
    torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(parts, 1), want, atol=1e-5, rtol=1e-4)


def test_window_over_the_whole_sequence_is_the_teachers_attention(hf_teacher):
    """With W >= T every key is in the softmax window: the layer is transformers' LlamaAttention exactly."""
    hf, d = hf_teacher
    teacher, _ = L.load_teacher(d)
    student = L.build_student(teacher, L.LinearizeConfig(window=64, feature_dim=8, steps=1))
    ids = _ids()
    io, _ = L.attention_io(teacher, ids, [0, 1])
    with torch.no_grad():
        for i in (0, 1):
            got, _ = student.blocks[i].mixer(io[i][0])
            torch.testing.assert_close(got, io[i][1], atol=1e-5, rtol=1e-4)


def _losses(teacher, student, ids):
    io, logits = L.attention_io(teacher, ids, L.linearized_layers(student.cfg))
    with torch.no_grad():
        return L.transfer_loss(student, io).item(), L.distill_loss(student, ids, logits).item()


@pytest.mark.parametrize(
    "form,stage,lora", [("linear+window", "transfer", 8), ("gla", "transfer", 8), ("gla", "distill", 0)]
)
def test_few_steps_lower_the_loss(hf_teacher, tmp_path, form, stage, lora):
    """On held-out windows: the transfer stage lowers the attention-transfer loss, distillation the KL (from
    GLA's untrained gates: the tiny teacher's near-uniform logits leave the Hedgehog forms little KL to lose)."""
    _, d = hf_teacher
    teacher, _ = L.load_teacher(d)
    cfg = L.LinearizeConfig(form=form, stage=stage, lora=lora, steps=10, lr_distill=3e-2, **FAST)
    corpus = L.load_corpus(d / "tokenizer.json", 1, FAST["held_out_tokens"])
    ids = torch.cat(corpus.held_out_windows(FAST["seq_len"], 2))
    which = 0 if stage == "transfer" else 1
    before = _losses(teacher, L.build_student(teacher, cfg), ids)[which]
    L.linearize(d, tmp_path / "out", cfg, verbose=False)
    after = _losses(teacher, EdgeLM.load(tmp_path / "out"), ids)[which]
    assert after < 0.9 * before, (before, after)


@pytest.fixture(scope="module")
def linearized(hf_teacher, tmp_path_factory):
    """(checkpoint, its onnxruntime artifact): 2 steps, layer 0 linearized, layer 1 kept as softmax."""
    from edgeattn.export import export_model

    _, d = hf_teacher
    root = tmp_path_factory.mktemp("linearized")
    cfg = L.LinearizeConfig(steps=2, keep_softmax=(1,), **FAST)
    L.linearize(d, root / "ckpt", cfg, verbose=False)
    return root / "ckpt", export_model(root / "ckpt", root / "art", include_checkpoint=False)


def test_checkpoint_exports_and_matches_torch(linearized):
    from edgeattn.runtimes import open_session

    ckpt, art = linearized
    model = EdgeLM.load(ckpt).eval()
    assert model.cfg.mixers == ["hedgehog_window", "softmax"]
    ids = _ids(30)[:1].numpy()
    with torch.no_grad():
        want = model(torch.from_numpy(ids))[0][0].numpy()
    sess = open_session(art, backend="onnxruntime")
    got = [sess.prefill(ids[:, :13])[0]] + [sess.step(ids[:, t : t + 1])[0] for t in range(13, 30)]
    np.testing.assert_allclose(np.stack(got), want[12:], atol=1e-4, rtol=0)
    # the linearized layer's state is fixed in size, the window buffer included
    layer0 = {s.name: s for s in sess.manifest.state if s.layer == 0}
    assert set(layer0) == {"recurrent_state", "normalizer", "key", "value", "position"}, layer0
    assert not any(s.dynamic for s in layer0.values()) and layer0["key"].shape[2] == FAST["window"]


def test_linearized_artifact_serves_chat_and_runs_in_the_page_with_its_template(linearized, tmp_path):
    """Issue 34 item 3: the linearized artifact answers the OpenAI client's chat request with its teacher's
    chat template (the text of a lone greedy Session), and its site carries that template, whose page (a
    real Chromium, where one is installed) generates the same greedy ids."""
    import json

    from edgeattn.runtimes import open_session
    from edgeattn.web import build_site
    from tests.browser import Browser, browser_missing
    from tests.serve_helpers import start_server

    _, art = linearized
    question, n = "def main():", 12
    sess = open_session(art)
    tok = sess.tokenizer
    prompt = tok.apply_chat_template(question)
    assert prompt.startswith("<|im_start|>user\n" + question)  # the teacher's template, not a default
    want = list(sess.generate_ids(tok.encode(prompt), n, temperature=0))
    server = start_server(art)
    try:
        c = server.client()
        model = c.models.list().data[0].id
        msgs = [{"role": "user", "content": question}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=n, temperature=0)
    finally:
        server.stop()
    assert r.choices[0].message.content == tok.decode(want)
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    site = build_site(art, tmp_path / "site")
    chat = json.loads((site / "site.json").read_text())["chat"]
    assert chat["prefix"] + question + chat["suffix"] == prompt
    if browser_missing() is not None:
        return  # the page itself needs Chromium (scripts/setup_env.sh installs it)
    from tests.test_web import run_page

    with Browser() as browser:
        page = run_page(browser, site, prompt=question, chat=1, max_new_tokens=n, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == want


def test_decode_benchmark_races_the_linearized_artifact_against_its_teachers(
    hf_teacher, linearized, tmp_path
):
    """benchmarks/linearize_decode.py end to end at tiny contexts: both exports built and measured, the
    targets computed from the table, one JSON line; the llama.cpp peer skipped in one line without
    --llama-python."""
    import json
    import subprocess
    import sys

    from tests.serve_helpers import REPO

    _, d = hf_teacher
    ckpt, _ = linearized
    cmd = [sys.executable, str(REPO / "benchmarks" / "linearize_decode.py"), "--student", str(ckpt)]
    cmd += ["--teacher", str(d), "--precisions", "fp32", "--contexts", "64,16", "--steps", "2"]
    cmd += ["--repeats", "1", "--prefill", "16", "--threads", "1", "--workdir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "llama.cpp peer skipped" in res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["contexts"] == [16, 64]
    assert set(out["models"]) == {"edgeattn-teacher-fp32", "edgeattn-ckpt-fp32"}
    for m in out["models"].values():
        assert set(m["contexts"]) == {"16", "64"} and m["contexts"]["64"]["ms"] > 0
    goal = out["targets"]["edgeattn-ckpt-fp32"]
    ms = out["models"]["edgeattn-ckpt-fp32"]["contexts"]
    assert goal["decode_growth"] == pytest.approx(ms["64"]["ms"] / ms["16"]["ms"], rel=0.01)
    assert set(goal["speedup_at_longest"]) == {"edgeattn-teacher-fp32"}
    # the teacher's KV buffers hold the longest context and the timed steps (64 + 40)
    assert json.loads((tmp_path / "edgeattn-teacher-fp32" / "edgeattn.json").read_text())["max_length"] == 104


def test_resume_after_a_kill_continues_from_the_last_save(hf_teacher, tmp_path):
    _, d = hf_teacher
    cfg = L.LinearizeConfig(steps=8, lora=4, **{**FAST, "save_every": 3})
    whole = L.linearize(d, tmp_path / "whole", cfg, verbose=False)

    def kill(step, stage, loss, model, elapsed):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        L.linearize(d, tmp_path / "cut", cfg, verbose=False, callback=kill)
    assert torch.load(tmp_path / "cut" / L.STATE, weights_only=True)["step"] == 3  # the last save
    EdgeLM.load(tmp_path / "cut")  # the save is a whole checkpoint
    steps = []
    resumed = L.linearize(
        d, tmp_path / "cut", cfg, resume=True, verbose=False, callback=lambda s, *_: steps.append(s)
    )
    assert steps == [4, 5, 6, 7, 8]
    assert [h[:3] for h in resumed.history] == [h[:3] for h in whole.history]
    a, b = EdgeLM.load(tmp_path / "whole").state_dict(), EdgeLM.load(tmp_path / "cut").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


def test_bad_options_are_one_line(hf_teacher, tmp_path):
    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    _, d = hf_teacher
    out = tmp_path / "o"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--form", "foo"], "--form"),
        ([], "give --steps or --minutes"),
        (["--steps", "3", "--keep-softmax", "7"], "the teacher has layers 0..1"),
        (["--steps", "3", "--keep-softmax", "a,b"], "--keep-softmax must be layer numbers"),
        (["--steps", "3", "--lora", "-1"], "--lora must be >= 0"),
        (["--minutes", "nan"], "finite"),
        (["--steps", "3", "--transfer-share", "1.5"], "--transfer-share"),
        (["--steps", "3", "--resume"], "holds no linearize_state.pt"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--steps", "3", "--device", "cuda"], "no CUDA device"))
    for args, message in cases:
        r = CliRunner().invoke(app, ["linearize", str(d), "--out", str(out), *args])
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr.startswith("error: ") and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for teacher, outdir, message in (
        (tmp_path / "missing", out, "does not exist"),
        (d, tmp_path / "full", "not empty"),
    ):
        r = CliRunner().invoke(app, ["linearize", str(teacher), "--out", str(outdir), "--steps", "2"])
        assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_gated_deltanet_starts_from_the_teachers_grouped_projections(hf_teacher):
    """Gated DeltaNet has a key head per query head: transformers' grouped k/v rows, each head repeated."""
    hf, d = hf_teacher
    teacher, _ = L.load_teacher(d)
    student = L.build_student(teacher, L.LinearizeConfig(form="gated_deltanet", steps=1))
    attn, mixer = hf.model.layers[1].self_attn, student.blocks[1].mixer
    H, Hkv, Dh = 4, 2, 16
    for name in ("k_proj", "v_proj"):
        want = (
            getattr(attn, name).weight.view(Hkv, 1, Dh, -1).expand(Hkv, H // Hkv, Dh, -1).reshape(H * Dh, -1)
        )
        torch.testing.assert_close(getattr(mixer, name).weight, want)
    torch.testing.assert_close(mixer.q_proj.weight, attn.q_proj.weight)
    torch.testing.assert_close(mixer.o_proj.weight, attn.o_proj.weight)


def test_ablations_benchmark_runs_each_and_reports_a_failed_one(hf_teacher, tmp_path):
    """benchmarks/linearize_ablations.py end to end on the tiny teacher: each ablation a fresh linearize run whose
    held-out perplexity lands in the table and the JSON line; one that cannot run (layers 0-7 kept of a 2-layer
    teacher) is a failed row with its one-line reason, not a crash; an unknown ablation is one line."""
    import json
    import subprocess
    import sys

    from tests.serve_helpers import REPO

    _, d = hf_teacher
    script = str(REPO / "benchmarks" / "linearize_ablations.py")
    cmd = [sys.executable, script, "--teacher", str(d), "--only", "base,keep_first8,window16", "--steps", "2"]
    cmd += ["--eval-windows", "2", "--seq-len", "48", "--max-train-tokens", "20000", "--parallel", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {r["name"]: r for r in out["rows"]}
    assert list(rows) == ["base", "keep_first8", "window16"]
    for name in ("base", "window16"):
        assert rows[name]["steps"] == 2 and rows[name]["ppl"] > 1 and rows[name]["ppl_teacher"] > 1
        assert rows[name]["ratio"] == pytest.approx(rows[name]["ppl"] / rows[name]["ppl_teacher"], rel=0.01)
    assert "layers 0..1" in rows["keep_first8"]["failed"]
    assert "| base |" in res.stdout and "| keep_first8 |" in res.stdout
    bad = subprocess.run([sys.executable, script, "--only", "nope"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "unknown ablation 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (scripts/gpu_check.sh runs it on one)"
)
def test_linearize_on_cuda_starts_where_the_cpu_run_does_and_learns(hf_teacher, tmp_path):
    """--device cuda: the first step's loss equals the CPU run's (the same batch, the same student), a few steps
    lower the attention-transfer loss as on the CPU, and the checkpoint loads on the CPU."""
    _, d = hf_teacher
    teacher, _ = L.load_teacher(d)
    corpus = L.load_corpus(d / "tokenizer.json", 1, FAST["held_out_tokens"])
    ids = torch.cat(corpus.held_out_windows(FAST["seq_len"], 2))
    first = {}
    for device in ("cpu", "cuda"):
        cfg = L.LinearizeConfig(stage="transfer", steps=10, device=device, **FAST)
        before = _losses(teacher, L.build_student(teacher, cfg), ids)[0]
        result = L.linearize(d, tmp_path / device, cfg, verbose=False)
        first[device] = result.history[0][2]
        after = _losses(teacher, EdgeLM.load(tmp_path / device), ids)[0]
        assert after < 0.9 * before, (device, before, after)
    assert first["cuda"] == pytest.approx(first["cpu"], rel=1e-3), first
