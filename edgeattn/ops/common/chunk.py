"""Chunkwise-parallel and fully parallel forms of the gated linear recurrence (training and prefill).

Within a chunk of C tokens the log-gates are summed, b_t = sum_{j<=t} g_j, and token i reaches token t
(i <= t) with weight exp(b_t - b_i) <= 1; across chunks a [K, V] state is carried. Every exponent is a
difference that is <= 0, so gates down to -1e4 per step underflow to 0 instead of overflowing. A gate of
-inf would make -inf - (-inf) = NaN: ``gated_linear_attention`` clamps gates at -1000 before calling these.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.utils import pad_time, tracing

torch = require("torch")


def _causal(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()


SUB = 8  # sub-block size of the key-wise intra-chunk scores


def _head_scores(q, k, b, causal):
    """Head-wise gate, b: [..., C, 1] -> A[t, i] = q_t . k_i exp(b_t - b_i) for i <= t: [..., C, C]."""
    d = (b - b.transpose(-1, -2)).to(q.dtype)
    return (q @ k.transpose(-1, -2)) * d.masked_fill(~causal, float("-inf")).exp()


def _keywise_scores(q, k, b, causal):
    """Key-wise gate, b: [..., C, K] -> A[t, i] = sum_k q_tk k_ik exp(b_tk - b_ik) for i <= t: [..., C, C].

    Secondary chunking (as in fla): the chunk is cut into P sub-blocks of c tokens. A block of rows p
    and an earlier block of columns meet through a reference r_p = b at the end of block p - 1, which
    lies between them: exp(b_t - r_p) <= 1 and exp(r_p - b_i) <= 1, so the pair is one stable matmul.
    Only the P diagonal c x c blocks need the explicit [c, c, K] decay tensor.
    """
    C, K = q.shape[-2:]
    c = SUB if C % SUB == 0 and C > SUB else C
    P = C // c
    lead = q.shape[:-2]
    dt = q.dtype
    qb, kb, bb = (x.reshape(*lead, P, c, K) for x in (q, k, b))
    d = (bb.unsqueeze(-2) - bb.unsqueeze(-3)).to(dt)  # [..., P, c(t), c(i), K]
    d = d.masked_fill(~causal[:c, :c].unsqueeze(-1), float("-inf")).exp()
    diag = (qb.unsqueeze(-2) * kb.unsqueeze(-3) * d).sum(-1)  # [..., P, c, c]
    eye = torch.eye(P, dtype=dt, device=q.device).view(P, 1, P, 1)
    A = (diag.unsqueeze(-2) * eye).reshape(*lead, P, c, C)  # diagonal blocks in place
    if P > 1:
        r = bb[..., :-1, -1:, :]  # [..., P-1, 1, K]: references for row blocks 1..P-1
        q_off = qb[..., 1:, :, :] * (bb[..., 1:, :, :] - r).to(dt).exp()  # [..., P-1, c, K]
        earlier = (
            torch.arange(C, device=q.device).view(1, C)
            < torch.arange(1, P, device=q.device).view(P - 1, 1) * c
        )
        e = (
            (r - b.unsqueeze(-3)).to(dt).masked_fill(~earlier.unsqueeze(-1), float("-inf")).exp()
        )  # [..., P-1, C, K]
        off = q_off @ (k.unsqueeze(-3) * e).transpose(-1, -2)  # [..., P-1, c, C]
        A = A + torch.cat([torch.zeros_like(off[..., :1, :, :]), off], dim=-3)
    return A.reshape(*lead, C, C)


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
        A = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
        q_in, k_out, chunk_decay = q, k, None
    else:
        # float64 sums in PyTorch; float32 in exported graphs (TensorRT has no float64).
        b = (
            split(pad_time(g, C)).to(torch.float32 if tracing() else torch.float64).cumsum(-2)
        )  # [B, H, N, C, G]
        A = (_head_scores if b.shape[-1] == 1 else _keywise_scores)(q, k, b, causal)
        q_in = q * b.to(q.dtype).exp()  # reads the state left by the previous chunk
        k_out = k * (b[..., -1:, :] - b).to(q.dtype).exp()  # decays to the end of its chunk
        chunk_decay = b[..., -1, :].to(q.dtype).exp().unsqueeze(-1)  # [B, H, N, G, 1]
    o = A @ v  # intra-chunk part, [B, H, N, C, V]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    # unbind, not x[:, :, n]: each slice's backward would allocate a full-size gradient (quadratic in T).
    q_n, k_n, v_n = q_in.unbind(2), k_out.unbind(2), v.unbind(2)
    decay_n = None if chunk_decay is None else chunk_decay.unbind(2)
    inter = []
    for n in range(N):
        inter.append(q_n[n] @ S)
        dS = k_n[n].transpose(-1, -2) @ v_n[n]  # [B, H, K, V]
        S = dS + (S if decay_n is None else decay_n[n] * S)
    o = o + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, S


def parallel_gated_recurrence(q, k, v, g, *, initial_state):
    """The whole sequence as one [T, T] decayed attention matrix. Quadratic in T: a reference for
    short sequences. Same arguments and results as ``chunk_gated_recurrence``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    causal = _causal(T, q.device)
    S0 = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    if g is None:
        A = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
        return (A @ v + q @ S0).transpose(1, 2), S0 + k.transpose(-1, -2) @ v
    # float64 cumulative sums keep b_t - b_i exact over long sequences; the exponentials are float32.
    b64 = g.transpose(1, 2).double().cumsum(-2)  # [B, H, T, G]
    A = (_head_scores if g.shape[-1] == 1 else _keywise_scores)(q, k, b64, causal)
    b = b64.to(q.dtype)
    o = A @ v + (q * b.exp()) @ S0
    last = b[..., -1:, :].exp().transpose(-1, -2)  # [B, H, G, 1]
    S = last * S0 + (k * (b64[..., -1:, :] - b64).to(q.dtype).exp()).transpose(-1, -2) @ v
    return o.transpose(1, 2), S
