"""Importers of models trained elsewhere: one module per source family, chosen by ``model_type``.

    cfg, notes = import_model("path/to/hf_model", "ckpt")   # an ordinary edgeattn checkpoint
    cfg, notes = import_model("model.gguf", "ckpt")         # a llama.cpp file: edgeattn.convert.gguf

Each module's ``convert(config, weights)`` maps the original's config.json and tensors onto an
``EdgeConfig`` and an ``EdgeLM`` state dict, or refuses with one line naming the config field.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from edgeattn.artifact.sources import CHECKPOINT, GGUF, HUGGINGFACE, check_output, directory_kind
from edgeattn.artifact.tokenizer import TOKENIZER_FILES, TOKENIZER_JSON, check_vocabulary
from edgeattn.convert.hf import Weights, model_type, read_config
from edgeattn.convert.validate import check_special_ids, check_tokenizer_files

# model_type -> module in edgeattn.convert
CONVERTERS = {
    "llama": "llama",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "mamba2": "mamba2",
    "rwkv": "rwkv",
    "gla": "fla",
    "delta_net": "fla",
    "gated_deltanet": "fla",
    "retnet": "fla",
    "linear_attn": "fla",
}


def converter(mt: str):
    import importlib

    if mt not in CONVERTERS:
        raise ValueError(
            f"cannot import: config field model_type = {mt!r} is not supported; "
            f"supported: {', '.join(sorted(CONVERTERS))}"
        )
    return importlib.import_module(f"edgeattn.convert.{CONVERTERS[mt]}")


def convert_dir(src: str | os.PathLike, weights: Weights | None = None):
    """(EdgeLM, notes) from the Hugging Face model directory ``src`` (``weights``: its tensors, when they
    come from elsewhere than its safetensors files: a GGUF's)."""
    from edgeattn.models import EdgeLM

    src = Path(src)
    config = read_config(src)
    mt = config.get("model_type")
    module = converter(mt)
    try:
        cfg, state_dict, notes = module.convert(config, Weights(src) if weights is None else weights)
    except KeyError as e:
        raise ValueError(
            f"cannot import: config field {e.args[0]} is missing from {src / 'config.json'}"
        ) from e
    check_special_ids(src, config, cfg.vocab_size)
    model, missing, unexpected = EdgeLM.from_state_dict(cfg, state_dict)  # the mapped tensors, not copies
    if missing or unexpected:  # a bug of the mapping, not of the input
        raise RuntimeError(f"{mt} mapping is incomplete: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model, notes


@dataclass
class Source:
    """A model to export or save, in memory: ``model`` (an ``EdgeLM``, eval mode), the directory it came from
    (``root``: its tokenizer files, and an edgeattn checkpoint's files), what that directory is (``kind``,
    ``edgeattn.artifact.sources``) and the converter's notes for the user."""

    model: object
    root: Path
    kind: str
    notes: list[str] = field(default_factory=list)
    scratch: object = None  # a GGUF's: the TemporaryDirectory ``root`` is (its tokenizer files), kept alive

    def write_checkpoint(self, directory: Path) -> None:
        """The model as an edgeattn checkpoint in the new directory ``directory`` (not atomic: the caller
        writes into its temporary): an edgeattn checkpoint's own files (less its trainer state), or the
        converted model's weights and config plus the source's tokenizer files."""
        if self.kind == CHECKPOINT:
            shutil.copytree(self.root, directory, ignore=shutil.ignore_patterns("trainer_state*"))
            return
        directory.mkdir()
        self.model.save_files(directory)
        for name in TOKENIZER_FILES:
            if (self.root / name).is_file():
                shutil.copy2(self.root / name, directory / name)


def load_source(path: str | os.PathLike, what: str = "checkpoint") -> Source:
    """The model in the directory ``path``: an edgeattn checkpoint loaded, or a Hugging Face model converted
    in memory (no checkpoint on disk) with its tokenizer checked against the vocabulary and its special
    ids recorded in ``cfg.extra``. One line (ValueError) for any other directory."""
    from edgeattn.models import EdgeLM

    path = Path(path)
    kind = directory_kind(path, what)
    if kind == CHECKPOINT:
        return Source(EdgeLM.load(path).eval(), path, kind)
    if kind == GGUF:
        return _gguf_source(path)
    if kind != HUGGINGFACE:
        raise ValueError(f"{path} is an exported {kind}, not a checkpoint or a Hugging Face model directory")
    return _hf_source(path, kind)


def _gguf_source(path: Path) -> Source:
    """A GGUF file as a Hugging Face directory: its config.json and tokenizer files written into a
    temporary directory (the Source's root while it lives), its weights dequantized from the file."""
    import json
    import tempfile

    from edgeattn.convert.gguf import GGUFModel

    gguf = GGUFModel(path)
    scratch = tempfile.TemporaryDirectory(prefix="edgeattn-gguf-")
    root = Path(scratch.name)
    (root / "config.json").write_text(json.dumps(gguf.config, indent=2))
    gguf.write_tokenizer(root)
    return _hf_source(root, GGUF, gguf.weights, scratch)


def _hf_source(path: Path, kind: str, weights=None, scratch=None) -> Source:
    check_tokenizer_files(path, TOKENIZER_FILES)
    model, notes = convert_dir(path, weights)
    if (path / TOKENIZER_JSON).is_file():
        from edgeattn.artifact.tokenizer import tokenizer_info

        info = tokenizer_info(path, read_config(path))
        check_vocabulary(info["vocab_size"], model.cfg.vocab_size, "config field vocab_size")
        # keys sorted, as a saved config reads back: the manifest is the same from a checkpoint as from here
        keys = ("bos_token_id", "eos_token_ids", "pad_token_id")
        model.cfg.extra["tokenizer"] = {k: info[k] for k in keys}
    return Source(model.eval(), path, kind, notes, scratch)


def import_model(src: str | os.PathLike, out: str | os.PathLike, *, force: bool = False):
    """Convert ``src`` (a Hugging Face model directory or a GGUF file) into the edgeattn checkpoint directory
    ``out`` (written whole or not at all), carrying its tokenizer files: export's converter plus the
    checkpoint's files. Returns (EdgeConfig, notes)."""
    from edgeattn._atomic import make_temp_dir, replace_dir

    src, out = Path(src), Path(out)
    kind = directory_kind(src)
    if kind not in (HUGGINGFACE, GGUF):
        raise ValueError(
            f"{src}/config.json has no model_type: not a Hugging Face model directory or a GGUF file"
        )
    check_output(out, {src: kind}, force)
    source = load_source(src)
    tmp = make_temp_dir(out)  # the shared temporary naming: the next write cleans what a killed import left
    try:
        source.write_checkpoint(tmp / "ckpt")
        replace_dir(tmp / "ckpt", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return source.model.cfg, source.notes


__all__ = ["CONVERTERS", "Source", "convert_dir", "import_model", "load_source", "model_type"]
