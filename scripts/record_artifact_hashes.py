"""Record the sha256 of every file of one small exported artifact per mixer family.

tests/test_artifact_identical.py compares a fresh export against these hashes. Run it with the code
whose output is the reference on PYTHONPATH (the commit before a refactoring, e.g. a copy of ``main``):

    PYTHONPATH=/tmp/ea-main python scripts/record_artifact_hashes.py tests/fixtures/artifact_sha256.json

It writes the JSON and prints the versions it used: hashes are only comparable under the same torch,
onnx and onnxruntime (the manifest records them), which the test checks before comparing.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

# One tiny model per family; each case: (name, mixer, export options).
CASES = [
    ("linear", "linear", {}),
    ("performer", "performer", {}),
    ("retnet", "retnet", {}),
    ("gla", "gla", {}),
    ("aft", "aft", {}),
    ("aft_local", "aft_local", {}),
    ("flash", "flash", {}),
    ("softmax", "softmax", {}),
    ("swa", "swa", {}),
    ("deltanet", "deltanet", {}),
    ("gated_deltanet", "gated_deltanet", {}),
    ("kda", "kda", {}),
    ("mamba2", "mamba2", {}),
    ("hybrid_portable_fp16", "gla,softmax,swa", {"target": "portable", "precision": "fp16"}),
    ("gla_int4", "gla", {"precision": "int4"}),
    # int8's dynamic quantization (uint8 weights per channel; the default became weight-only "blocks")
    (
        "gla_int8_genai_off",
        "gla,softmax",
        {"precision": "int8", "one_graph": False, "quantization": {"weights": "u8"}},
    ),
    # a Hugging Face Qwen3.5 directory with its tokenizer, through `edgeattn export HF_DIR` (the converter)
    ("qwen3_5_hf_int4", "hf:qwen3_5", {"precision": "int4"}),
]


def export_case(root: Path, name: str, mixer: str, options: dict) -> dict[str, str]:
    """Export case ``name`` under ``root``; its files' sha256 by relative path."""
    import hashlib

    from edgeattn.export.exporter import export_model
    from tests.export_helpers import grid_weights, make_checkpoint

    out = root / name
    if mixer.startswith("hf:"):
        from typer.testing import CliRunner

        from edgeattn.cli.main import app
        from tests.hf_helpers import qwen3_5_text, train_tokenizer

        src = root / f"{name}-hf"
        model = qwen3_5_text(seed=0)
        grid_weights(model, seed=0)
        model.save_pretrained(src)
        train_tokenizer(src)
        args = ["export", str(src), "--out", str(out), "--prefill-chunk", "16", "--prefill-logits", "all"]
        args += [a for k, v in options.items() for a in (f"--{k}", v)]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
    else:
        ckpt = make_checkpoint(root / f"{name}-ckpt", mixer, seed=0, grid=True)
        # every token's logits, as the graphs were recorded: the one graph's default (last) adds a Slice
        # before the head (tests/test_smollm.py and test_import_llama.py check it against transformers)
        export_model(ckpt, out, prefill_chunk=16, prefill_logits="all", **options)
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def main(path: str) -> None:
    out = {"versions": versions(), "cases": {}}
    with tempfile.TemporaryDirectory() as d:
        for name, mixer, options in CASES:
            out["cases"][name] = export_case(Path(d), name, mixer, options)
            print(name, len(out["cases"][name]), "files", flush=True)
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps(out["versions"]))


if __name__ == "__main__":
    main(sys.argv[1])
