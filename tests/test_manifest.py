"""Manifest validation when a session opens: the manifest against the graphs' real inputs and outputs, every
field a session reads, and every file it runs listed and hashed. Python (all backends) and, in
tests/test_cpp.py, the C++ runtime refuse the same edits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnx", reason="the synthetic artifact is built with onnx")

from edgeattn.runtimes import open_session  # noqa: E402
from tests.artifact_fixture import build_artifact  # noqa: E402


def edit(root: Path, fn) -> None:
    path = root / "edgeattn.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _set_state_shape(d):
    d["state"][1]["shape"] = [1, 2, 4, 5]


def _rename_state_input(d):
    d["state"][1]["input"] = "past_key_values.0.other"


def _swap_graph(root: Path):
    """Replace step.onnx by another model's step graph, with its sha256 and files entry removed."""

    def fn(d):
        other = build_artifact(root.parent / "other", seed=7)
        shutil.copy(other / "step.onnx", root / "step.onnx")
        del d["files"]["step.onnx"]

    return fn


# name -> (edit of the manifest data, message); the first eight are also refused by the C++ runtime
EDITS = {
    "state shape": (_set_state_shape, "has shape [1, 2, 4, 4], edgeattn.json says [1, 2, 4, 5]"),
    "vocab_size": (lambda d: d.update(vocab_size=300), "edgeattn.json says [1, 1, 300]"),
    "prefill tokens": (lambda d: d["graphs"]["prefill"].update(tokens=8), "edgeattn.json says [1, 8]"),
    "input_ids name": (lambda d: d["inputs"].update(input_ids="ids"), "no input named 'ids'"),
    "state input name": (_rename_state_input, "no input named 'past_key_values.0.other'"),
    "state without shape": (lambda d: d["state"][0].pop("shape"), "lacks the key 'state[0].shape'"),
    "file without sha256": (lambda d: d["files"]["step.onnx"].pop("sha256"), "sha256"),
    "graph not listed": (lambda d: d["files"].pop("prefill.onnx"), "prefill.onnx is not listed"),
    "state dtype": (lambda d: d["state"][0].update(dtype="float16"), "'float32'"),
    "int8 KV without scales": (lambda d: d["state"][0].update(shared=True, dtype="int8"), "'state[0].scale'"),
    "vocab_size type": (lambda d: d.update(vocab_size="256"), "'vocab_size' must be a positive integer"),
    "state not a list": (lambda d: d.update(state={}), "'state' must be a list"),
    "bad sha256": (lambda d: d["files"]["step.onnx"].update(sha256="abc"), "sha256 hex digest"),
    "duplicate name": (lambda d: d["state"][1].update(input=d["state"][0]["input"]), "used twice"),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return build_artifact(tmp_path_factory.mktemp("synthetic") / "art")


@pytest.mark.parametrize("case", sorted(EDITS))
def test_edited_manifest_is_refused_when_the_session_opens(synthetic, tmp_path, case):
    root = tmp_path / "art"
    shutil.copytree(synthetic, root)
    fn, message = EDITS[case]
    edit(root, fn)
    with pytest.raises(ValueError) as info:
        open_session(root, threads=1)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_swapped_graph_without_its_files_entry_is_refused(synthetic, tmp_path):
    root = tmp_path / "art"
    shutil.copytree(synthetic, root)
    edit(root, _swap_graph(root))
    with pytest.raises(ValueError, match="step.onnx is not listed under 'files', so it cannot be verified"):
        open_session(root, threads=1)


def test_the_unedited_artifact_opens(synthetic):
    sess = open_session(synthetic, threads=1)
    assert sess.prefill([[1, 2, 3, 4, 5]]).shape == (1, 256)


# ----------------------------------------------------------------------------------------------------------
# a real export: the checkpoint's files too, and the torch backend
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from edgeattn.export import export_model
    from tests.export_helpers import PREFILL, make_checkpoint

    root = tmp_path_factory.mktemp("exported")
    return export_model(make_checkpoint(root / "ckpt", "gla"), root / "art", prefill_chunk=PREFILL)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_checkpoint_files_must_be_listed(exported, tmp_path, backend):
    root = tmp_path / "art"
    shutil.copytree(exported, root)
    edit(root, lambda d: d["files"].pop("checkpoint/model.safetensors"))
    with pytest.raises(ValueError, match="checkpoint/model.safetensors is not listed"):
        open_session(root, backend=backend)


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda d: d.update(vocab_size=300), "vocab_size 300, its checkpoint has 256"),
        (lambda d: d["state"][0].update(shape=[1, 2, 16, 8]), "does not match its checkpoint's state"),
    ],
)
def test_torch_backend_checks_the_manifest_against_its_checkpoint(exported, tmp_path, fn, message):
    root = tmp_path / "art"
    shutil.copytree(exported, root)
    edit(root, fn)
    with pytest.raises(ValueError, match=message):
        open_session(root, backend="torch")


def test_cli_prints_one_error_line_for_an_edited_manifest(exported, tmp_path):
    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    root = tmp_path / "art"
    shutil.copytree(exported, root)
    # (gla's one graph takes any number of tokens, so an edited prefill chunk would be no error)
    edit(root, lambda d: d.update(vocab_size=300))
    res = CliRunner().invoke(app, ["run", str(root), "--prompt", "x", "-n", "2"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "[1, 1, 300]" in lines[0], res.output
