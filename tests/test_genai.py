"""`export --genai`: onnxruntime-genai's own Generator runs an edgeattn artifact and decodes what edgeattn does."""

import json

import numpy as np
import onnx
import pytest

from edgeattn.export import export_model
from edgeattn.export.genai import byte_tokenizer_json
from edgeattn.runtimes import open_session
from tests.export_helpers import make_checkpoint, text_ids

og = pytest.importorskip("onnxruntime_genai")

PROMPT, NEW = 40, 24


def genai_greedy(art, prompt: np.ndarray, n: int) -> tuple[np.ndarray, list[int]]:
    """Logits after the whole prompt (one append_tokens call) and up to n greedy tokens from genai's loop."""
    model = og.Model(str(art))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.size + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    logits = np.array(gen.get_logits()).reshape(-1)
    out = []
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return logits, out


@pytest.mark.parametrize(
    "mixer",
    [
        "gla",
        "gated_deltanet",
        "gla,gated_deltanet",
        *(pytest.param(m, marks=pytest.mark.slow) for m in ("kda", "mamba2")),
    ],
)
def test_genai_generator_decodes_what_edgeattn_decodes(tmp_path, mixer):
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer)
    art = export_model(ckpt, tmp_path / "art", genai=True, include_checkpoint=False)
    graph = onnx.load(str(art / "model.onnx"))
    tokens = graph.graph.input[0].type.tensor_type.shape.dim[1]
    assert tokens.dim_param and not tokens.dim_value  # one graph for any number of tokens
    prompt = text_ids(PROMPT, seed=1)
    sess = open_session(art)
    ref_logits = sess.prefill(prompt)[0]
    sess.reset()
    ref = list(sess.generate_ids(prompt[0], NEW, temperature=0))
    logits, got = genai_greedy(art, prompt[0], NEW)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4 * max(1.0, np.abs(ref_logits).max()))
    # genai stops after its end-of-sequence token, byte 0; up to there the tokens are edgeattn's
    assert len(got) >= 8 and got == ref[: len(got)]
    assert len(got) == NEW or got[-1] == 0
    conf = json.loads((art / "genai_config.json").read_text())
    assert conf["model"]["decoder"]["filename"] == "model.onnx"
    manifest = json.loads((art / "edgeattn.json").read_text())
    assert "model.onnx" in manifest["files"] and manifest["genai"]["graph"] == "model.onnx"


def test_byte_level_tokenizer_maps_bytes_to_their_values(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(byte_tokenizer_json())
    text = "héllo, wörld\n\x00 ~"
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_genai_tokenizer_reads_the_artifact(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", genai=True, include_checkpoint=False)
    tok = og.Tokenizer(og.Model(str(art)))
    text = "def f(x): return ü"
    assert list(tok.encode(text)) == list(text.encode("utf-8"))
    assert tok.decode(np.array(list(text.encode("utf-8")), dtype=np.int32)) == text


@pytest.mark.parametrize("mixer", ["softmax", "swa", "flash", "aft_local", "linear"])
def test_genai_refuses_mixers_it_cannot_carry(tmp_path, mixer):
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer)
    with pytest.raises(ValueError, match="--genai: layer 0"):
        export_model(ckpt, tmp_path / "art", genai=True)
    assert not (tmp_path / "art").exists()


def test_genai_needs_fp32_onnxruntime(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    for kw in ({"target": "portable"}, {"precision": "fp16"}):
        with pytest.raises(ValueError, match="--genai"):
            export_model(ckpt, tmp_path / "art", genai=True, **kw)


def test_cli_export_genai(tmp_path):
    import typer
    from typer.testing import CliRunner

    from edgeattn.cli import export

    app = typer.Typer()
    export.register(app)
    app.command("noop")(lambda: None)  # two commands: the command's name stays an argument
    ckpt = make_checkpoint(tmp_path / "ckpt", "retnet")
    res = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "art"), "--genai"])
    assert res.exit_code == 0, res.output
    assert {"model.onnx", "genai_config.json", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "art").iterdir()
    }
    bad = make_checkpoint(tmp_path / "bad", "softmax")
    res = CliRunner().invoke(app, ["export", str(bad), "--out", str(tmp_path / "art2"), "--genai"])
    assert res.exit_code == 2 and "--genai: layer 0 (softmax)" in res.output and "Traceback" not in res.output
