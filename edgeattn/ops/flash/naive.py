"""Ground truth: mixed-chunk attention as an explicit per-token loop, straight from the formula.

Chunks are fixed groups of C tokens counted from the start of the sequence. For token t in chunk c:

    o_t = sum_{j in c, j <= t} relu(quad_scale * q_quad_t . k_quad_j + b_{t-j})^2 v_j
          + lin_scale * q_lin_t (S_0 + sum_{i in chunks < c} k_lin_i^T v_i)

A state at position p says the sequence so far ends p tokens into a chunk: the buffered tokens are
that chunk's first p, its chunk_state is their k_lin^T v sum (the sum of that chunk so far), and S_0
sums every chunk before it.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.flash.step import FlashState

torch = require("torch")
F = torch.nn.functional


def naive_mixed_chunk_attention(
    qq, kq, ql, kl, v, *, chunk_size, quad_scale, lin_scale, rel_bias, initial_state
):
    """q_*, k_*: [B, T, S], v: [B, T, E], rel_bias: [C], initial_state: FlashState, all one float dtype.
    Returns (o [B, T, E], final FlashState)."""
    B, T, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    outs, finals = [], []
    for b in range(B):  # each row may be at its own position
        S0, X0, kq_buf, v_buf, pos = (x[b] for x in initial_state)
        p = int(pos.item())
        # The stream from the start of the current chunk: its buffered tokens, then the new ones.
        # Buffered k_lin are known only through their sum X0; new token i is stream token p + i.
        kq_all = torch.cat([kq_buf[:p], kq[b]])
        v_all = torch.cat([v_buf[:p], v[b]])

        def kv_sum(lo, hi, b=b, p=p, X0=X0):
            """sum of k_lin^T v over stream tokens lo <= a < hi, for lo = 0 or lo >= p."""
            i, j = max(lo - p, 0), max(hi - p, 0)
            s = kl[b, i:j].T @ v[b, i:j]
            return s + X0 if lo == 0 else s

        o_b = []
        for t in range(T):
            a = p + t  # the token's place in the stream
            start = (a // C) * C  # first token of its chunk
            j = torch.arange(start, a + 1, device=qq.device)
            scores = quad_scale * (kq_all[j] @ qq[b, t]) + rel_bias[a - j]
            quad = F.relu(scores).square() @ v_all[j]
            lin = S0 + kv_sum(0, start) if start > 0 else S0  # every chunk before this one
            o_b.append(quad + lin_scale * (ql[b, t] @ lin))
        outs.append(torch.stack(o_b) if o_b else v.new_zeros(0, E))
        L = p + T
        start = (L // C) * C  # the unfinished chunk left at the end

        def buffer(x, start=start, L=L):
            return torch.cat([x[start:L], x.new_zeros(C - (L - start), x.shape[-1])])

        lin = S0 + kv_sum(0, start) if start > 0 else S0
        cur = kv_sum(start, L)
        finals.append((lin, cur, buffer(kq_all), buffer(v_all), pos.new_tensor(float(L - start))))
    o = torch.stack(outs)
    return o, FlashState(*(torch.stack(x) for x in zip(*finals)))
