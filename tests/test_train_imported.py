"""`edgeattn train --resume CKPT` on a checkpoint made by `edgeattn import` (fine-tuning): a tiny
transformers Qwen3.5 with a tokenizer trained with `tokenizers`; the training data is encoded with that
tokenizer (compared with `tokenizers` itself), the loss falls, and the result exports and samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import sample, train
from edgeattn.convert import import_model
from edgeattn.models import EdgeLM
from tests.hf_helpers import qwen3_5_text, train_tokenizer

FAST = ["--seq-len", "16", "--batch-size", "2", "--eval-every", "3", "--eval-windows", "2", "--device", "cpu"]
TEXT = "def double(x):\n    return x * 2\n\n"  # periodic data: every batch the same few windows


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    src = root / "model"
    qwen3_5_text(seed=1).save_pretrained(src)
    train_tokenizer(src, vocab_size=300)
    import_model(src, root / "ckpt")
    return src, root / "ckpt"


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEATTN_CACHE_DIR", str(tmp_path / "cache"))
    app = typer.Typer()
    train.register(app)
    sample.register(app)
    return app


def run(app, *args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_corpus_is_encoded_with_the_tokenizer(imported, tmp_path):
    from tokenizers import Tokenizer

    from edgeattn.train.data import load_corpus

    src, _ = imported
    d = tmp_path / "data"
    d.mkdir()
    texts = {"a.py": TEXT * 20, "b.txt": "héllo wörld, ünïcode\n" * 30}
    for name, text in texts.items():
        (d / name).write_text(text, encoding="utf-8")
    corpus = load_corpus(d, seq_len=16, tokenizer=src / "tokenizer.json", cache=tmp_path / "cache")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    want = [i for name in sorted(texts) for i in tok.encode(texts[name], add_special_tokens=False).ids]
    got = np.concatenate([corpus.train, corpus.val]).astype(np.int64)
    assert got.tolist() == want and corpus.unit == "tokens"
    assert max(want) >= 256  # BPE merges: ids beyond the byte range, so not bytes


def test_fine_tune_an_imported_checkpoint(imported, app, tmp_path):
    import torch

    src, ckpt = imported
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.py").write_text(TEXT * 60)
    out = tmp_path / "tuned"
    losses = []

    from edgeattn.train.loop import TrainConfig
    from edgeattn.train.loop import train as run_training

    cfg = TrainConfig(
        steps=8, seq_len=16, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=8, eval_windows=2, data=str(d)
    )
    cfg.device = "cpu"
    r = run_training(None, cfg, out=out, resume=ckpt, callback=lambda step, m: losses.append(m["loss"]))
    assert r.step == 8 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses
    # the checkpoint keeps the model's config and tokenizer; the weights changed
    tuned, orig = EdgeLM.load(out), EdgeLM.load(ckpt)
    assert (
        tuned.cfg == orig.cfg
        and (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    )
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), orig.state_dict().values()))

    # the CLI: fine-tune again from the tuned checkpoint (its trainer state: resumed at step 8)
    res = run(app, "train", "--resume", out, "--steps", "10")
    assert res.exit_code == 0, res.output
    assert "resumed from" in res.output and "done: step 10" in res.stdout and "of 16 tokens" in res.output

    from edgeattn.export import export_model
    from edgeattn.runtimes import open_session

    art = export_model(out, tmp_path / "art", prefill_chunk=8)
    sess = open_session(art)
    assert sess.tokenizer.kind == "huggingface"
    text = sess.generate("def double", max_new_tokens=8, temperature=0)
    assert isinstance(text, str)
    res = run(app, "sample", out, "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    assert res.exit_code == 0 and res.stdout.startswith("def "), res.output


def test_cli_fine_tunes_from_step_0(imported, app, tmp_path):
    _, ckpt = imported
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.py").write_text(TEXT * 60)
    res = run(app, "train", "--resume", ckpt, "--out", tmp_path / "o", "--data", d, "--steps", "2", *FAST)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())  # the console wraps its lines where the tmp path's length puts them
    assert "fine-tuning" in said and "done: step 2" in res.stdout and "encoded with" in said, res.output


def test_a_vocabulary_bytes_cannot_feed_is_refused(app, tmp_path):
    from pathlib import Path

    ckpt = tmp_path / "ckpt"
    import_model(Path(__file__).parent / "fixtures" / "fla" / "gla", ckpt)  # vocab 64, no tokenizer
    (tmp_path / "d.txt").write_text(TEXT * 40)
    res = run(app, "train", "--resume", ckpt, "--out", tmp_path / "o", "--data", tmp_path / "d.txt", *FAST)
    assert res.exit_code == 2
    assert "vocabulary is 64 tokens" in res.output and "tokenizer.json" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()
