"""Tokenizers of artifacts: byte-level (edgeattn's own models) or a Hugging Face ``tokenizer.json``.

The manifest's ``"tokenizer"`` entry (absent: byte-level, vocabulary 256) reads

    {"type": "huggingface", "path": "tokenizer.json", "vocab_size": N, "eos_token_ids": [...],
     "bos_token_id": id or null, "pad_token_id": id or null, "chat_template": "chat_template.jinja" or null}

The Hugging Face ``tokenizers`` library (and jinja2 for chat templates) is the ``tokenizers`` extra:
it pulls huggingface_hub, too much for the base device install.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from edgeattn._deps import require

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
# Files an imported model's checkpoint and artifact carry for its tokenizer and chat template (those
# that exist in the source directory).
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    GENERATION_CONFIG,
    CHAT_TEMPLATE,
    "chat_template.json",
)


def check_vocabulary(n_tokens: int, vocab_size: int, field: str = "") -> None:
    """The one check that a tokenizer's ids all fit the model's vocabulary (ValueError in one line);
    ``field`` names where the vocabulary size comes from."""
    if n_tokens > vocab_size:
        where = f" ({field})" if field else ""
        raise ValueError(
            f"the tokenizer has {n_tokens} tokens but the model's vocabulary{where} is {vocab_size}"
        )


def load_hf_tokenizer(path: str | Path):
    tokenizers = require("tokenizers")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type
        raise ValueError(f"{path} is not a readable tokenizer.json: {str(e).splitlines()[0]}") from e


class ByteTokenizer:
    """UTF-8 bytes are the token ids."""

    kind = "byte"
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Text pieces as the ids arrive (multi-byte characters held back until complete)."""
        decoder = self.decoder()
        for tok in ids:
            piece = decoder.push(tok)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def round_trips(self, ids: Iterable[int]) -> bool:
        """Whether the text of ``ids`` encodes back to them (a reply a client can send back as it came)."""
        ids = list(ids)
        return self._encode_plain(self.decode(ids)) == ids

    def _encode_plain(self, text: str) -> list[int]:
        return self.encode(text)

    def decoder(self) -> _ByteDecoder:
        """A push-style ``stream``: ``d.push(id)`` returns the text the id completes (maybe ""),
        ``d.flush()`` what is left at the end."""
        return _ByteDecoder()

    def apply_chat_template(self, prompt: str | list[dict]) -> str:
        raise ValueError("--chat needs a model with a chat template; this artifact has none")


class HFTokenizer(ByteTokenizer):
    """A Hugging Face ``tokenizers`` tokenizer with the special ids and chat template of the manifest."""

    kind = "huggingface"

    def __init__(self, path: str | Path, info: dict, chat_template: str | None = None):
        self.tok = load_hf_tokenizer(path)
        self.eos_token_ids = tuple(int(i) for i in info.get("eos_token_ids") or ())
        self.bos_token_id = info.get("bos_token_id")
        self.chat_template = chat_template

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self.tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decoder(self) -> _GrowingDecoder:
        """A push-style decoder (as ``ByteTokenizer.decoder``) that decodes a short window of the ids per
        token; a trailing U+FFFD (an incomplete byte sequence of a byte-level BPE) waits for the next token."""
        return _GrowingDecoder(self.decode)

    def token_text(self, tid) -> str:
        return "" if tid is None else (self.tok.id_to_token(int(tid)) or "")

    def apply_chat_template(self, prompt: str | list[dict]) -> str:
        """One user message (or a list of ``{"role", "content"}`` messages) formatted by the model's chat
        template, ready for the assistant's reply (rendered in a sandboxed child process with bounded time and
        output: edgeattn.artifact.chat_template)."""
        if not self.chat_template:
            return super().apply_chat_template(prompt)
        from edgeattn.artifact.chat_template import render_chat_template

        return render_chat_template(
            self.chat_template,
            messages=prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            bos_token=self.token_text(self.bos_token_id),
            eos_token=self.token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )


