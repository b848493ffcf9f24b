"""edgeattn.artifact is the format's package (issue 21): torch-free, the old import paths still work."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_artifact_imports_without_torch():
    """Importing the format (manifest, state files, tokenizer names) and the ONNX Runtime session loads no
    torch: the base install has none."""
    code = (
        "import sys, edgeattn.artifact.manifest, edgeattn.artifact.state_file, edgeattn.artifact.tokenizer, "
        "edgeattn.runtimes.onnxruntime, edgeattn.runtimes.streams; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_old_import_paths_reexport_the_same_objects():
    import edgeattn.artifact.manifest as manifest
    import edgeattn.artifact.state_file as state_file
    import edgeattn.artifact.tokenizer as tokenizer
    from edgeattn.convert.hf import TOKENIZER_FILES
    from edgeattn.export.manifest import Manifest, StateEntry, sha256_file, write_manifest
    from edgeattn.runtimes.state_file import check_state, load_state, save_state

    assert (Manifest, StateEntry, sha256_file, write_manifest) == (
        manifest.Manifest,
        manifest.StateEntry,
        manifest.sha256_file,
        manifest.write_manifest,
    )
    assert (check_state, load_state, save_state) == (
        state_file.check_state,
        state_file.load_state,
        state_file.save_state,
    )
    assert TOKENIZER_FILES is tokenizer.TOKENIZER_FILES and "tokenizer.json" in TOKENIZER_FILES


@pytest.mark.parametrize("field,value", [("target", "tflite"), ("precision", "int2")])
def test_build_manifest_refuses_unknown_target_and_precision(field, value):
    from edgeattn.artifact.manifest import build_manifest

    args = dict(
        fingerprint="f",
        producer="p",
        model={"vocab_size": 256},
        batch_size=1,
        dynamic_batch=False,
        target="onnxruntime",
        precision="fp32",
        opset=17,
        requires={},
        exported_with={},
        max_length=None,
        graphs={},
        state=[],
        weights=None,
        genai=None,
        checkpoint=None,
        files=[],
    )
    with pytest.raises(ValueError, match=field):
        build_manifest(**{**args, field: value})
