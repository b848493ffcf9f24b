"""The one validation layer of imported models: typed reads of config.json's fields, the special token ids
and every tensor an importer takes.

    c = HFConfig(config)                       # or HFConfig(config["text_config"], prefix="text_config.")
    D = c.int("hidden_size", 4096)             # absent: the original library's default
    eps = c.float("rms_norm_eps", 1e-6, positive=True)

Every importer (qwen3_5, mamba2, rwkv, fla) reads its config through ``HFConfig``, so that a wrong type
(null, a string, a list where a number belongs), a non-finite, zero or negative value is one ``ValueError``
naming the Hugging Face field and its value, before anything is built:

    config.json: hidden_size must be a positive integer, got 0
    config.json: text_config.rms_norm_eps must be a finite number > 0, got -1

A field absent from config.json takes the default of the original library's config class (transformers or
fla), so that the import computes what the original computes. Values that are valid but that edgeattn
cannot represent are refused by the converters with ``edgeattn.convert.hf.refuse`` (one line naming the
field too).
"""

from __future__ import annotations

import json
import math
import os

CONFIG = "config.json"
_MISSING = object()


def show(value, limit: int = 80) -> str:
    """A config value as config.json spells it (null, "abc", [1, 2], -0.5), cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HFConfig:
    """Typed, validated reads of one config dict (``prefix`` names a nested one, e.g. ``text_config.``)."""

    def __init__(self, data, prefix: str = "", file: str = CONFIG):
        if not isinstance(data, dict):
            name = prefix.rstrip(".") or "the file"
            raise ValueError(f"{file}: {name} must be a JSON object, got {show(data)}")
        self.data, self.prefix, self.file = data, prefix, file

    def error(self, key: str, expected: str, value) -> ValueError:
        return ValueError(f"{self.file}: {self.prefix}{key} must be {expected}, got {show(value)}")

    def name(self, key: str) -> str:
        """The field's full name (``text_config.hidden_size``), for messages."""
        return self.prefix + key

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default=None):
        """The value as stored (None when absent or null); no check."""
        v = self.data.get(key)
        return default if v is None else v

    def _value(self, key: str, default, nullable: bool, expected: str):
        if key not in self.data:
            if default is _MISSING:
                raise ValueError(f"{self.file}: {self.prefix}{key} is missing")
            return default, True
        v = self.data[key]
        if v is None:
            if nullable and default is not _MISSING:
                return default, True
            raise self.error(key, expected, v)
        return v, False

    def int(self, key: str, default=_MISSING, *, min: int = 1, nullable: bool = False) -> int:
        """An integer >= ``min`` (1: a positive integer); ``nullable``: null means ``default``."""
        expected = "a positive integer" if min == 1 else f"an integer >= {min}"
        v, is_default = self._value(key, default, nullable, expected)
        if is_default:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < min:
            raise self.error(key, expected, v)
        return v

    def float(
        self,
        key: str,
        default=_MISSING,
        *,
        positive: bool = False,
        min: float | None = None,
        max: float | None = None,
        nullable: bool = False,
    ) -> float:
        """A finite number; ``positive``: > 0; ``min`` / ``max``: bounds (inclusive)."""
        parts = ["a finite number"]
        if positive:
            parts.append("> 0")
        if min is not None:
            parts.append(f">= {min:g}")
        if max is not None:
            parts.append(f"<= {max:g}")
        expected = parts[0] + (" " + " and ".join(parts[1:]) if parts[1:] else "")
        v, is_default = self._value(key, default, nullable, expected)
        if is_default:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, expected, v)
        if (positive and v <= 0) or (min is not None and v < min) or (max is not None and v > max):
            raise self.error(key, expected, v)
        return float(v)

    def bool(self, key: str, default=_MISSING, *, nullable: bool = False) -> bool:
        v, is_default = self._value(key, default, nullable, "true or false")
        if not is_default and not isinstance(v, bool):
            raise self.error(key, "true or false", v)
        return v

    def str(self, key: str, default=_MISSING, *, nullable: bool = False):
        v, is_default = self._value(key, default, nullable, "a string")
        if not is_default and not isinstance(v, str):
            raise self.error(key, "a string", v)
        return v

    def list(self, key: str, default=_MISSING, *, nullable: bool = False):
        v, is_default = self._value(key, default, nullable, "a list")
        if not is_default and not isinstance(v, list):
            raise self.error(key, "a list", v)
        return v

    def sub(self, key: str, *, nullable: bool = True) -> HFConfig | None:
        """The nested object ``key`` (None when absent or null and ``nullable``)."""
        v, _ = self._value(key, None if nullable else _MISSING, nullable, "a JSON object")
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.error(key, "a JSON object", v)
        return HFConfig(v, f"{self.prefix}{key}.", self.file)

    def multiple(self, key: str, value: int, of_key: str, of: int) -> None:
        """Refuse ``value`` (the field ``key``) unless it is a multiple of ``of`` (the field ``of_key``)."""
        if value % of:
            raise self.error(key, f"a multiple of {self.prefix}{of_key} ({of})", value)

    def token_ids(self, vocab_size: int, keys=("bos_token_id", "eos_token_id", "pad_token_id")) -> None:
        """Refuse special token ids that are not ids of the vocabulary: each of ``keys`` is null, an integer
        in [0, vocab_size) or (eos_token_id) a list of them."""
        expected = f"a token id in [0, {vocab_size}) or null"
        for key in keys:
            v = self.data.get(key)
            ids = v if isinstance(v, list) and key == "eos_token_id" else [v]
            for i in ids:
                if i is None and not isinstance(v, list):
                    continue
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
                    raise self.error(key, expected, v)


def check_special_ids(src, config: dict, vocab_size: int) -> None:
    """The special ids of config.json (and of its text_config) and of generation_config.json must be ids of
    the model's vocabulary (the runtimes index the logits with them; C++ refuses such an artifact)."""
    from pathlib import Path

    HFConfig(config).token_ids(vocab_size)
    if isinstance(config.get("text_config"), dict):
        HFConfig(config["text_config"], "text_config.").token_ids(vocab_size)
    gen = Path(src) / "generation_config.json"
    if gen.is_file():
        try:
            data = json.loads(gen.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{gen} is not valid JSON: {e}") from e
        HFConfig(data, file="generation_config.json").token_ids(vocab_size)


def check_tokenizer_files(src, names) -> None:
    """Each of ``names`` in the model directory ``src`` is absent or a file: a symlink to a file (the
    Hugging Face cache's layout) is followed, a directory or a dangling symlink is refused, so that a model
    never imports without the tokenizer it has (its ids would then decode as bytes)."""
    from pathlib import Path

    for name in names:
        p = Path(src) / name
        if p.is_file() or not (p.exists() or p.is_symlink()):
            continue
        if p.is_symlink() and not p.exists():
            raise ValueError(f"{p} is a dangling symlink (to {os.readlink(p)}): the file it names is missing")
        raise ValueError(f"{p} is not a file ({'a directory' if p.is_dir() else 'not a regular file'})")


def checked_float32(name: str, t):
    """``t`` as float32, refused when stored in a non-float dtype (an int32 embedding would be cast
    silently) or when it holds NaN or infinity after the upcast (a float64 1e300 is infinity in float32)."""
    import torch

    if not t.is_floating_point():
        raise ValueError(
            f"weight {name} is stored as {str(t.dtype).removeprefix('torch.')}, not a float type"
        )
    t = t.to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"weight {name} holds non-finite values (NaN or infinity)")
    return t