class _ByteDecoder:
    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tok: int) -> str:
        return self._utf8.decode(bytes([tok]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _GrowingDecoder:
    """Text-generation-inference's incremental detokenization: decode only a window of the ids, from
    ``prefix`` (the start of the last piece handed out, kept for context: decoders that strip a leading space
    or join byte tokens need it) to the end, and hand out what follows the text of ``prefix:read`` once
    it does not end in U+FFFD (an incomplete byte sequence). Each push decodes a few tokens, not the reply."""

    def __init__(self, decode):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read] is the last piece handed out

    def push(self, tok: int) -> str:
        self._ids.append(int(tok))
        return self._next(final=False)

    def flush(self) -> str:
        return self._next(final=True)

    def _next(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]


def load_tokenizer(manifest) -> ByteTokenizer:
    """The tokenizer of a loaded ``Manifest``."""
    info = manifest.data.get("tokenizer")
    if not info or info.get("type", "byte") == "byte":
        return ByteTokenizer()
    if info.get("type") != "huggingface":
        raise ValueError(f"{manifest.root}: unknown tokenizer type {info.get('type')!r}")
    template = None
    if info.get("chat_template"):
        template = (manifest.root / info["chat_template"]).read_text()
    return HFTokenizer(manifest.root / info.get("path", TOKENIZER_JSON), info, template)


def checkpoint_tokenizer(checkpoint: str | Path, cfg) -> ByteTokenizer:
    """The tokenizer of an edgeattn checkpoint: the tokenizer.json an import copied into it, with the special
    ids recorded at import (``cfg.extra["tokenizer"]``), or byte-level without one. A model whose vocabulary
    is not bytes and that has no tokenizer.json is refused (its ids cannot be encoded)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / TOKENIZER_JSON).is_file():
        if cfg.vocab_size > 256:
            raise ValueError(
                f"{checkpoint} has no {TOKENIZER_JSON} and a vocabulary of {cfg.vocab_size} tokens, not bytes: "
                f"copy the model's {TOKENIZER_JSON} into it (edgeattn import does)"
            )
        return ByteTokenizer()
    info = tokenizer_info(checkpoint)
    info.update(cfg.extra.get("tokenizer", {}))  # special ids recorded at import (from the model's configs)
    check_vocabulary(info["vocab_size"], cfg.vocab_size)
    return HFTokenizer(checkpoint / TOKENIZER_JSON, info, info["chat_template"])


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _default_template(value) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or (as transformers also accepts) a list of named
    templates ``[{"name": "default", "template": ...}, ...]``, of which chat uses the ``default`` one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if (
                isinstance(entry, dict)
                and entry.get("name") == "default"
                and isinstance(entry.get("template"), str)
            ):
                return entry["template"]
    return None


def tokenizer_info(src: str | Path, config: dict | None = None) -> dict | None:
    """The manifest's tokenizer entry for a model directory with tokenizer files (None without
    tokenizer.json): special ids from generation_config.json, config.json or tokenizer_config.json's
    token strings; the chat template from chat_template.jinja or tokenizer_config.json."""
    src = Path(src)
    if not (src / TOKENIZER_JSON).is_file():
        return None
    tok = load_hf_tokenizer(src / TOKENIZER_JSON)

    def read(name):
        p = src / name
        try:
            return json.loads(p.read_text()) if p.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from e

    gen, tcfg, config = read(GENERATION_CONFIG), read(TOKENIZER_CONFIG), config or {}
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def special(key):
        for d in (gen, config, text_cfg):
            if d.get(f"{key}_token_id") is not None:
                return _ids(d[f"{key}_token_id"])
        tokstr = tcfg.get(f"{key}_token")
        if isinstance(tokstr, dict):
            tokstr = tokstr.get("content")
        tid = tok.token_to_id(tokstr) if isinstance(tokstr, str) else None
        return [] if tid is None else [tid]

    template = None
    if (src / CHAT_TEMPLATE).is_file():
        template = (src / CHAT_TEMPLATE).read_text()
    else:
        template = _default_template(tcfg.get("chat_template"))
    bos, pad = special("bos"), special("pad")
    return {
        "type": "huggingface",
        "path": TOKENIZER_JSON,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token_ids": special("eos"),
        "bos_token_id": bos[0] if bos else None,
        "pad_token_id": pad[0] if pad else None,
        "chat_template": template,
    }
