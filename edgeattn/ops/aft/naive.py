"""Ground truth: AFT as an explicit per-token loop, straight from the formula (quadratic in T).

    o_t = sigmoid(q_t) * sum_{i<=t} exp(k_i + w_{t,i}) v_i / sum_{i<=t} exp(k_i + w_{t,i})
    w_{t,i} = window_bias[t-i] if t-i < W else (t-i) * decay           (aft)
    w_{t,i} = w[t, i]                                                  (aft_full)

Tokens before the sequence come from the initial state: the buffered keys and values sit at positions
-W..-1 (the first W - position of them are empty slots), and the older part is one term with log weight
``max + (max_age + t + 1) * decay``, numerator ``numerator`` and denominator ``denominator`` (absent
when the denominator is 0). Every maximum is only a shift of the exponents: outputs do not depend on it.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")


def _log_bias(dist, decay, window_bias):
    """dist: [n] token distances t - i >= 0 -> w_{t,i}: [n, D]."""
    far = dist.to(decay.dtype)[:, None] * decay
    W = window_bias.shape[0]
    if W == 0:
        return far
    near = window_bias[dist.clamp(max=W - 1)]
    return torch.where((dist < W)[:, None], near, far)


def naive_aft(q, k, v, decay, window_bias, initial_state):
    """q, k, v: [B, T, D] with T >= 1, decay: [D], window_bias: [W, D] (W may be 0), initial_state: the
    7-tuple (numerator, denominator, max, max_age [B, D], key, value [B, W, D], position [B]).
    Returns (o, state 7-tuple)."""
    B, T, D = q.shape
    W = window_bias.shape[0]
    num0, den0, max0, age0, key0, value0, pos0 = initial_state
    keys = torch.cat([key0, k], dim=1)  # [B, W + T, D]: position of index j is j - W
    values = torch.cat([value0, v], dim=1)
    slot = torch.arange(W + T, device=q.device)
    valid = (slot[None, :] >= W - pos0[:, None]) | (slot[None, :] >= W)  # [B, W + T]
    has_old = den0 > 0
    ninf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)

    outs = []
    for t in range(T):
        n = W + t + 1
        dist = t + W - slot[:n]  # t - i
        L = (keys[:, :n] + _log_bias(dist, decay, window_bias)).masked_fill(~valid[:, :n, None], ninf)
        L_old = torch.where(has_old, max0 + (age0 + t + 1) * decay, ninf)  # [B, D]
        M = torch.maximum(L.amax(1), L_old)
        e, e_old = torch.exp(L - M[:, None]), torch.exp(L_old - M)
        num = (e * values[:, :n]).sum(1) + e_old * num0
        den = e.sum(1) + e_old * den0
        outs.append(torch.sigmoid(q[:, t]) * num / den)
    o = torch.stack(outs, dim=1)

    # Final state after token T-1: indices 0..T-1 are at distance >= W, and so is the initial old part.
    dist = (T + W - 1 - slot[:T]).to(q.dtype)[:, None].expand(T, D)
    a = (keys[:, :T] + dist * decay).masked_fill(~valid[:, :T, None], ninf)  # [B, T, D]
    top = a.argmax(1, keepdim=True)
    a_init = torch.where(has_old, max0 + (age0 + T) * decay, ninf)
    from_tokens = a.gather(1, top).squeeze(1) > a_init  # the heaviest old token is one of these
    mx = torch.where(from_tokens, keys[:, :T].gather(1, top).squeeze(1), max0)
    age = torch.where(from_tokens, dist.expand(B, T, D).gather(1, top).squeeze(1), age0 + T)
    m = mx + age * decay
    m = torch.where(torch.isfinite(torch.maximum(a.amax(1), a_init)), m, torch.zeros_like(m))  # empty
    e, e_old = torch.exp(a - m[:, None]), torch.exp(a_init - m)
    num = (e * values[:, :T]).sum(1) + e_old * num0
    den = e.sum(1) + e_old * den0
    zero = torch.zeros_like(mx)
    state = (
        num,
        den,
        torch.where(den > 0, mx, zero),
        torch.where(den > 0, age, zero),
        keys[:, T : T + W],
        values[:, T : T + W],
        (pos0 + T).clamp(max=W),
    )
    return o, state


def naive_aft_full(q, k, v, w):
    """q, k, v: [B, T, D], w: [T_max, T_max] with T <= T_max. Returns o: [B, T, D]."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        L = k[:, : t + 1] + w[t, : t + 1, None]  # [B, t + 1, D]
        e = torch.exp(L - L.amax(1, keepdim=True))
        outs.append(torch.sigmoid(q[:, t]) * (e * v[:, : t + 1]).sum(1) / e.sum(1))
    return torch.stack(outs, dim=1) if outs else q.new_zeros(q.shape)
