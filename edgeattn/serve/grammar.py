"""Structured outputs for `edgeattn serve`: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and
required tool calls, compiled to llguidance grammars and enforced on every sampled token.

    grammars = Grammars(tokenizer, vocab_size)     # one per engine: llguidance's view of the tokenizer
    grammar = grammars.response_format(body.response_format)    # GrammarError (400, names the field) if bad
    c = grammars.constraint(grammar, "response_format")         # one per request: a matcher at its start
    logits = c.process(logits); c.accept(token, raw_logits)     # a Decoder's processor (runtimes.decode)
    c.stopped, c.failed                                         # the grammar is complete / broke

Why llguidance (benchmarks/grammar_mask.py measures it beside xgrammar and outlines-core at 49,152 and
248,320 tokens in a batch of 16 streams): its masks cost tens of microseconds per token, a schema compiles
in about a millisecond (outlines-core builds an index over the whole vocabulary per schema, seconds), and it
needs only numpy (xgrammar imports torch, which the serve install does not have).

With ``"strict": true`` an object schema without ``additionalProperties`` allows no other properties, as
OpenAI's strict mode (which requires ``"additionalProperties": false``); without it the schema's own meaning
holds (JSON Schema allows any other property). JSON is generated with ``", "`` and ``": "`` between items and no other whitespace: what models trained on
``json.dumps`` output write, and a small model cannot wander off into endless newlines inside an object.
Masked tokens get ``MASKED`` (finite: the sampler refuses non-finite logits); once the grammar is complete
(``stopped``) only the end-of-sequence tokens stay open, and the engine ends the request there (a byte-level
model has no such token: llguidance gets an extra one past the vocabulary, never sampled).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

MASKED = -1e30  # the logit of a token the grammar forbids
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 100_000  # a schema (or all tools' schemas) larger than this is refused
CACHE_GRAMMARS = 64  # compiled matchers kept (a client sends the same schema again and again)


class GrammarError(ValueError):
    """A schema or grammar that cannot be enforced: HTTP 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _llg():
    from edgeattn._deps import require

    return require("llguidance")


class _ByteVocab:
    """llguidance's tokenizer interface over byte-level ids (0..255) plus one end token (id 256)."""

    bos_token_id = None

    def __init__(self):
        self.eos_token_id = 256
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff[EOS]"]
        self.special_token_ids = [256]

    def __call__(self, s) -> list[int]:
        return list(s.encode("utf-8") if isinstance(s, str) else s)


