"""The validation layer of imported models (edgeattn/convert/validate.py): every bad config value, special
id or tensor is one `error:` line naming the Hugging Face field (or tensor) and its value, exit 2, nothing
written; config keys that change the math are honoured as transformers honours them (checked against
transformers' own forward) or refused."""

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import export, import_
from edgeattn.convert import import_model
from tests.hf_helpers import hf_logits, mamba2, qwen3_5_text, rel_err, rwkv
from tests.test_import import assert_refused, variant

runner = CliRunner()
app = typer.Typer()
for _mod in (import_, export):
    _mod.register(app)

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    model = qwen3_5_text()
    model.save_pretrained(root / "m")
    return model, root / "m"


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 320, size=(1, 48)).astype(np.int64)


def edit_tensors(edit):
    """An edit of `variant`: `edit(tensors)` changes model.safetensors' dict of tensors in place."""

    def apply(d):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    return apply


def nan_in(name):
    def edit(t):
        t[name][0, 0] = float("nan")

    return edit


def as_int32(name):
    def edit(t):
        t[name] = t[name].to(__import__("torch").int32)

    return edit


def write_json(name, data):
    return lambda d: (d / name).write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("config", "edit", "message"),
    [
        # wrong types and values: the Hugging Face field and its value, as config.json spells it
        ({"hidden_size": 0}, None, "config.json: hidden_size must be a positive integer, got 0"),
        ({"hidden_size": None}, None, "config.json: hidden_size must be a positive integer, got null"),
        ({"hidden_size": "64"}, None, 'config.json: hidden_size must be a positive integer, got "64"'),
        ({"num_hidden_layers": -1}, None, "num_hidden_layers must be a positive integer, got -1"),
        ({"layer_types": "linear_attention"}, None, 'layer_types must be a list, got "linear_attention"'),
        ({"layer_types": ["linear_attention"]}, None, "layer_types must be a list of num_hidden_layers (4)"),
        ({"rms_norm_eps": -1}, None, "rms_norm_eps must be a finite number > 0, got -1"),
        ({"linear_num_key_heads": [2]}, None, "linear_num_key_heads must be a positive integer, got [2]"),
        ({"num_key_value_heads": 3}, None, "num_attention_heads must be a multiple of num_key_value_heads"),
        ({"eos_token_id": "abc"}, None, 'eos_token_id must be a token id in [0, 320) or null, got "abc"'),
        ({"eos_token_id": 5000}, None, "eos_token_id must be a token id in [0, 320) or null, got 5000"),
        ({"eos_token_id": -1}, None, "eos_token_id must be a token id in [0, 320) or null, got -1"),
        (
            {"eos_token_id": [1, 320]},
            None,
            "eos_token_id must be a token id in [0, 320) or null, got [1, 320]",
        ),
        ({"pad_token_id": 320}, None, "pad_token_id must be a token id in [0, 320) or null, got 320"),
        (
            {},
            write_json("generation_config.json", {"eos_token_id": 999}),
            "generation_config.json: eos_token_id must be a token id in [0, 320) or null, got 999",
        ),
        # the rotary embedding: invalid values, and scalings edgeattn does not implement
        ({"rope_parameters": "yarn"}, None, 'config.json: rope_parameters must be a JSON object, got "yarn"'),
        (
            {"rope_parameters": {**ROPE, "partial_rotary_factor": -0.5}},
            None,
            "rope_parameters.partial_rotary_factor must be a finite number > 0 and <= 1, got -0.5",
        ),
        (
            {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.3125}},  # 16 * 0.3125 = 5 dims
            None,
            "partial_rotary_factor must be such that head_dim 16 * it is an even number >= 2, got 0.3125",
        ),
        ({"rope_parameters": {**ROPE, "rope_theta": -1}}, None, "rope_theta must be a finite number > 0"),
        ({"rope_theta": -1}, None, "config.json: rope_theta must be a finite number > 0, got -1"),
        (
            {"partial_rotary_factor": -0.5},
            None,
            "config.json: partial_rotary_factor must be a finite number > 0",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 256}},
            None,
            "config field rope_scaling.rope_type = 'yarn'",
        ),
        *(
            ({"rope_scaling": {"type": kind, "factor": 2.0}}, None, f"rope_scaling.rope_type = '{kind}'")
            for kind in ("linear", "dynamic")
        ),
        (
            {"rope_parameters": {**ROPE, "rope_type": "longrope"}},
            None,
            "config field rope_parameters.rope_type = 'longrope'",
        ),
        # tensors: a non-float dtype, NaN; a malformed shard index
        (
            {},
            edit_tensors(as_int32("model.embed_tokens.weight")),
            "weight model.embed_tokens.weight is stored as int32, not a float type",
        ),
        (
            {},
            edit_tensors(nan_in("model.layers.1.linear_attn.in_proj_qkv.weight")),
            "weight model.layers.1.linear_attn.in_proj_qkv.weight holds non-finite values (NaN or infinity)",
        ),
        (
            {},
            write_json("model.safetensors.index.json", {"weight_map": ["a"]}),
            "weight_map must map tensor names to shard file names",
        ),
    ],
)
def test_bad_config_values_and_tensors_are_refused_naming_the_field(qwen, tmp_path, config, edit, message):
    src = variant(qwen[1], tmp_path, edit=edit, **config)
    for command in ("import", "export"):
        assert_refused(invoke(command, src, "--out", tmp_path / "out"), message, tmp_path / "out")


