"""Next-token sampling on numpy logits: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

import numpy as np


def sample_next(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: np.random.Generator | None = None,
) -> int:
    """One token id from ``logits: [V]``. ``temperature <= 0`` is greedy; ``top_k = 0`` and ``top_p = 1``
    disable those filters."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError("temperature must be >= 0, top_k >= 0 and 0 < top_p <= 1")
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
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
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(p.size, p=p))
