"""One token of the (gated) delta rule: the function the exported step graph is made of.

Pure tensor code: no in-place updates, no branches on tensor values (only on shapes), no float64;
expand + reshape rather than repeat_interleave, so the graph holds only standard opset-17 ops.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor


def expand_heads(x: Tensor, HV: int) -> Tensor:
    """[B, ..., H, K] -> [B, ..., HV, K]: key head h serves value heads h*HV/H .. (h+1)*HV/H - 1
    (``repeat_interleave`` on the head axis, written with expand + reshape)."""
    *lead, H, K = x.shape
    if H == HV:
        return x
    return x.unsqueeze(-2).expand(*lead, H, HV // H, K).reshape(*lead, HV, K)


def delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor | None,
    state: Tensor,
    *,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """q, k: [B, H, K], v: [B, HV, V], beta: [B, HV], g: None, [B, HV] or [B, HV, K] (log-gate),
    state: [B, HV, K, V] float32.

    Returns (o [B, HV, V], new state [B, HV, K, V]) in the state's dtype; ``state`` is not modified."""
    dt = torch.promote_types(state.dtype, torch.float32)
    HV = v.shape[1]
    q, k = expand_heads(q.to(dt), HV), expand_heads(k.to(dt), HV)  # [B, HV, K]
    if g is not None:
        a = torch.exp(g.to(dt))
        a = a.unsqueeze(-1).unsqueeze(-1) if a.dim() == 2 else a.unsqueeze(-1)  # [B, HV, 1 or K, 1]
        state = a * state
    old = torch.einsum("bhk,bhkv->bhv", k, state)  # what the state recalls for k_t
    delta = beta.to(dt).unsqueeze(-1) * (v.to(dt) - old)  # [B, HV, V]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return scale * torch.einsum("bhk,bhkv->bhv", q, state), state
