"""Next-token sampling on numpy logits: repetition penalty, then greedy or temperature, top-k, top-p (nucleus),
seeded."""

from __future__ import annotations

import math
import numbers

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
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(logits, p)``: the logits after the repetition penalty, and the probabilities ``[V]`` that
    ``sample_next`` draws from (temperature, top-k, top-p applied), or ``p = None`` where it takes the argmax
    (greedy). Speculative decoding's rejection rule reads ``p``."""
    check_sampling(temperature, top_k, top_p, repetition_penalty)
    logits = finite_logits(logits)
    if repetition_penalty != 1:
        logits = apply_repetition_penalty(logits, previous, repetition_penalty)
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
) -> int:
    """One token id from ``logits: [V]``. ``temperature <= 0`` is greedy, and so is a temperature so small
    that ``logits / temperature`` overflows; ``top_k = 0`` and ``top_p = 1`` disable those filters.
    ``repetition_penalty`` (1: none) applies first to the tokens in ``previous`` (``apply_repetition_penalty``),
    as transformers applies its logits processors before temperature, top-k and top-p. Non-finite logits are
    a ValueError (``finite_logits``)."""
    logits, p = next_distribution(
        logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        previous=previous,
    )
    if p is None:
        return int(np.argmax(logits))
    return draw(p, rng)


def draw(p: np.ndarray, rng: np.random.Generator | None = None) -> int:
    """One index drawn from the probabilities ``p`` with ``rng`` (a fresh generator when None)."""
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(p.size, p=p))
