"""One token of the gated linear recurrence: the function the exported step graph is made of.

Pure tensor code: no in-place updates, no branches on tensor values, shapes fixed by the inputs.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor


def gated_recurrence_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    state: Tensor,
    normalizer: Tensor | None = None,
    *,
    scale: float = 1.0,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """q, k: [B, H, K], v: [B, H, V], g: [B, H, G] (G in {1, K}) log-gate or None,
    state: [B, H, K, V] float32, normalizer: [B, H, K] float32 or None.

    Returns (o [B, H, V], new state, new normalizer). With a normalizer, o = (q S) / (q . z + eps)
    and ``scale`` is not applied.
    """
    dt = torch.promote_types(state.dtype, torch.float32)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    kv = k.unsqueeze(-1) * v.unsqueeze(-2)  # [B, H, K, V]
    if g is not None:
        a = torch.exp(g.to(dt))  # [B, H, G]
        state = a.unsqueeze(-1) * state + kv
    else:
        state = state + kv
    num = torch.einsum("bhk,bhkv->bhv", q, state)
    if normalizer is None:
        return scale * num, state, None
    normalizer = (a * normalizer + k) if g is not None else (normalizer + k)
    den = (q * normalizer).sum(-1, keepdim=True) + eps
    return num / den, state, normalizer
