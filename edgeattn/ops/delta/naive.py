"""Ground truth: the (gated) delta rule as an explicit per-token loop, straight from the formula.

S_t = exp(g_t) * S_{t-1}                      (g_t a scalar per head, or one value per key row)
S_t = S_t + beta_t k_t^T (v_t - k_t S_t)      o_t = scale * q_t S_t
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")


def naive_delta_rule(q, k, v, beta, g, *, scale, initial_state):
    """q, k: [B, T, H, K], v: [B, T, HV, V], beta: [B, T, HV], g: [B, T, HV, G] with G in {1, K} or None,
    initial_state: [B, HV, K, V] or None. Key head h serves value heads h*HV/H .. (h+1)*HV/H - 1.

    Returns (o [B, T, HV, V], final state [B, HV, K, V]), in the inputs' dtype."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    q = q.repeat_interleave(HV // H, dim=2)  # [B, T, HV, K]
    k = k.repeat_interleave(HV // H, dim=2)
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(T):
        if g is not None:
            S = torch.exp(g[:, t])[..., None] * S  # [B, HV, G, 1]: the whole head (G=1) or each key row
        k_t = k[:, t]  # [B, HV, K]
        old = (k_t[..., None] * S).sum(-2)  # k_t S: the value the state holds for k_t, [B, HV, V]
        delta = beta[:, t, :, None] * (v[:, t] - old)  # [B, HV, V]
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append(scale * (q[:, t, :, :, None] * S).sum(-2))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
    return o, S
