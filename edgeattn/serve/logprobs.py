"""Log-probabilities for `edgeattn serve`: OpenAI's ``logprobs`` / ``top_logprobs`` (chat), ``logprobs: N``
(completions) and ``echo`` with ``logprobs`` (prompt scoring, as lm-evaluation-harness's local-completions
backend asks).

Every number is the log-softmax of the artifact's own logits for that position (float64), before any grammar
mask, temperature or top-k/top-p: what the model says, not what the sampler drew from. The generated tokens'
come from a ``Decoder`` processor (``Recorder``), the prompt's from ``prompt_logprobs``, which feeds the
prompt in calls that return every position's logits (a ``--prefill-logits last`` artifact through its
``logits_count`` input) or, where the artifact cannot, to the step graph one token at a time; the first
prompt token has none (null, as OpenAI).
"""

from __future__ import annotations

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions take up to 5 (OpenAI), we allow the same 20


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def entry(lp: np.ndarray, token: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, its logprob, the ``top`` most likely tokens with theirs, most likely first)."""
    best: list[tuple[int, float]] = []
    if top > 0:
        idx = np.argpartition(-lp, min(top, lp.size) - 1)[:top]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        best = [(int(i), float(lp[i])) for i in idx]
    return int(token), float(lp[int(token)]), best


class Recorder:
    """A ``Decoder`` processor that records each sampled token's logprob and the top ``top`` (it changes
    nothing)."""

    def __init__(self, top: int):
        self.top = int(top)
        self.entries: list[tuple[int, float, list]] = []

    def process(self, logits):
        return logits

    def accept(self, token: int, raw_logits) -> None:
        self.entries.append(entry(log_softmax(raw_logits), token, self.top))


def prompt_logprobs(session, ids: list[int], top: int) -> list:
    """An entry per prompt token, token i's logprob given tokens 0..i-1 (the first one's None), from a batch-1
    ``session`` (reset first and left reset): with one graph for any number of tokens, calls of the prefill
    length that return every position's logits (``OnnxRuntimeSession.forward``; a ``--prefill-logits last``
    artifact through its ``logits_count`` input), else the step graph a token at a time."""
    out: list = [(int(ids[0]), None, [])]
    chunked = getattr(session, "any_tokens", False) and session.speculative_refusal() is None
    with session.lock:
        session.reset()
        try:
            if chunked:
                x, C = np.array([ids[:-1]], np.int64), session.manifest.prefill_tokens
                for c in range(0, x.shape[1], C):
                    logits = session.forward(x[:, c : c + C])[0]
                    out += [entry(log_softmax(row), ids[c + j + 1], top) for j, row in enumerate(logits)]
            else:
                for i in range(len(ids) - 1):
                    logits = session.step(np.array([[ids[i]]], np.int64))[0]
                    out.append(entry(log_softmax(logits), ids[i + 1], top))
        finally:
            session.reset()
    return out


# ---- OpenAI's shapes ----


def _text(token_bytes, tok: int) -> tuple[str, list[int]]:
    b = token_bytes(tok)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_content(entries, token_bytes) -> list[dict]:
    """Chat's ``choices[i].logprobs.content``: per token ``{"token", "logprob", "bytes", "top_logprobs"}``."""
    out = []
    for tok, lp, best in entries:
        text, raw = _text(token_bytes, tok)
        tops = []
        for t, l in best:
            tt, tb = _text(token_bytes, t)
            tops.append({"token": tt, "logprob": l, "bytes": tb})
        out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
    return out


def completion_logprobs(entries, token_bytes, start_offset: int = 0) -> dict:
    """Completions' ``choices[i].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token, or None where an entry is None: the first prompt token), ``text_offset``."""
    tokens, lps, tops, offsets = [], [], [], []
    offset = start_offset
    for e in entries:
        tok, lp, best = e
        text, _ = _text(token_bytes, tok)
        tokens.append(text)
        lps.append(lp)
        tops.append(None if lp is None else {_text(token_bytes, t)[0]: l for t, l in best})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


__all__ = ["Recorder", "chat_content", "completion_logprobs", "log_softmax", "prompt_logprobs"]
