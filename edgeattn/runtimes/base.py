"""One Session API over every backend (Polygraphy-style): the backends only run graphs and hold state.

sess = open_session(artifact_dir, backend="onnxruntime")
logits = sess.prefill(ids)     # [B, T] -> [B, vocab], logits of the last token
logits = sess.step(ids)        # [B, 1] -> [B, vocab]
logits = sess.run_graph("prefill", ids)   # one graph call, logits of every position [B, T, vocab]
sess.reset(); state = sess.get_state(); sess.set_state(state)
sess.save_state(path); sess.load_state(path)
text = sess.generate(prompt, max_new_tokens=..., temperature=..., top_k=..., top_p=..., seed=...)

Many independent streams stepped together in one batch-N graph call (an artifact exported with
``--dynamic-batch``), each with its own prompt or saved state and its own sampling: ``Streams`` in
``edgeattn.runtimes.streams``; a Session holds one batch of the artifact's fixed ``batch_size``.

Threads: a session may be shared. Each public call (step, prefill, run_graph, reset, get_state, set_state,
save_state, load_state, generate) holds the session's lock, ``sess.lock`` (a re-entrant lock), for its whole
duration, so calls from several threads run one after another, each on a consistent state. The state is
still shared: to run a sequence of calls (reset, prefill, steps) without another thread's calls in between,
hold ``with sess.lock:`` around it. ``generate_ids`` and ``generate_text`` are iterators and take the lock
per token.
"""

from __future__ import annotations

import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np

from edgeattn.artifact.manifest import Manifest
from edgeattn.runtimes.decode import Decoder


def kv_zeros(shape, dtype=np.float32) -> np.ndarray:
    """Zeros for a KV buffer, whose rows are written (and read) at their first slots only: an anonymous
    private mapping of 4 KiB pages that the OS commits one by one as they are written. ``np.zeros`` asks the
    kernel for 2 MiB huge pages from 4 MiB on (numpy's ``madvise(MADV_HUGEPAGE)``; transparent huge pages
    set to "madvise", as is common), so a row's first slots commit and zero 2 MiB per head, most of a
    4608-slot buffer, and the kernel may compact memory to find them: 0.1-1.5 s of system time per batch-16
    prefill of the Qwen3.5 layout (16 prompts of 32 tokens, 2 threads)."""
    import mmap

    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux: also where transparent huge pages are "always"
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)  # the array holds the mapping; unmapped when freed


def kv_to_float(e, a: np.ndarray) -> np.ndarray:
    """A KV buffer's values ``a`` (of entry ``e``, in its dtype) as float32: an int8 buffer's times its
    scales [Hkv, D] (``e.scale``), as ONNX Runtime's quantized cache reads them."""
    if e.scale is None:
        return a.astype(np.float32)
    return a.astype(np.float32) * np.asarray(e.scale, np.float32)[None, :, None, :]


def kv_from_float(e, a: np.ndarray) -> np.ndarray:
    """Float32 values ``a`` as entry ``e``'s KV buffer holds them: an int8 buffer's round(a / scale) within
    [-128, 127], as ONNX Runtime's quantized cache writes them (values past a scale's range clip)."""
    if e.scale is None:
        return np.asarray(a, e.dtype)
    q = np.rint(a / np.asarray(e.scale, np.float32)[None, :, None, :])
    return np.clip(q, -128, 127).astype(np.int8)


