"""`export --max-length N` (``export_model(max_length=N)``): the KV buffers, the manifest's limit and
genai's context length follow N; logits equal those of the default export and of transformers."""

import json
import math

import numpy as np
import onnx
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import export as export_cli
from edgeattn.export import export_model
from edgeattn.export.check import run_logits
from edgeattn.export.exporter import kv_buffer_bytes
from edgeattn.runtimes import open_session
from tests.export_helpers import PREFILL, make_checkpoint, text_ids

N = 48
MAX_SEQ_LEN = 512  # tiny_config's: the default buffer length

runner = CliRunner()


def invoke(*args):
    from edgeattn.cli.main import app

    return runner.invoke(app, [str(a) for a in args])


def manifest(art) -> dict:
    return json.loads((art / "edgeattn.json").read_text())


def graph_state_dims(path) -> dict[str, list]:
    """Each state input's and output's dims as the ONNX graph declares them (ints or symbolic names)."""
    g = onnx.load(str(path), load_external_data=False).graph
    return {
        v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
        for v in [*g.input, *g.output]
        if v.name.startswith(("past_key_values.", "present."))
    }


@pytest.fixture(scope="module")
def softmax(tmp_path_factory):
    """A softmax + gla checkpoint exported by the CLI with --max-length N and by default."""
    root = tmp_path_factory.mktemp("ml")
    ckpt = make_checkpoint(root / "ckpt", "softmax,gla", max_seq_len=MAX_SEQ_LEN)
    args = [
        "--max-length",
        N,
        "--prefill-chunk",
        PREFILL,
        "--prefill-logits",
        "all",
    ]  # every position compared
    res = invoke("export", ckpt, "--out", root / "short", *args)
    assert res.exit_code == 0, res.output
    return (
        ckpt,
        root / "short",
        export_model(ckpt, root / "full", prefill_chunk=PREFILL, prefill_logits="all"),
    )


def test_kv_buffers_manifest_and_graph_follow_max_length(softmax):
    ckpt, art, full = softmax
    m = manifest(art)
    assert m["max_length"] == N and manifest(full)["max_length"] == MAX_SEQ_LEN
    shared = [e for e in m["state"] if e.get("shared")]
    assert [e["name"] for e in shared] == ["key", "value"]
    assert all(e["shape"][2] == N for e in shared)
    dims = graph_state_dims(art / "step.onnx")
    for e in shared:
        assert dims[e["input"]][2] == N and dims[e["output"]][2] == N, dims
    # the config keeps its own max_seq_len: in the manifest, the carried checkpoint and the source
    assert m["model"]["max_seq_len"] == MAX_SEQ_LEN
    for c in (art / "checkpoint", ckpt):
        assert json.loads((c / "config.json").read_text())["max_seq_len"] == MAX_SEQ_LEN
    # kv_buffer_bytes (the CLI's note) counts what the manifest lists
    want = sum(math.prod(e["shape"]) * 4 for e in shared)
    assert kv_buffer_bytes(ckpt, "onnxruntime", max_length=N) == want
    assert kv_buffer_bytes(ckpt, "onnxruntime") == want * MAX_SEQ_LEN // N
    assert kv_buffer_bytes(ckpt, "portable") == 0


def test_logits_equal_the_default_export_and_the_limit_is_enforced(softmax):
    _, art, full = softmax
    ids = text_ids(N + 1)
    sess, ref = open_session(art), open_session(full)
    got, want = run_logits(sess, ids[:, :40]), run_logits(ref, ids[:, :40])  # 2 prefill chunks, 8 steps
    assert got["prefill"].shape[1] == 32 and got["step"].shape[1] == 8
    for g in ("prefill", "step"):
        np.testing.assert_allclose(got[g], want[g], rtol=0, atol=1e-5 * max(1.0, np.abs(want[g]).max()))
    for backend in ("onnxruntime", "torch"):  # the torch backend sizes its buffer from the manifest too
        s = open_session(art, backend=backend)
        s.prefill(ids[:, :40])
        for t in range(40, N):
            s.step(ids[:, t : t + 1])
        assert s.position == N
        with pytest.raises(ValueError, match=f"maximum of {N}"):
            s.step(ids[:, N : N + 1])
    sess.reset()
    with pytest.raises(ValueError, match=f"maximum of {N}"):
        list(sess.generate_ids(ids[0, :40].tolist(), N - 40 + 1, temperature=0))


def test_portable_growing_cache_records_max_length(softmax, tmp_path):
    ckpt, _, _ = softmax
    art = export_model(ckpt, tmp_path / "p", target="portable", prefill_chunk=PREFILL, max_length=N)
    m = manifest(art)
    assert m["max_length"] == N and not any(e.get("shared") for e in m["state"])
    assert graph_state_dims(art / "step.onnx")["past_key_values.0.key"][2] == "past_length"
    sess = open_session(art)
    sess.prefill(text_ids(N))
    with pytest.raises(ValueError, match=f"maximum of {N}"):
        sess.step(text_ids(1))


def test_cli_notes_large_buffers_without_max_length(softmax, tmp_path, monkeypatch):
    ckpt, _, _ = softmax
    monkeypatch.setattr(export_cli, "LARGE_KV_BUFFERS", 1000)  # the tiny model's buffers count as large
    res = invoke("export", ckpt, "--out", tmp_path / "a", "--prefill-chunk", PREFILL)
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    gib = kv_buffer_bytes(ckpt, "onnxruntime") / 2**30
    assert (
        len(notes) == 1
        and f"{gib:.1f} GiB ({MAX_SEQ_LEN} tokens" in notes[0]
        and "--max-length N" in notes[0]
    )
    res = invoke("export", ckpt, "--out", tmp_path / "b", "--prefill-chunk", PREFILL, "--max-length", N)
    assert res.exit_code == 0 and "note:" not in res.output, res.output
    res = invoke("export", ckpt, "--out", tmp_path / "c", "--target", "portable")  # no buffers: no note
    assert res.exit_code == 0 and "note:" not in res.output, res.output


