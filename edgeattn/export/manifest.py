"""The artifact manifest ``edgeattn.json`` (docs/artifact-format.md): read, verify, write. numpy-free, torch-free."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "edgeattn.json"
FORMAT = "edgeattn"
FORMAT_VERSION = 1


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class StateEntry:
    input: str
    output: str
    layer: int
    name: str
    shape: tuple  # ints, or a str for a dynamic dimension
    dtype: str
    shared: bool = False  # one buffer bound as both input and output (a preallocated KV cache)

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)


class Manifest:
    """A parsed, verified manifest. ``Manifest.load(dir)`` refuses what this version cannot run."""

    def __init__(self, root: Path, data: dict):
        self.root = Path(root)
        self.data = data
        self.state = [
            StateEntry(
                s["input"],
                s["output"],
                int(s["layer"]),
                s["name"],
                tuple(s["shape"]),
                s["dtype"],
                bool(s.get("shared", False)),
            )
            for s in data["state"]
        ]

    # fields
    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])

    @property
    def batch_size(self) -> int:
        return int(self.data["batch_size"])

    @property
    def target(self) -> str:
        return self.data["target"]

    @property
    def precision(self) -> str:
        return self.data["precision"]

    @property
    def max_length(self) -> int | None:
        return self.data.get("max_length")

    @property
    def prefill_tokens(self) -> int:
        return int(self.data["graphs"]["prefill"]["tokens"])

    @property
    def weights(self) -> dict | None:
        """The shared weights file's table (``path``, ``bytes``, ``tensors``), or None when each graph holds its own."""
        return self.data.get("weights")

    @property
    def checkpoint(self) -> Path | None:
        ckpt = self.data.get("checkpoint")
        return self.root / ckpt if ckpt else None

    def graph_path(self, name: str) -> Path:
        return self.root / self.data["graphs"][name]["path"]

    @property
    def input_ids_name(self) -> str:
        return self.data.get("inputs", {}).get("input_ids", "input_ids")

    @property
    def logits_name(self) -> str:
        return self.data.get("outputs", {}).get("logits", "logits")

    @classmethod
    def load(cls, root: str | os.PathLike, verify: bool = True) -> Manifest:
        root = Path(root)
        path = root / MANIFEST
        if not root.exists():
            raise ValueError(f"artifact {root} does not exist")
        if not root.is_dir():
            raise ValueError(f"{root} is not an artifact directory")
        if not path.is_file():
            raise ValueError(f"{root} has no {MANIFEST}: not an exported edgeattn artifact")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not an edgeattn manifest (format must be {FORMAT!r})")
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"{path} has format_version {version!r}; this edgeattn reads up to {FORMAT_VERSION}: upgrade edgeattn"
            )
        for key in ("fingerprint", "vocab_size", "batch_size", "graphs", "state", "files"):
            if key not in data:
                raise ValueError(f"{path} lacks the key {key!r}")
        m = cls(root, data)
        if verify:
            m.verify_files()
        return m

    def verify_files(self) -> None:
        for name, info in self.data["files"].items():
            p = self.root / name
            if not p.is_file():
                raise ValueError(f"{p} is missing from the artifact")
            if sha256_file(p) != info["sha256"]:
                raise ValueError(
                    f"{p} does not match its sha256 in {MANIFEST}: the file is corrupt or was edited"
                )


def write_manifest(root: Path, data: dict) -> None:
    """Fill in the sha256 and size of every listed file, then write the manifest."""
    files = {}
    for name in data["files"]:
        p = root / name
        files[name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    data["files"] = files
    (root / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
