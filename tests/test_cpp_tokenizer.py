"""The C++ example on an artifact with a Hugging Face tokenizer: it reads the special ids from the manifest,
takes and returns token ids, and stops at EOS exactly where transformers' generate and Python's Session do.

The model is a tiny transformers Mamba2 (fixed-size state: the C++ runtime refuses the growing KV cache of
Qwen3.5's full-attention layers) whose EOS is a token it greedily emits after a few steps, with a byte-level BPE
trained by `tokenizers` on stdlib text, as in tests/test_tokenizer_import.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from edgeattn.runtimes import open_session
from tests.artifact_fixture import build_generate
from tests.hf_helpers import hf_greedy, mamba2, train_tokenizer

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(artifact, prompt ids, transformers' greedy tokens ending with the EOS, eos id)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from edgeattn.convert import import_model
    from edgeattn.export import export_model

    root = tmp_path_factory.mktemp("cpp-tok")
    src = root / "model"
    model = mamba2(seed=3)
    train_tokenizer(src, vocab_size=300)
    prompt = Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROMPT).ids
    free = hf_greedy(model, prompt, 12)
    k = next(i for i in range(4, 12) if free[i] not in free[:i])
    model.generation_config.eos_token_id = free[k]
    model.save_pretrained(src)
    import_model(src, root / "ckpt")
    art = export_model(root / "ckpt", root / "art", prefill_chunk=16)
    want = hf_greedy(model, prompt, 50)  # transformers stops after emitting the EOS
    assert want[-1] == free[k] and len(want) < 50
    return art, prompt, want, free[k]


def run(binary, art, *args):
    cmd = [str(binary), str(art), "--threads", "1", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("{")]
    return proc, (json.loads(lines[-1]) if lines else None)


def test_cpp_stops_at_eos_where_transformers_and_python_do(setup, tmp_path):
    binary = build_generate()
    art, prompt, want, eos = setup
    dump = tmp_path / "logits.npy"
    proc, report = run(
        binary, art, "--prompt-ids", ",".join(map(str, prompt)), "-n", 50, "--dump-logits", dump
    )
    assert proc.returncode == 0, proc.stderr
    got = [int(t) for t in proc.stdout.split()]
    assert got == want[:-1]  # the EOS is not printed
    sess = open_session(art, threads=1)
    assert list(sess.generate_ids(prompt, 50, temperature=0)) == got
    assert report["stopped_at_eos"] is True and report["tokens"] == len(got)
    # the EOS was consumed, as Python's generate_ids does: both sessions are at the same position
    assert report["position"] == len(prompt) + len(got) + 1 == sess.position
    rows = np.load(dump)
    assert rows.shape == (len(got) + 1, 320)  # one row per sampled token, the EOS's included
    assert list(rows.argmax(-1)) == [*got, eos]


def test_cpp_without_eos_in_reach_runs_n_tokens(setup):
    binary = build_generate()
    art, prompt, want, _ = setup
    n = len(want) - 2  # stops before the EOS
    proc, report = run(binary, art, "--prompt-ids", " ".join(map(str, prompt)), "-n", n)
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == want[:n]
    assert report["stopped_at_eos"] is False and report["tokens"] == n


def test_text_prompt_on_a_tokenizer_json_artifact_is_refused(setup):
    binary = build_generate()
    art, _, _, _ = setup
    proc, _ = run(binary, art, "--prompt", "hello", "-n", 3)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "--prompt-ids" in proc.stderr
    assert proc.stderr.startswith("generate: error: this artifact's tokenizer is")  # as the C++ README says


@pytest.mark.parametrize(
    "key,value,msg",
    [
        ("eos_token_ids", [100000], "tokenizer.eos_token_ids 100000 is outside the vocabulary"),
        ("eos_token_ids", 3, "tokenizer.eos_token_ids must be a list"),
        ("bos_token_id", -2, "tokenizer.bos_token_id -2 is outside the vocabulary"),
        ("type", "sentencepiece", 'unknown tokenizer type "sentencepiece"'),
    ],
)
def test_bad_tokenizer_entry_is_refused(setup, tmp_path, key, value, msg):
    binary = build_generate()
    art, prompt, _, _ = setup
    bad = tmp_path / "art"
    shutil.copytree(art, bad)
    manifest = json.loads((bad / "edgeattn.json").read_text())
    manifest["tokenizer"][key] = value
    (bad / "edgeattn.json").write_text(json.dumps(manifest))
    proc, _ = run(binary, bad, "--prompt-ids", prompt[0], "-n", 2)
    assert proc.returncode == 1 and msg in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1
