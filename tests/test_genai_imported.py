"""`export --genai` on an imported model (transformers' Mamba2 with a trained BPE tokenizer): onnxruntime-genai
stops at the model's own end-of-sequence token where edgeattn does, its Tokenizer reads the artifact, and
`edgeattn check` compares genai's model.onnx too."""

import json
import shutil

import numpy as np
import pytest

from edgeattn.convert import import_model
from edgeattn.export import export_model
from edgeattn.export.check import check_artifact
from edgeattn.export.manifest import MANIFEST, sha256_file
from edgeattn.runtimes import open_session
from tests.hf_helpers import hf_greedy, mamba2, stdlib_text, train_tokenizer

og = pytest.importorskip("onnxruntime_genai")

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(checkpoint, eos id, prompt ids): a Mamba2 whose EOS (generation_config) is a token it greedily
    emits after the prompt, neither 0 nor the pad id."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("genai_imported")
    src = root / "model"
    model = mamba2(seed=1)
    train_tokenizer(src, vocab_size=300)
    prompt = Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROMPT).ids
    free = hf_greedy(model, prompt, 16)
    k = next(i for i in range(3, 16) if free[i] not in free[:i] and free[i] not in (0, 1))
    model.generation_config.eos_token_id = free[k]
    model.save_pretrained(src)
    import_model(src, root / "ckpt")
    return root / "ckpt", free[k], prompt


def genai_greedy(art, prompt, n):
    model = og.Model(str(art))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    out = []
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def test_genai_gets_the_models_special_ids_and_stops_where_edgeattn_stops(imported, tmp_path):
    ckpt, eos, prompt = imported
    art = export_model(ckpt, tmp_path / "art", genai=True)
    manifest = json.loads((art / MANIFEST).read_text())["tokenizer"]
    model = json.loads((art / "genai_config.json").read_text())["model"]
    assert model["eos_token_id"] == manifest["eos_token_ids"] == [eos]
    assert (
        model["pad_token_id"] == manifest["pad_token_id"]
        and model["bos_token_id"] == manifest["bos_token_id"]
    )
    want = list(open_session(art).generate_ids(prompt, 16, temperature=0))  # stops before the EOS
    assert len(want) < 16
    got = genai_greedy(art, prompt, 16)
    assert got == want + [eos]  # genai returns its EOS, then stops


def test_genai_tokenizer_reads_the_imported_artifact(imported, tmp_path):
    from tokenizers import Tokenizer

    ckpt, _, _ = imported
    art = export_model(ckpt, tmp_path / "art", genai=True, include_checkpoint=False)
    assert "tokenizer_config.json" in json.loads((art / MANIFEST).read_text())["files"]
    tok = og.Tokenizer(og.Model(str(art)))
    ref = Tokenizer.from_file(str(art / "tokenizer.json"))
    text = stdlib_text(3000)[-800:]
    ids = ref.encode(text).ids
    assert list(tok.encode(text)) == ids
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == ref.decode(ids)


def test_check_compares_genais_graph_too(imported, tmp_path):
    ckpt, _, _ = imported
    art = export_model(ckpt, tmp_path / "art", genai=True, shared_weights=False)
    report = check_artifact(art, tokens=40)
    assert report.ok and report.graphs["genai"]["tokens"] == 40, report.graphs
    assert report.graphs["genai"]["rel"] <= 1e-4
    # another model's genai graph in its place (the manifest's hash updated): check sees it
    other = tmp_path / "other_ckpt"
    shutil.copytree(ckpt, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(other / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].flip(0)
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    other_art = export_model(other, tmp_path / "other", genai=True, shared_weights=False)
    shutil.copy(other_art / "model.onnx", art / "model.onnx")
    data = json.loads((art / MANIFEST).read_text())
    data["files"]["model.onnx"]["sha256"] = sha256_file(art / "model.onnx")
    (art / MANIFEST).write_text(json.dumps(data))
    report = check_artifact(art, tokens=40)
    assert not report.ok and report.graphs["genai"]["rel"] > 1e-2
    assert report.graphs["step"]["rel"] <= 1e-4
