"""`export`'s option combinations (issue 31, item 16): precision x KV dtype x prefill logits x batch x target.
Every combination that cannot work is refused in one line before the model's weights are read (the
options alone, or the checkpoint's config on the meta device); fp16 with float16 or int8 KV buffers
exports and runs, its state never passing through float16."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from edgeattn.export import export_model  # noqa: E402
from edgeattn.runtimes import open_session  # noqa: E402
from tests.export_helpers import PREFILL, make_checkpoint, text_ids  # noqa: E402

HYBRID = "gla,softmax"  # a softmax layer: a KV buffer on the onnxruntime target, a growing cache on portable


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {m: make_checkpoint(root / m.replace(",", "-"), m) for m in (HYBRID, "gla", "gla,swa")}


@pytest.fixture
def no_weights(monkeypatch):
    """Reading the model's weights fails the test: a refusal must come before."""
    import edgeattn.convert

    def load_source(*args, **kwargs):
        raise AssertionError("the model's weights were read before the options were refused")

    monkeypatch.setattr(edgeattn.convert, "load_source", load_source)


# (mixer, options, words of the message)
REFUSED = {
    "kv float16 on portable": (
        HYBRID,
        dict(target="portable", kv_dtype="float16"),
        ["--kv-dtype float16", "growing float32 KV cache", "--target onnxruntime"],
    ),
    "kv int8 on portable, dynamic batch": (
        HYBRID,
        dict(target="portable", kv_dtype="int8", dynamic_batch=True),
        ["--kv-dtype int8", "growing float32 KV cache"],
    ),
    "last on portable": (HYBRID, dict(target="portable", prefill_logits="last"), ["target 'portable'"]),
    "last in fp16": (HYBRID, dict(precision="fp16", prefill_logits="last"), ["precision 'fp16'"]),
    "last in int8, float16 KV": (
        HYBRID,
        dict(precision="int8", kv_dtype="float16", prefill_logits="last", quantization={"weights": "u8"}),
        ["precision 'int8'"],
    ),
    "last with two graphs": (HYBRID, dict(one_graph=False, prefill_logits="last"), ["one_graph False"]),
    "int4 options on fp32": (
        HYBRID,
        dict(quantization={"block_size": 32, "accuracy_level": 1}),
        ["--int4-accuracy-level (accuracy_level), --int4-block-size (block_size)", "--precision int4 only"],
    ),
    "int8 weights on int4": (
        HYBRID,
        dict(precision="int4", quantization={"weights": "u8"}),
        ["--int8-weights"],
    ),
    "int8 with a dynamic batch": (
        HYBRID,
        dict(precision="int8", dynamic_batch=True, quantization={"weights": "u8"}),
        ["DynamicQuantizeLinear"],
    ),
    # from the checkpoint's config: no weights read either
    "kv int8 without softmax layers": (
        "gla",
        dict(kv_dtype="int8"),
        ["--kv-dtype int8", "no softmax layer", "['gla']", "--kv-dtype float32"],
    ),
    "last with a mixer the one graph lacks": (
        "gla,swa",
        dict(prefill_logits="last"),
        ["prefill_logits 'last'"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_combinations_are_refused_before_the_weights_are_read(ckpts, tmp_path, no_weights, case):
    mixer, options, words = REFUSED[case]
    with pytest.raises(ValueError) as info:
        export_model(ckpts[mixer], tmp_path / "out", prefill_chunk=PREFILL, **options)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_the_cli_refuses_in_one_line(ckpts, tmp_path):
    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    args = ["export", str(ckpts[HYBRID]), "--out", str(tmp_path / "o"), "--target", "portable"]
    res = CliRunner().invoke(app, [*args, "--kv-dtype", "int8", "--prefill-logits", "last"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output


def _producer(path, name: str) -> str:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return next(n.op_type for n in graph.node if name in n.output)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_fp16_with_every_kv_dtype_exports_and_runs(ckpts, tmp_path, kv_dtype):
    """fp16 activations with float32, float16 or int8 KV buffers: the export works (float16 and int8 were a
    60-line traceback), the logits stay within fp16's bound of the fp32 artifact's over a prefill and steps,
    the buffers have the asked type, and every state output is written by its own op, never through a
    float16 Cast (the recurrent state, the KV buffers and the position passed through float16 before)."""
    ids = text_ids(40)
    ref = open_session(export_model(ckpts[HYBRID], tmp_path / "fp32", prefill_chunk=PREFILL))
    art = export_model(
        ckpts[HYBRID], tmp_path / "fp16", prefill_chunk=PREFILL, precision="fp16", kv_dtype=kv_dtype
    )
    manifest = json.loads((art / "edgeattn.json").read_text())
    dtypes = {e["name"]: e["dtype"] for e in manifest["state"]}
    assert dtypes["key"] == dtypes["value"] == kv_dtype and dtypes["recurrent_state"] == "float32"
    sess = open_session(art)
    want = [ref.prefill(ids[:, :32])] + [ref.step(ids[:, t : t + 1]) for t in range(32, 40)]
    got = [sess.prefill(ids[:, :32])] + [sess.step(ids[:, t : t + 1]) for t in range(32, 40)]
    for w, g in zip(want, got):
        assert np.abs(g - w).max() < 0.01 * np.abs(w).max()
    for graph in {manifest["graphs"][g]["path"] for g in ("step", "prefill")}:
        for e in manifest["state"]:
            assert _producer(art / graph, e["output"]) != "Cast", (graph, e["output"])