def test_a_model_without_a_length_limit_ignores_it_with_a_note(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    res = invoke("export", ckpt, "--out", tmp_path / "art", "--max-length", N)
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "ignored" in notes[0] and "fixed-size state" in notes[0]
    assert manifest(tmp_path / "art")["max_length"] is None


def test_genai_context_length_follows_max_length(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")  # --genai refuses softmax layers: a recurrent model
    res = invoke("export", ckpt, "--out", tmp_path / "art", "--genai", "--max-length", N)
    assert res.exit_code == 0 and "note:" not in res.output, res.output
    conf = json.loads((tmp_path / "art" / "genai_config.json").read_text())
    assert conf["model"]["context_length"] == N and conf["search"]["max_length"] == N
    tok = json.loads((tmp_path / "art" / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == N
    default = export_model(ckpt, tmp_path / "d", genai=True, include_checkpoint=False)
    conf = json.loads((default / "genai_config.json").read_text())
    assert conf["model"]["context_length"] == MAX_SEQ_LEN == conf["search"]["max_length"]


def assert_bad_input(res, option):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], res.output
    assert "Traceback" not in res.output


def test_bad_max_length_is_one_line_and_writes_nothing(softmax, tmp_path):
    ckpt, _, _ = softmax
    for value in ("0", "-5", "abc", "1.5"):
        out = tmp_path / f"art{value}"
        assert_bad_input(invoke("export", ckpt, "--out", out, "--max-length", value), "--max-length")
        assert not out.exists()
    for value in (0, -1, 2.0, True, "48"):
        with pytest.raises(ValueError, match="max_length must be a positive integer"):
            export_model(ckpt, tmp_path / "api", max_length=value)
        assert not (tmp_path / "api").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_a_prefill_chunk_longer_than_the_kv_buffer_is_one_line(softmax, tmp_path):
    """It used to fail deep in the tracer ("The size of tensor a (256) must match ... (104)")."""
    ckpt, _, _ = softmax
    out = tmp_path / "art"
    res = invoke("export", ckpt, "--out", out, "--max-length", "32", "--prefill-chunk", "48")
    assert_bad_input(res, "--prefill-chunk 48 exceeds --max-length 32")
    assert not out.exists()


@pytest.mark.parametrize("length, chunk", [(40, 16), (12, 8)])
def test_int4_with_buffers_shorter_than_the_precision_check_exports_and_equals_the_long_one(
    softmax, tmp_path, length, chunk
):
    """The int4 precision check feeds 4 calls of 16 tokens; buffers of 40 tokens hold 2 of them (the
    export used to fail in the torch reference: "The expanded size of the tensor (40) must match the
    existing size (64)"), and buffers of 12 not even one (it failed the same way: the check's calls are
    then 12 tokens long). The short buffers give the logits of the default length's int4 export."""
    from edgeattn.runtimes import open_session

    ckpt, _, _ = softmax
    opts = dict(precision="int4", prefill_chunk=chunk, prefill_logits="all")
    short = export_model(ckpt, tmp_path / "short", max_length=length, **opts)
    assert open_session(short).manifest.max_length == length
    full = export_model(ckpt, tmp_path / "full", **opts)
    ids = np.arange(1, length - 1)[None]
    np.testing.assert_allclose(open_session(short).prefill(ids), open_session(full).prefill(ids), atol=1e-4)


def test_imported_qwen3_5_follows_max_length_and_equals_transformers(tmp_path):
    from tests.hf_helpers import hf_logits, qwen3_5_text, rel_err

    model = qwen3_5_text()  # max_position_embeddings 1024
    model.save_pretrained(tmp_path / "hf")
    L, T = 64, 60
    res = invoke(
        "export",
        tmp_path / "hf",
        "--out",
        tmp_path / "art",
        "--max-length",
        L,
        "--prefill-chunk",
        PREFILL,
        "--prefill-logits",
        "all",
    )
    assert res.exit_code == 0, res.output
    art = tmp_path / "art"
    m = manifest(art)
    assert m["max_length"] == L and m["model"]["max_seq_len"] == 1024
    shared = [e for e in m["state"] if e.get("shared")]
    assert len(shared) == 2 and all(e["shape"][2] == L for e in shared)  # one gated attention layer
    dims = graph_state_dims(art / "step.onnx")
    assert all(dims[e["input"]][2] == L and dims[e["output"]][2] == L for e in shared)
    ids = np.random.default_rng(0).integers(0, 320, size=(1, T)).astype(np.int64)
    sess = open_session(art)
    got = run_logits(sess, ids)
    full = np.concatenate([got["prefill"], got["step"]], axis=1)
    assert full.shape[1] == T
    assert rel_err(full, hf_logits(model, ids)) <= 1e-4
    sess.prefill(np.zeros((1, L - T), np.int64))  # up to the limit
    assert sess.position == L
    with pytest.raises(ValueError, match=f"maximum of {L}"):
        sess.step(ids[:, :1])


def test_help_lists_max_length():
    app = typer.Typer()
    export_cli.register(app)
    app.command("noop")(lambda: None)
    res = runner.invoke(app, ["export", "--help"])
    assert res.exit_code == 0 and "--max-length" in res.output
