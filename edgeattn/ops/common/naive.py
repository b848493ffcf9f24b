"""Ground truth: the gated linear recurrence as an explicit per-token loop, straight from the formula.

S_t = exp(g_t) * S_{t-1} + k_t^T v_t          o_t = scale * q_t S_t
z_t = exp(g_t) * z_{t-1} + k_t                o_t = (q_t S_t) / (q_t . z_t + eps)   (normalize=True)
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")


def naive_gated_recurrence(q, k, v, g, *, scale, normalize, eps, initial_state):
    """q, k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H, G] with G in {1, K} or None.

    ``initial_state`` is S [B, H, K, V], or (S, z [B, H, K]) when normalizing. Returns (o, state).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if normalize:
        S, z = initial_state if initial_state is not None else (None, None)
    else:
        S, z = initial_state, None
    S = q.new_zeros(B, H, K, V) if S is None else S.to(q.dtype)
    z = q.new_zeros(B, H, K) if z is None else z.to(q.dtype)
    outs = []
    for t in range(T):
        if g is not None:
            a = torch.exp(g[:, t])  # [B, H, G]: decays the whole head (G=1) or each key row (G=K)
            S = a[..., None] * S
            z = a * z
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + k[:, t]
        num = (q[:, t, :, :, None] * S).sum(-2)  # [B, H, V]
        if normalize:
            outs.append(num / ((q[:, t] * z).sum(-1, keepdim=True) + eps))
        else:
            outs.append(scale * num)
    o = torch.stack(outs, dim=1)
    return o, ((S, z) if normalize else S)