class Grammars:
    """Grammar compilation for one artifact's tokenizer (thread-safe; the llguidance tokenizer is built on
    first use, ~0.1-1 s for a real vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._lltok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()

    @property
    def lltok(self):
        with self._lock:
            if self._lltok is None:
                llg = _llg()
                if getattr(self.tokenizer, "kind", "byte") == "huggingface":
                    eos = list(self.tokenizer.eos_token_ids) or None
                    self._lltok = llg.LLTokenizer(
                        self.tokenizer.tok.to_str(), n_vocab=self.vocab_size, eos_token=eos
                    )
                else:
                    self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab()), n_vocab=257)
            return self._lltok

    def warm(self) -> None:
        """Build the llguidance tokenizer now (where llguidance is installed)."""
        try:
            _ = self.lltok
        except ImportError:
            pass

    def token_bytes(self, tok: int) -> bytes:
        """The bytes of one token (a special token's text)."""
        if getattr(self.tokenizer, "kind", "byte") != "huggingface":
            return bytes([int(tok)]) if 0 <= int(tok) < 256 else b""
        return self.lltok.decode_bytes([int(tok)])

    # ---- grammars from requests ----

    def json_schema(self, schema, param: str) -> str:
        """The grammar of JSON documents valid under ``schema`` (a dict or True)."""
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(
                f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param
            )
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"{param} is {len(text)} characters; at most {MAX_SCHEMA_CHARS}", param)
        try:
            return _llg().LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{param}: {_line(e)}", param) from None

    def response_format(self, fmt) -> str | None:
        """The grammar of OpenAI's ``response_format`` (None: plain text)."""
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            got = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise GrammarError(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {got!r}",
                "response_format",
            )
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return self.json_schema({"type": "object"}, "response_format")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise GrammarError(
                "response_format.json_schema must be an object with a 'name' and a 'schema'",
                "response_format.json_schema",
            )
        if "schema" not in spec:
            raise GrammarError("response_format.json_schema.schema is missing", "response_format.json_schema")
        schema = spec["schema"]
        if spec.get("strict") is True:
            schema = strict_schema(schema)
        return self.json_schema(schema, "response_format.json_schema.schema")

    # ---- matchers ----

    def constraint(self, grammar: str, param: str) -> Constraint:
        """A matcher of ``grammar`` at its start (compiled once per grammar, then copied)."""
        llg = _llg()
        with self._lock:
            proto = self._cache.get(grammar)
            if proto is not None:
                self._cache.move_to_end(grammar)
        if proto is None:
            lltok = self.lltok
            error = llg.LLMatcher.validate_grammar(grammar, lltok)
            if error:
                raise GrammarError(f"{param}: the grammar engine refuses it: {_line(error)}", param)
            proto = llg.LLMatcher(lltok, grammar, log_level=0)
            if proto.is_error():
                raise GrammarError(
                    f"{param}: the grammar engine refuses it: {_line(proto.get_error())}", param
                )
            with self._lock:
                self._cache[grammar] = proto
                while len(self._cache) > CACHE_GRAMMARS:
                    self._cache.popitem(last=False)
        return Constraint(proto.deep_copy(), self.vocab_size, self.lltok.vocab_size)


class Constraint:
    """One request's grammar state: a ``Decoder`` processor masking the logits and consuming each token."""

    def __init__(self, matcher, vocab_size: int, grammar_vocab: int):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = matcher
        self.vocab_size = vocab_size  # the model's logits; llguidance's vocabulary may hold one more (bytes)
        self._mask = allocate_token_bitmask(1, grammar_vocab)
        self.failed: str | None = None  # why the grammar broke (the request ends with an error)

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing but the end may follow (or it broke: ``failed``)."""
        return self.failed is not None or self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, ``[vocab]`` booleans."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._mask)
        return allowed_tokens(self._mask[0], self.vocab_size)

    def process(self, logits: np.ndarray) -> np.ndarray:
        if self.matcher.is_error():
            self.failed = self.failed or _line(self.matcher.get_error())
        ok = self.allowed() if self.failed is None else np.zeros(self.vocab_size, bool)
        if not ok.any():  # the grammar broke or ended where no token of the vocabulary fits: end the request
            self.failed = self.failed or "the grammar allows no token of the vocabulary here"
            ok = ok.copy()
            ok[int(np.argmax(logits))] = True  # sample something; the engine drops it
        return masked_logits(logits, ok)

    def accept(self, token: int, raw_logits) -> None:
        if self.failed is None and not self.matcher.consume_token(int(token)):
            self.failed = _line(self.matcher.get_error() or f"the grammar refused token {token}")


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """A row of llguidance's bitmask (int32 words, bit i of the row = token i) as ``[vocab_size]`` booleans
    (a view of the unpacked bits; the mask may hold more tokens than the model: a byte model's end token)."""
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=vocab_size).view(bool)


def masked_logits(logits, ok: np.ndarray) -> np.ndarray:
    """``logits`` with every token not ``ok`` set to ``MASKED`` (a new float32 array)."""
    out = np.full(ok.shape, MASKED, np.float32)
    np.copyto(out, np.asarray(logits, dtype=np.float32).reshape(-1), where=ok)
    return out


def strict_schema(schema):
    """OpenAI's strict mode: an object schema that says nothing of ``additionalProperties`` allows none (a
    copy; what the schema states is kept)."""
    if isinstance(schema, list):
        return [strict_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _line(e) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:500]


__all__ = ["Constraint", "GrammarError", "Grammars", "MASKED"]
