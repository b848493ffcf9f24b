"""Importers of models trained elsewhere: one module per source family, chosen by ``model_type``.

    cfg, notes = import_model("path/to/hf_model", "ckpt")   # an ordinary edgeattn checkpoint

Each module's ``convert(config, weights)`` maps the original's config.json and tensors onto an
``EdgeConfig`` and an ``EdgeLM`` state dict, or refuses with one line naming the config field.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from edgeattn.convert.hf import TOKENIZER_FILES, Weights, model_type, read_config
from edgeattn.convert.validate import check_special_ids, check_tokenizer_files

# model_type -> module in edgeattn.convert
CONVERTERS = {
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


def convert_dir(src: str | os.PathLike):
    """(EdgeLM, notes) from the Hugging Face model directory ``src``."""
    from edgeattn.models import EdgeLM

    src = Path(src)
    config = read_config(src)
    mt = config.get("model_type")
    module = converter(mt)
    try:
        cfg, state_dict, notes = module.convert(config, Weights(src))
    except KeyError as e:
        raise ValueError(
            f"cannot import: config field {e.args[0]} is missing from {src / 'config.json'}"
        ) from e
    check_special_ids(src, config, cfg.vocab_size)
    model = EdgeLM(cfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:  # a bug of the mapping, not of the input
        raise RuntimeError(f"{mt} mapping is incomplete: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model, notes


def check_tokenizer(src: Path, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids do not all fit the model's vocabulary."""
    path = src / "tokenizer.json"
    if not path.is_file():
        return
    from edgeattn.artifact.tokenizer import load_hf_tokenizer

    n = load_hf_tokenizer(path).get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(
            f"the tokenizer has {n} tokens but the model's vocabulary (config field vocab_size) is {vocab_size}"
        )


def import_model(src: str | os.PathLike, out: str | os.PathLike, *, force: bool = False):
    """Convert ``src`` into the edgeattn checkpoint directory ``out`` (written whole or not at all),
    carrying its tokenizer files. Returns (EdgeConfig, notes)."""
    from edgeattn._atomic import make_temp_dir, replace_dir

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ValueError(f"{src} is not a directory")
    if model_type(src) is None:
        raise ValueError(f"{src}/config.json has no model_type: not a Hugging Face model directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ValueError(f"{out} exists and is not empty; pass --force to replace it")
    check_tokenizer_files(src, TOKENIZER_FILES)
    model, notes = convert_dir(src)
    check_tokenizer(src, model.cfg.vocab_size)
    if (src / "tokenizer.json").is_file():
        from edgeattn.artifact.tokenizer import tokenizer_info

        info = tokenizer_info(src, read_config(src))
        model.cfg.extra["tokenizer"] = {k: info[k] for k in ("eos_token_ids", "bos_token_id", "pad_token_id")}
    tmp = make_temp_dir(out)  # the shared temporary naming: the next write cleans what a killed import left
    try:
        model.save(tmp / "ckpt")
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / "ckpt" / name)
        replace_dir(tmp / "ckpt", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.cfg, notes


__all__ = ["CONVERTERS", "convert_dir", "import_model", "model_type"]