def test_the_text_config_of_a_vision_language_config_is_named_with_its_prefix(qwen, tmp_path):
    text = json.loads((qwen[1] / "config.json").read_text())
    src = variant(qwen[1], tmp_path, model_type="qwen3_5", text_config={**text, "hidden_size": None})
    res = invoke("import", src, "--out", tmp_path / "out")
    assert_refused(res, "config.json: text_config.hidden_size must be a positive integer, got null")


@pytest.mark.parametrize(
    ("family", "config", "message"),
    [
        ("mamba2", {"hidden_size": None}, "config.json: hidden_size must be a positive integer, got null"),
        ("mamba2", {"layer_norm_epsilon": 0}, "layer_norm_epsilon must be a finite number > 0, got 0"),
        ("mamba2", {"time_step_limit": "x"}, 'time_step_limit must be a list of two numbers, got "x"'),
        ("mamba2", {"use_conv_bias": "yes"}, 'use_conv_bias must be true or false, got "yes"'),
        ("rwkv", {"hidden_size": None}, "config.json: hidden_size must be a positive integer, got null"),
        ("rwkv", {"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
        ("rwkv", {"eos_token_id": 320}, "eos_token_id must be a token id in [0, 320) or null, got 320"),
    ],
)
def test_every_importer_reads_its_config_through_the_validation_layer(
    tmp_path_factory, tmp_path, family, config, message
):
    root = tmp_path_factory.mktemp(family)
    {"mamba2": mamba2, "rwkv": rwkv}[family]().save_pretrained(root / "m")
    src = variant(root / "m", tmp_path, **config)
    assert_refused(invoke("import", src, "--out", tmp_path / "out"), message, tmp_path / "out")


def test_fla_configs_go_through_the_validation_layer(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "fla" / "gla"
    src = variant(fixture, tmp_path, num_heads=None)
    res = invoke("import", src, "--out", tmp_path / "out")
    assert_refused(res, "config.json: num_heads must be a positive integer, got null", tmp_path / "out")


def edge_logits(ckpt, ids):
    import torch

    from edgeattn.models import EdgeLM

    with torch.no_grad():
        return EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()


def transformers_logits(src, ids):
    from transformers import Qwen3_5ForCausalLM

    return hf_logits(Qwen3_5ForCausalLM.from_pretrained(src).eval(), ids)


@pytest.mark.parametrize(
    ("drop", "config", "changed"),
    [
        # no rope fields at all: transformers' Qwen3.5 defaults (theta 10000, partial_rotary_factor 0.25),
        # the values the model was saved with
        (["rope_parameters"], {}, False),
        # the legacy key replaces rope_parameters, as transformers reads it
        (
            [],
            {"rope_scaling": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.5}},
            True,
        ),
        # top-level legacy fields where the rope object has none
        (["rope_parameters"], {"rope_theta": 80.0, "partial_rotary_factor": 1.0}, True),
    ],
)
def test_rope_fields_are_read_as_transformers_reads_them(qwen, tmp_path, ids, drop, config, changed):
    def without(d):
        c = json.loads((d / "config.json").read_text())
        for k in drop:
            del c[k]
        (d / "config.json").write_text(json.dumps(c))

    src = variant(qwen[1], tmp_path, edit=without, **config)
    want = transformers_logits(src, ids)
    assert (rel_err(want, hf_logits(qwen[0], ids)) > 1e-3) == changed  # the fields change the math
    import_model(src, tmp_path / "ckpt")
    assert rel_err(edge_logits(tmp_path / "ckpt", ids), want) <= 1e-4


def test_a_yarn_rope_scaling_changes_transformers_logits_and_is_refused(qwen, tmp_path, ids):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    src = variant(qwen[1], tmp_path, rope_scaling=yarn)
    assert rel_err(transformers_logits(src, ids), hf_logits(qwen[0], ids)) > 1e-3
    with pytest.raises(ValueError, match="rope_scaling.rope_type = 'yarn'"):
        import_model(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.fixture(scope="module")
def with_tokenizer(qwen, tmp_path_factory):
    import shutil

    from tests.hf_helpers import train_tokenizer

    d = tmp_path_factory.mktemp("tok") / "m"
    shutil.copytree(qwen[1], d)
    train_tokenizer(d)
    return d


def _as_hf_cache(d):
    """tokenizer.json as a symlink into a blobs folder, as the Hugging Face cache lays files out."""
    blobs = d.parent / "blobs"
    blobs.mkdir()
    (d / "tokenizer.json").rename(blobs / "0123abcd")
    (d / "tokenizer.json").symlink_to("../blobs/0123abcd")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").mkdir()),
            "tokenizer.json is not a file (a directory)",
        ),
        (
            lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").symlink_to("../blobs/gone")),
            "tokenizer.json is a dangling symlink (to ../blobs/gone)",
        ),
        (
            lambda d: ((d / "tokenizer_config.json").unlink(), (d / "tokenizer_config.json").mkdir()),
            "tokenizer_config.json is not a file (a directory)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["import", "export"])
def test_a_tokenizer_that_is_a_directory_or_a_dangling_symlink_is_refused(
    with_tokenizer, tmp_path, edit, message, command
):
    src = variant(with_tokenizer, tmp_path, edit=edit)
    assert_refused(invoke(command, src, "--out", tmp_path / "out"), message, tmp_path / "out")


def test_a_tokenizer_symlinked_into_the_hf_cache_is_followed(with_tokenizer, tmp_path):
    from tokenizers import Tokenizer

    from edgeattn.runtimes import open_session

    d = tmp_path / "snapshot" / "m"
    d.parent.mkdir()
    variant(with_tokenizer, tmp_path).rename(d)
    _as_hf_cache(d)
    assert (d / "tokenizer.json").is_symlink()
    res = invoke("export", d, "--out", tmp_path / "art", "--prefill-chunk", 16)
    assert res.exit_code == 0, res.output
    text = "def main(args):\n    return 1"
    want = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
    assert open_session(tmp_path / "art").tokenizer.encode(text) == want
    assert not (tmp_path / "art" / "tokenizer.json").is_symlink()
