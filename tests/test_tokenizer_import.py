"""Artifacts carry their model's tokenizer: a byte-level BPE trained with `tokenizers` on stdlib text, in a
Hugging Face model directory; compared with `tokenizers` itself and transformers' generate / chat template."""

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import check, run, sample
from edgeattn.convert import import_model
from edgeattn.export import export_model
from edgeattn.runtimes import open_session
from tests.hf_helpers import hf_greedy, qwen3_5_text, stdlib_text, train_tokenizer

runner = CliRunner()
app = typer.Typer()
for _mod in (run, check, sample):
    _mod.register(app)

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(transformers model, model dir, artifact, eos id): the EOS is a token the model greedily emits."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("tok")
    src = root / "model"
    model = qwen3_5_text(seed=3)
    train_tokenizer(src, vocab_size=300)
    prompt = Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROMPT).ids
    free = hf_greedy(model, prompt, 12)
    k = next(i for i in range(4, 12) if free[i] not in free[:i])
    model.generation_config.eos_token_id = free[k]
    model.save_pretrained(src)
    import_model(src, root / "ckpt")
    art = export_model(root / "ckpt", root / "art", prefill_chunk=16)
    return model, src, art, free[k]


def test_manifest_carries_the_tokenizer_and_its_special_ids(setup):
    _, src, art, eos = setup
    manifest = json.loads((art / "edgeattn.json").read_text())
    tok = manifest["tokenizer"]
    assert tok["type"] == "huggingface" and tok["eos_token_ids"] == [eos]
    assert tok["pad_token_id"] == 0  # "<|endoftext|>", the first special token
    assert "tokenizer.json" in manifest["files"] and "chat_template.jinja" in manifest["files"]
    assert (art / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_encode_decode_round_trip_through_the_artifact_equals_tokenizers(setup):
    from tokenizers import Tokenizer

    _, src, art, _ = setup
    ref = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok = open_session(art).tokenizer
    text = stdlib_text(20000)[-3000:] + " héllo ✓ 日本"
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids
    assert max(ids) >= 256  # merges, not bytes
    assert tok.decode(ids) == text
    assert "".join(tok.stream(ids)) == text  # streaming holds back incomplete characters


def test_generation_stops_at_eos_like_transformers_generate(setup):
    from tokenizers import Tokenizer

    model, src, art, eos = setup
    ref = Tokenizer.from_file(str(src / "tokenizer.json"))
    prompt = ref.encode(PROMPT).ids
    want = hf_greedy(model, prompt, 50)  # transformers stops after emitting the EOS
    assert want[-1] == eos and len(want) < 50
    sess = open_session(art)
    got = list(sess.generate_ids(prompt, 50, temperature=0))
    assert got == want[:-1]
    sess.reset()
    assert sess.generate(PROMPT, 50, temperature=0) == ref.decode(want[:-1])


def test_run_chat_applies_the_models_chat_template(setup):
    from transformers import PreTrainedTokenizerFast

    _, src, art, _ = setup
    hf_tok = PreTrainedTokenizerFast.from_pretrained(src)
    want = hf_tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in want
    res = runner.invoke(
        app, ["run", str(art), "--chat", "--prompt", "hello there", "-n", "3", "--temperature", "0"]
    )
    assert res.exit_code == 0, res.output
    assert res.output.startswith(want)
    n_prompt = len(hf_tok(want)["input_ids"])
    assert f"prompt {n_prompt} tokens" in res.output.splitlines()[-1]


def test_chat_without_a_template_is_refused(setup, tmp_path):
    import shutil

    _, _, art, _ = setup
    ckpt = art / "checkpoint"
    shutil.copytree(ckpt, tmp_path / "ckpt")
    cfgj = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    del cfgj["chat_template"]
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(cfgj))
    plain = export_model(tmp_path / "ckpt", tmp_path / "art", prefill_chunk=16)
    res = runner.invoke(app, ["run", str(plain), "--chat", "--prompt", "hi", "-n", "2"])
    assert res.exit_code == 2 and "chat template" in res.output


def test_check_feeds_tokens_through_the_tokenizer(setup):
    _, _, art, _ = setup
    res = runner.invoke(app, ["check", str(art), "--tokens", "60"])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output


def test_byte_level_stays_the_default(tmp_path):
    from tests.export_helpers import make_checkpoint

    art = export_model(make_checkpoint(tmp_path / "c", "gla"), tmp_path / "art", prefill_chunk=16)
    sess = open_session(art)
    assert sess.tokenizer.kind == "byte" and "tokenizer" not in sess.manifest.data
    assert sess.tokenizer.encode("hé") == list("hé".encode())
    assert np.all(np.array(list(sess.generate_ids(b"ab", 5, temperature=0))) < 256)


def test_bench_eval_encodes_through_the_tokenizer(setup, tmp_path):
    import os

    from edgeattn.bench.worker import evaluate

    _, _, art, _ = setup
    r = evaluate({"artifact": str(art), "backend": "onnxruntime", "eval_text": os.__file__, "eval_bytes": 80})
    assert 0 < r["bits_per_byte"] < 20 and 60 < r["bytes"] <= 80  # the tokens of 80 bytes of text


def test_sample_on_the_imported_checkpoint_encodes_and_stops_at_eos(setup):
    from tokenizers import Tokenizer

    model, src, art, eos = setup
    ref = Tokenizer.from_file(str(src / "tokenizer.json"))
    want = hf_greedy(model, ref.encode(PROMPT).ids, 50)  # transformers stops after emitting the EOS
    assert want[-1] == eos
    ckpt = art / "checkpoint"  # the imported checkpoint, with the tokenizer files import copied
    res = runner.invoke(app, ["sample", str(ckpt), "--prompt", PROMPT, "-n", "50", "--temperature", "0"])
    assert res.exit_code == 0, res.output
    assert res.output == PROMPT + ref.decode(want[:-1]) + "\n"


def test_sample_without_the_tokenizer_of_a_non_byte_model_is_refused(setup, tmp_path):
    import shutil

    _, _, art, _ = setup
    shutil.copytree(art / "checkpoint", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    res = runner.invoke(app, ["sample", str(tmp_path / "ckpt"), "--prompt", "hi", "-n", "2"])
    assert res.exit_code == 2
    assert res.output.startswith("error:") and len(res.output.strip().splitlines()) == 1
    assert "tokenizer.json" in res.output and "320 tokens" in res.output
