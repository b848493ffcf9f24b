"""The packager (``edgeattn.export.package``): an export writes each file of the artifact once, reads none
of them back, and the manifest's sha256 and sizes are those of the files on disk (hashed here with
hashlib, independently of the exporter)."""

from __future__ import annotations

import builtins
import hashlib
import io
import json
from collections import Counter
from pathlib import Path

import pytest

from edgeattn.export import exporter
from edgeattn.export.exporter import export_model
from tests.export_helpers import make_checkpoint


@pytest.mark.parametrize("large", [False, True])
def test_export_writes_each_file_once_and_reads_none_back(tmp_path, monkeypatch, large):
    """Two graphs sharing weights.bin, a precision pass with its check, a checkpoint kept; ``large``: the
    path of models over ``LARGE_MODEL_BYTES`` (each passed graph through a scratch file, not the artifact)."""
    if large:
        monkeypatch.setattr(exporter, "LARGE_MODEL_BYTES", 0)
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla,softmax", seed=0)
    out = tmp_path / "art"
    opened = []
    real = builtins.open

    def spy(file, mode="r", *args, **kwargs):
        opened.append((Path(file) if isinstance(file, (str, Path)) else None, mode))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)  # pathlib's read_bytes/write_text
    export_model(ckpt, out, precision="fp16", one_graph=False, prefill_chunk=16)
    monkeypatch.setattr(builtins, "open", real)
    monkeypatch.setattr(io, "open", real)

    def artifact_name(path: Path | None) -> str | None:
        """The path relative to the artifact of a file opened inside its temporary directory (the first
        directory under tmp_path other than the checkpoint and the artifact itself)."""
        if path is None or not path.is_relative_to(tmp_path) or path.is_relative_to(ckpt):
            return None
        parts = path.relative_to(tmp_path).parts
        return "/".join(parts[1:]) if len(parts) > 1 else None

    writes = Counter(artifact_name(p) for p, mode in opened if set(mode) & set("wax+"))
    reads = Counter(artifact_name(p) for p, mode in opened if not set(mode) & set("wax+"))
    manifest = json.loads((out / "edgeattn.json").read_text())
    listed = set(manifest["files"])
    assert {"step.onnx", "prefill.onnx", "weights.bin", "checkpoint/model.safetensors"} <= listed
    for name in [*listed, "edgeattn.json"]:
        assert writes[name] == 1, (name, writes[name])
        assert reads[name] == 0, (name, reads[name])
    for name, info in manifest["files"].items():
        data = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, name
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    unlisted = on_disk - listed - {"edgeattn.json"}
    assert all(n.startswith("checkpoint/") for n in unlisted), unlisted  # no scratch trace left behind
