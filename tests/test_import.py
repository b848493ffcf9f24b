"""`edgeattn import` / `edgeattn export` on Hugging Face model directories: the happy path through the CLI,
and every refusal (one `error:` line, exit 2, nothing written)."""

import json
import shutil

import pytest

from edgeattn.convert.hf import model_type
from tests.hf_helpers import import_export_cli, qwen3_5_text, train_tokenizer

invoke = import_export_cli()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    qwen3_5_text().save_pretrained(root / "m", max_shard_size="60KB")
    return root / "m"


def variant(hf_dir, tmp_path, edit=None, **config):
    """A copy of the model directory with config.json fields replaced."""
    d = tmp_path / "variant"
    shutil.copytree(hf_dir, d)
    c = json.loads((d / "config.json").read_text())
    c.update(config)
    (d / "config.json").write_text(json.dumps(c))
    if edit:
        edit(d)
    return d


def assert_refused(res, message, *paths):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in lines[0], res.output
    for p in paths:
        assert not p.exists(), p


def test_an_edgeattn_checkpoint_has_no_model_type_and_a_hf_directory_has_one(hf_dir, tmp_path):
    res = invoke("import", hf_dir, "--out", tmp_path / "ckpt")
    assert res.exit_code == 0, res.output
    # one line about this model, not the list of every model type the importers support
    assert res.output.strip().splitlines()[-1].endswith("(4 layers: gated_deltanet, softmax; vocabulary 320)")
    assert "mamba2" not in res.output and "model types" not in res.output
    assert model_type(hf_dir) == "qwen3_5_text"
    assert model_type(tmp_path / "ckpt") is None
    assert "model_type" not in json.loads((tmp_path / "ckpt" / "config.json").read_text())


def test_export_takes_a_hf_directory_directly(hf_dir, tmp_path):
    res = invoke("export", hf_dir, "--out", tmp_path / "art", "--prefill-chunk", 16)
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "art" / "edgeattn.json").read_text())
    assert manifest["model"]["mixer"] == ["gated_deltanet"] * 3 + ["softmax"]
    assert "tokenizer" not in manifest  # no tokenizer files: byte-level


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "llama4_text"}, "model_type = 'llama4_text'"),
        ({"num_experts": 8}, "num_experts = 8"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"intermediate_size": 128}, "config disagrees with the weights"),
        ({"linear_num_value_heads": 2}, "config disagrees with the weights"),
    ],
)
@pytest.mark.parametrize("command", ["import", "export"])
def test_what_cannot_be_represented_is_refused_in_one_line(hf_dir, tmp_path, config, message, command):
    src = variant(hf_dir, tmp_path, **config)
    res = invoke(command, src, "--out", tmp_path / "out")
    assert_refused(res, message, tmp_path / "out")


def test_a_missing_shard_is_refused(hf_dir, tmp_path):
    shards = sorted(hf_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    src = variant(hf_dir, tmp_path, edit=lambda d: (d / shards[1].name).unlink())
    assert_refused(
        invoke("import", src, "--out", tmp_path / "out"), f"shard {shards[1].name}", tmp_path / "out"
    )


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(hf_dir, tmp_path):
    src = variant(hf_dir, tmp_path, edit=lambda d: train_tokenizer(d, vocab_size=400))
    res = invoke("import", src, "--out", tmp_path / "out")
    assert_refused(res, "vocabulary (config field vocab_size) is 320", tmp_path / "out")
