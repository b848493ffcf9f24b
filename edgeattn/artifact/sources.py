"""What a directory is, and where an output may go. torch-free.

``directory_kind(path)`` is the one place that tells a Hugging Face model directory (``config.json`` with a
``model_type``), an edgeattn checkpoint (``config.json`` without one, beside ``model.safetensors``) and an
exported artifact (``edgeattn.json``) apart, and says in one line when a directory is none of them.
``check_output(out, sources, force)`` is the one guard of every command that reads directories and writes
another: the output must not be, contain or lie inside any input (``--force`` would delete it, or the
output would copy itself into itself), and a non-empty output needs ``force``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgeattn.artifact.manifest import MANIFEST

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
HUGGINGFACE, CHECKPOINT, ARTIFACT = "Hugging Face model", "checkpoint", "artifact"
GGUF = "GGUF file"
GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic (llama.cpp's model files)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hf_model_type(path: str | os.PathLike) -> str | None:
    """``config.json``'s ``model_type`` (a Hugging Face model directory), or None (an edgeattn checkpoint,
    whose config.json has no model_type, or no config at all)."""
    p = Path(path) / CONFIG
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from e
    mt = data.get("model_type") if isinstance(data, dict) else None
    return mt if isinstance(mt, str) else None


def directory_kind(path: str | os.PathLike, what: str = "") -> str:
    """``HUGGINGFACE``, ``CHECKPOINT``, ``ARTIFACT`` or ``GGUF`` (a file: a model llama.cpp reads);
    ValueError in one line when ``path`` is missing, not a directory or none of them. ``what`` names the
    argument in the messages (e.g. "checkpoint")."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    if not path.exists():
        raise ValueError(f"{name} does not exist")
    if path.is_file() and (is_gguf(path) or path.suffix.lower() == ".gguf"):
        if not is_gguf(path):
            raise ValueError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC.decode()})")
        return GGUF
    if not path.is_dir():
        raise ValueError(f"{name} is not a directory")
    if (path / MANIFEST).is_file():
        return ARTIFACT
    if hf_model_type(path) is not None:
        return HUGGINGFACE
    if (path / CONFIG).is_file() and (path / WEIGHTS).is_file():
        return CHECKPOINT
    raise ValueError(
        f"{path} is not an edgeattn checkpoint (needs {CONFIG} and {WEIGHTS}), a Hugging Face model directory "
        f"({CONFIG} with a model_type) or an exported artifact ({MANIFEST})"
    )


def check_apart(out: str | os.PathLike, source: str | os.PathLike, kind: str = CHECKPOINT) -> None:
    """ValueError when ``out`` is, contains or lies inside ``source`` (the ``kind`` of input it is)."""
    s, o = Path(source).resolve(), Path(out).resolve()
    if o == s or s in o.parents or o in s.parents:
        where = "is" if o == s else ("lies inside" if s in o.parents else "contains")
        raise ValueError(f"--out {out} {where} the {kind} {source}; choose a directory outside it")


def check_output(
    out: str | os.PathLike, sources: dict[str | os.PathLike, str] | None = None, force: bool = False
) -> None:
    """The guard of an output directory: apart from every input (``sources``: path -> its kind), and empty
    unless ``force``. Raises ValueError in one line; touches nothing."""
    for src, kind in (sources or {}).items():
        check_apart(out, src, kind)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ValueError(f"{out} exists and is not empty; pass --force to replace it")
