"""Next-token sampling on numpy logits: repetition penalty, logit bias, then greedy or temperature, top-k, top-p
(nucleus), seeded."""

from __future__ import annotations

import math
import numbers
import re

import numpy as np


def check_sampling(temperature: float, top_k: int, top_p: float, repetition_penalty: float = 1.0) -> None:
    """ValueError naming the argument unless ``temperature`` is a number (NaN is not; any value <= 0 is
    greedy), ``top_k`` an integer >= 0, ``top_p`` in (0, 1] and ``repetition_penalty`` a finite number > 0."""
    if not isinstance(temperature, numbers.Real) or math.isnan(temperature):
        raise ValueError(f"temperature must be a number (<= 0 for greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:  # NaN fails the comparison too
        raise ValueError(f"top_p must lie in (0, 1] (1 keeps every token), got {top_p!r}")
    if (
        isinstance(repetition_penalty, bool)
        or not isinstance(repetition_penalty, numbers.Real)
        or not 0 < repetition_penalty < math.inf
    ):
        raise ValueError(f"repetition_penalty must be a number > 0 (1 is none), got {repetition_penalty!r}")


MAX_SEED = 2**63 - 1  # a seed is a non-negative 64-bit signed integer (OpenAI's ``seed`` is an int64)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound: each bias lies in [-100, 100]


def check_seed(seed) -> None:
    """ValueError unless ``seed`` is None or an integer in [0, 2**63 - 1] (numpy's generators refuse
    negative seeds)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


def logit_bias_arrays(logit_bias, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """OpenAI's ``logit_bias`` (``{token id: bias}``, the ids as integers or as the decimal strings JSON
    keys are) as ``(ids int64, biases float64)``, or None when empty. ValueError (one line, naming the id)
    unless every id is an integer in [0, vocab_size) and every bias a number in [-100, 100]."""
    if logit_bias is None:
        return None
    if isinstance(logit_bias, tuple):  # already converted
        return logit_bias
    if not hasattr(logit_bias, "items"):
        raise ValueError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
    ids, biases = [], []
    for key, bias in logit_bias.items():
        tid = int(key) if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,19}", key) else key
        if isinstance(tid, bool) or not isinstance(tid, numbers.Integral):
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"logit_bias token id {tid} must lie in {bound}")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, numbers.Real)
            or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT  # NaN fails the comparison too
        ):
            raise ValueError(f"logit_bias for token {tid} must be a number in [-100, 100], got {bias!r}")
        ids.append(int(tid))
        biases.append(float(bias))
    if not ids:
        return None
    return np.asarray(ids, np.int64), np.asarray(biases, np.float64)


def apply_logit_bias(logits: np.ndarray, logit_bias) -> np.ndarray:
    """OpenAI's ``logit_bias``: each listed token's logit plus its bias (before temperature and the
    filters; -100 all but bans a token, +100 all but forces it). A new array; ``logits`` is not changed.
    ``logit_bias``: a mapping or ``logit_bias_arrays``' pair; an id outside the logits is a ValueError."""
    pair = logit_bias_arrays(logit_bias, np.size(logits))
    out = np.array(logits, dtype=np.float64).reshape(-1)
    if pair is not None:
        ids, biases = pair
        if ids.size and (ids.min() < 0 or ids.max() >= out.size):
            raise ValueError(f"logit_bias token ids must lie in [0, {out.size})")
        np.add.at(out, ids, biases)
    return out


def apply_repetition_penalty(logits: np.ndarray, previous, penalty: float) -> np.ndarray:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` (and llama.cpp's repeat penalty): the logit of every
    token in ``previous`` is divided by ``penalty`` where positive and multiplied by it where negative, so
    ``penalty > 1`` makes a token that already occurred less likely. A new array; ``logits`` is not changed."""
    out = np.array(logits, dtype=np.float64).reshape(-1)
    ids = np.unique(np.asarray(list(previous), dtype=np.int64))
    if penalty != 1 and ids.size:
        seen = out[ids]
        out[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return out


def finite_logits(logits, what: str = "the model's logits") -> np.ndarray:
    """``logits`` as a float64 vector ``[V]``; ValueError unless every value is finite: NaN logits would
    sample token 0 (argmax) or fail inside the sampler, so a broken model (NaN weights, a NaN state) stops
    with one line instead of printing garbage."""
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    if not np.isfinite(logits).all():
        raise ValueError(
            f"{what} hold NaN or infinity: nothing is sampled from them (broken weights or state)"
        )
    return logits


def next_distribution(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    previous=(),
    logit_bias=None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(logits, p)``: the logits after the repetition penalty and the logit bias, and the probabilities ``[V]`` that
    ``sample_next`` draws from (temperature, top-k, top-p applied), or ``p = None`` where it takes the argmax
    (greedy). Speculative decoding's rejection rule reads ``p``."""
    check_sampling(temperature, top_k, top_p, repetition_penalty)
    logits = finite_logits(logits)
    if repetition_penalty != 1:
        logits = apply_repetition_penalty(logits, previous, repetition_penalty)
    if logit_bias is not None:
        logits = apply_logit_bias(logits, logit_bias)
    if temperature <= 0:
        return logits, None
    with np.errstate(over="ignore", invalid="ignore"):
        z = logits / temperature
    if np.isnan(z).any() or not np.isfinite(z.max()):  # overflow: the limit of temperature -> 0 is greedy
        return logits, None
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p  # always keeps the most likely token
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return logits, p


def sample_next(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: np.random.Generator | None = None,
    repetition_penalty: float = 1.0,
    previous=(),
    logit_bias=None,
) -> int:
    """One token id from ``logits: [V]``. ``temperature <= 0`` is greedy, and so is a temperature so small
    that ``logits / temperature`` overflows; ``top_k = 0`` and ``top_p = 1`` disable those filters.
    ``repetition_penalty`` (1: none) applies first to the tokens in ``previous`` (``apply_repetition_penalty``),
    as transformers applies its logits processors before temperature, top-k and top-p; then ``logit_bias``
    (``apply_logit_bias``: OpenAI's, added to the logits, greedy included). Non-finite logits are a
    ValueError (``finite_logits``)."""
    logits, p = next_distribution(
        logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        previous=previous,
        logit_bias=logit_bias,
    )
    if p is None:
        return int(np.argmax(logits))
    return draw(p, rng)


def draw(p: np.ndarray, rng: np.random.Generator | None = None) -> int:
    """One index drawn from the probabilities ``p`` with ``rng`` (a fresh generator when None)."""
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(p.size, p=p))
