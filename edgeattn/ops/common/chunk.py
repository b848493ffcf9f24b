"""Chunkwise-parallel and fully parallel forms of the gated linear recurrence (training and prefill).

Within a chunk of C tokens the log-gates are summed, b_t = sum_{j<=t} g_j, and token i reaches token t
(i <= t) with weight exp(b_t - b_i) <= 1; across chunks a [K, V] state is carried. Every exponent is a
difference that is <= 0, so gates down to -1e4 per step underflow to 0 instead of overflowing.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.utils import pad_time, tracing

torch = require("torch")


def _causal(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()


def _decay_matrix(b: torch.Tensor, causal: torch.Tensor, dtype) -> torch.Tensor:
    """b: [..., C, G] cumulative log-gates (float64) -> exp(b_t - b_i) masked to i <= t, in ``dtype``:
    [..., C, C] for G = 1, [..., C, C, K] for G = K. The differences are taken in float64, since
    b_t - b_i of two large cumulative sums loses the small exponents that matter in float32."""
    if b.shape[-1] == 1:
        d = (b - b.transpose(-1, -2)).to(dtype)  # [..., C, C]
        return d.masked_fill(~causal, float("-inf")).exp()
    d = (b.unsqueeze(-2) - b.unsqueeze(-3)).to(dtype)  # [..., C(t), C(i), K]
    return d.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()


def _scores(q, k, D):
    """Causal decayed scores A[t, i] = sum_k q_tk k_ik D[t, i(, k)]."""
    if D is None:
        return q @ k.transpose(-1, -2)
    if D.dim() == q.dim():  # head-wise gate: D is [..., C, C]
        return (q @ k.transpose(-1, -2)) * D
    return (q.unsqueeze(-2) * k.unsqueeze(-3) * D).sum(-1)  # key-wise gate: [..., C, C, K] -> [..., C, C]


def chunk_gated_recurrence(q, k, v, g, *, initial_state, chunk_size):
    """q, k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H, G] or None, all float32.
    initial_state: [B, H, K, V] or None. Returns (o [B, T, H, V] unscaled, final state [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    # Padded tokens have k = v = 0 and g = 0 (no decay): they change neither outputs nor the final state.
    q, k, v = (pad_time(x, C) for x in (q, k, v))
    N = q.shape[1] // C

    def split(x):  # [B, N*C, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v = split(q), split(k), split(v)
    causal = _causal(C, q.device)
    if g is None:
        A = _scores(q, k, None).masked_fill(~causal, 0.0)
        q_in, k_out, chunk_decay = q, k, None
    else:
        # float64 sums in PyTorch; float32 in exported graphs (TensorRT has no float64).
        b = split(pad_time(g, C)).to(torch.float32 if tracing() else torch.float64).cumsum(-2)  # [B, H, N, C, G]
        A = _scores(q, k, _decay_matrix(b, causal, q.dtype))
        q_in = q * b.to(q.dtype).exp()  # reads the state left by the previous chunk
        k_out = k * (b[..., -1:, :] - b).to(q.dtype).exp()  # decays to the end of its chunk
        chunk_decay = b[..., -1, :].to(q.dtype).exp().unsqueeze(-1)  # [B, H, N, G, 1]
    o = A @ v  # intra-chunk part, [B, H, N, C, V]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    inter = []
    for n in range(N):
        inter.append(q_in[:, :, n] @ S)
        dS = k_out[:, :, n].transpose(-1, -2) @ v[:, :, n]  # [B, H, K, V]
        S = dS + (S if chunk_decay is None else chunk_decay[:, :, n] * S)
    o = o + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, S


def parallel_gated_recurrence(q, k, v, g, *, initial_state):
    """The whole sequence as one [T, T] (or [T, T, K]) decayed attention matrix. Quadratic in T:
    a reference for short sequences. Same arguments and results as ``chunk_gated_recurrence``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    causal = _causal(T, q.device)
    S0 = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    if g is None:
        A = _scores(q, k, None).masked_fill(~causal, 0.0)
        o = A @ v + q @ S0
        S = S0 + k.transpose(-1, -2) @ v
        return o.transpose(1, 2), S
    # float64 cumulative sums keep b_t - b_i exact over long sequences; the exponentials are float32.
    b64 = g.transpose(1, 2).double().cumsum(-2)  # [B, H, T, G]
    if g.shape[-1] == 1:
        D = (b64 - b64.transpose(-1, -2)).float().masked_fill(~causal, float("-inf")).exp()
    else:
        D = (b64.unsqueeze(-2) - b64.unsqueeze(-3)).float()
        D = D.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
    b = b64.float()
    o = _scores(q, k, D) @ v + (q * b.exp()) @ S0
    last = b[..., -1:, :]  # [B, H, 1, G]
    S = last.exp().transpose(-1, -2) * S0 + (k * (b64[..., -1:, :] - b64).float().exp()).transpose(-1, -2) @ v
    return o.transpose(1, 2), S
