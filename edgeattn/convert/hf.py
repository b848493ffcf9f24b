"""Reading a Hugging Face model directory: config.json, one or many safetensors shards, tokenizer files.

Every problem is a ``ValueError`` with one line that names the file, config field or tensor at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgeattn._deps import require
from edgeattn.artifact.sources import CONFIG, hf_model_type
from edgeattn.artifact.tokenizer import TOKENIZER_FILES  # noqa: F401  (its old import path)
from edgeattn.convert.validate import checked_float32, show

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def model_type(path: str | Path) -> str | None:
    """``config.json``'s ``model_type``, or None: ``edgeattn.artifact.sources.hf_model_type``."""
    return hf_model_type(path)


def read_config(path: str | Path) -> dict:
    p = Path(path) / CONFIG
    if not p.is_file():
        raise ValueError(f"{path} has no {CONFIG}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from e


def shard_files(path: str | Path) -> list[Path]:
    """The safetensors files of the model: those listed by model.safetensors.index.json (each must exist),
    or model.safetensors."""
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(
                f"{index} is not a valid safetensors index: weight_map must map tensor names to shard "
                f"file names, got {show(weight_map)}"
            )
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise ValueError(f"shard {f} listed in {INDEX} is missing from {path}")
        return [path / f for f in files]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise ValueError(f"{path} has neither {SINGLE} nor {INDEX}")


class Weights:
    """The model's tensors by name, upcast to float32 when taken; tracks which were used."""

    def __init__(self, path: str | Path):
        torch = require("torch")
        safetensors = require("safetensors")
        from safetensors.torch import load_file

        self.tensors: dict = {}
        for f in shard_files(path):
            try:
                self.tensors.update(load_file(str(f)))
            except (safetensors.SafetensorError, OSError) as e:
                raise ValueError(f"{f} is not a readable safetensors file: {e}") from e
        self.used: set[str] = set()
        self.torch = torch

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...], field: str = ""):
        """The tensor ``name`` as float32; ValueError when it is absent, its shape is not ``shape`` (the shape
        the config implies; ``field`` names the config fields it comes from), it is not stored as floats or
        it holds NaN or infinity (``edgeattn.convert.validate.checked_float32``)."""
        if name not in self.tensors:
            raise ValueError(f"weight {name} is missing from the checkpoint")
        t = self.tensors[name]
        if tuple(t.shape) != tuple(shape):
            why = f" (from config {field})" if field else ""
            raise ValueError(
                f"the config disagrees with the weights: {name} has shape {list(t.shape)}, "
                f"the config implies {list(shape)}{why}"
            )
        self.used.add(name)
        return checked_float32(name, t)

    def unused(self, skip_prefixes: tuple[str, ...] = ()) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.used and not k.startswith(skip_prefixes))


def refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"cannot import: config field {field} = {value!r}: {why}")