def _locked(method):
    """Run ``method`` holding the session's lock (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class Session(ABC):
    """An artifact's graphs and their state behind one API; safe to share between threads (every public
    call holds ``self.lock``; hold it yourself around a sequence of calls that must not be interleaved)."""

    backend: str = ""
    # how speculative decoding rolls a partly rejected round back: "auto", "readvance" or "states"
    # (``edgeattn.runtimes.speculative.generate``)
    speculative_rollback: str = "auto"

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.position = 0  # tokens consumed since the last reset
        self.lock = threading.RLock()
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The artifact's tokenizer (manifest "tokenizer"; byte-level without one)."""
        if self._tokenizer is None:
            from edgeattn.artifact.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.manifest)
        return self._tokenizer

    # ---- what a backend implements ----

    @abstractmethod
    def _run(self, graph: str, ids: np.ndarray) -> np.ndarray:
        """Run graph "step" or "prefill" on ids [B, T], advancing the state; return logits [B, T, V]."""

    @abstractmethod
    def _get_state(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def _set_state(self, state: dict[str, np.ndarray]) -> None: ...

    @abstractmethod
    def _reset_state(self) -> None: ...

    # ---- the API ----

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.dtype.kind not in "iu":  # integer (a cheap test: it runs every token)
            raise ValueError(
                f"token ids must be an integer array of shape [B, T], got {ids.dtype} {ids.shape}"
            )
        B = self.manifest.batch_size
        if ids.shape[0] != B:
            raise ValueError(f"this artifact was exported for batch {B}, got ids of batch {ids.shape[0]}")
        lo, hi = (int(ids[0, 0]),) * 2 if ids.size == 1 else (ids.min(), ids.max()) if ids.size else (0, 0)
        if lo < 0 or hi >= self.manifest.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, {self.manifest.vocab_size}), got values in [{lo}, {hi}]"
            )
        limit = self.manifest.max_length
        if limit is not None and self.position + ids.shape[1] > limit:
            raise ValueError(
                f"{self.position + ids.shape[1]} tokens exceed this artifact's maximum of {limit} (the KV cache "
                "of its softmax layers); export again with a larger --max-length, or use a linear-attention model"
            )
        return ids.astype(np.int64, copy=False)

    @_locked
    def run_graph(self, graph: str, ids, *, every: bool = False) -> np.ndarray:
        """Run one graph ("step": [B, 1], "prefill": [B, C]) and return its logits, [B, T, V]: every position's,
        or the last one's ([B, 1, V]) from an artifact exported with ``prefill_logits`` "last" unless ``every``
        (through its ``logits_count`` input)."""
        if graph not in ("step", "prefill"):
            raise ValueError(f"graph must be 'step' or 'prefill', got {graph!r}")
        ids = self._check_ids(ids)
        tokens = 1 if graph == "step" else self.manifest.prefill_tokens
        if ids.shape[1] != tokens:
            raise ValueError(f"the {graph} graph takes ids of shape [B, {tokens}], got {list(ids.shape)}")
        if every and graph == "prefill" and self.manifest.prefill_logits == "last":
            return self._advance_every(ids)
        return self._advance(graph, ids)

    def _advance_every(self, ids: np.ndarray) -> np.ndarray:
        """A prefill call that returns every position's logits (backends that compute them anyway)."""
        return self._advance("prefill", ids)

    def _advance(self, graph: str, ids: np.ndarray) -> np.ndarray:
        """Run a graph on checked ids and count the tokens."""
        logits = self._run(graph, ids)
        self.position += ids.shape[1]
        return logits

    @_locked
    def prefill(self, ids, *, chunk: int | None = None) -> np.ndarray:
        """Consume ids [B, T]: full chunks through the prefill graph, the rest one step at a time. ``chunk``:
        tokens per prefill call, the graph's own here (``OnnxRuntimeSession`` takes any with one graph for
        any number of tokens)."""
        self._check_chunk(chunk, any_tokens=False)
        ids = self._check_ids(ids)
        C = self.manifest.prefill_tokens
        T = ids.shape[1]
        if T == 0:
            raise ValueError("prefill needs at least one token")
        logits = None
        n_full = T // C
        for c in range(n_full):
            logits = self._advance("prefill", ids[:, c * C : (c + 1) * C])
        for t in range(n_full * C, T):
            logits = self._advance("step", ids[:, t : t + 1])
        return logits[:, -1]

    def _check_chunk(self, chunk, any_tokens: bool) -> None:
        """ValueError unless ``chunk`` is None or a positive integer this session's prefill graph takes."""
        if chunk is None:
            return
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        n = self.manifest.prefill_tokens
        if not any_tokens and chunk != n:
            raise ValueError(
                f"{self.manifest.root}: its prefill graph takes exactly {n} tokens a call, not {chunk}; "
                "export with --prefill-chunk to change it"
            )

    @_locked
    def step(self, ids) -> np.ndarray:
        ids = self._check_ids(ids)
        if ids.shape[1] != 1:
            raise ValueError(f"step takes one token per sequence, ids of shape [B, 1]; got {ids.shape}")
        return self._advance("step", ids)[:, -1]

    @_locked
    def reset(self) -> None:
        self._reset_state()
        self.position = 0

    @_locked
    def get_state(self) -> dict[str, np.ndarray]:
        """Copies of the state tensors, keyed by their graph input names."""
        return self._get_state()

    @_locked
    def set_state(self, state: dict[str, np.ndarray], position: int | None = None) -> None:
        expected = {e.input: e for e in self.manifest.state}
        if set(state) != set(expected):
            raise ValueError(f"state must hold exactly {sorted(expected)}; got {sorted(state)}")
        for name, e in expected.items():
            arr = np.asarray(state[name])
            ok = arr.ndim == len(e.shape) and all(
                isinstance(d, str) or d == s for d, s in zip(e.shape, arr.shape)
            )
            if not ok:
                raise ValueError(f"state {name!r} must have shape {list(e.shape)}, got {list(arr.shape)}")
            if not np.isfinite(arr).all():  # the model would compute NaN logits from it
                raise ValueError(f"state {name!r} holds NaN or infinity")
        self._set_state({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()})
        if position is not None:
            self.position = int(position)

    @_locked
    def save_state(self, path: str | os.PathLike) -> None:
        from edgeattn.artifact.state_file import save_state

        save_state(path, self.get_state(), fingerprint=self.manifest.fingerprint, position=self.position)

    @_locked
    def load_state(self, path: str | os.PathLike) -> None:
        from edgeattn.artifact.state_file import load_state

        tensors, meta = load_state(path)
        if meta.get("fingerprint") != self.manifest.fingerprint:
            raise ValueError(
                f"{path} is a state of another model (its fingerprint differs from this artifact's)"
            )
        self.set_state(tensors, position=int(meta.get("position", 0)))

    def generate_ids(
        self,
        prompt_ids,
        max_new_tokens: int = 128,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_ids=None,
        repetition_penalty: float = 1.0,
        repetition_window: int = 0,
        logit_bias=None,
        speculative=None,
    ) -> Iterator[int]:
        """Yield new token ids one at a time (batch 1), continuing from the current state. Generation
        stops before a token of ``stop_ids`` (default: the tokenizer's end-of-sequence ids), which is
        consumed into the state but not yielded. ``temperature <= 0`` is greedy; see
        ``edgeattn.runtimes.sampling.sample_next``. ``repetition_penalty`` applies to the tokens of this
        call (prompt and generated), the last ``repetition_window`` of them (0: all, as transformers).
        ``logit_bias``: OpenAI's ``{token id: bias in [-100, 100]}``, added to the logits before sampling.

        ``speculative``: "ngram" (prompt lookup), a draft artifact's directory or Session (the same tokenizer),
        or a drafter object: the same tokens (greedy; sampled: the same distribution) from fewer graph calls,
        on a one-graph ONNX Runtime artifact (``edgeattn.runtimes.speculative``); its figures land in
        ``self.speculative_stats``. ``self.speculative_rollback`` ("auto", "readvance" or "states") picks how a
        partly rejected round rolls back (``speculative.generate``)."""
        if self.manifest.batch_size != 1:
            raise ValueError("generate needs an artifact exported with --batch 1")
        dec = Decoder(  # checks the sampling arguments before any work
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_ids=self.tokenizer.eos_token_ids if stop_ids is None else stop_ids,
            max_new_tokens=max_new_tokens,
            repetition_penalty=repetition_penalty,
            repetition_window=repetition_window,
            logit_bias=logit_bias,
            vocab_size=self.manifest.vocab_size,
        )
        ids = np.asarray(list(prompt_ids), dtype=np.int64)[None]
        limit = self.manifest.max_length
        if limit is not None and self.position + ids.shape[1] + max_new_tokens > limit:
            held = f"{self.position} tokens in the state + " if self.position else ""
            raise ValueError(
                f"{held}{ids.shape[1]} prompt tokens + {max_new_tokens} new tokens exceed this artifact's "
                f"maximum of {limit} (the KV cache of its softmax layers); generate at most "
                f"{max(limit - self.position - ids.shape[1], 0)}, or export again with a larger --max-length"
            )
        if not ids.shape[1]:
            raise ValueError("the prompt is empty")
        if speculative is not None:
            from edgeattn.runtimes import speculative as spec

            drafter = spec.make_drafter(self, speculative, seed=seed)
            dec.context = [int(t) for t in ids[0]]
            self.speculative_stats = spec.SpeculativeStats()
            yield from spec.generate(
                self, dec, ids, drafter, self.speculative_stats, self.speculative_rollback
            )
            return
        logits = self.prefill(ids)
        dec.context = [int(t) for t in ids[0]]  # the tokens the repetition penalty looks at
        while (nxt := dec.next(logits[0])) is not None:
            yield nxt
            logits = self.step(np.array([[nxt]], dtype=np.int64))  # the lock is taken per step
        if dec.last in dec.stop_ids:  # a stop token: consumed into the state, not yielded
            self.step(np.array([[dec.last]], dtype=np.int64))

    @_locked
    def generate(self, prompt: str | bytes, max_new_tokens: int = 128, **kwargs) -> str:
        """Text generation through the artifact's tokenizer (byte-level: the prompt's UTF-8 bytes are
        the token ids); stops at the end-of-sequence token."""
        return "".join(self.generate_text(prompt, max_new_tokens, **kwargs))

    def generate_text(self, prompt: str | bytes, max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """Like ``generate`` but yields text pieces as they complete (incomplete characters held back)."""
        tok = self.tokenizer
        yield from tok.stream(self.generate_ids(tok.encode(prompt), max_new_tokens, **kwargs))
