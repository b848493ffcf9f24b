"""Chunkwise-parallel form of the (gated) delta rule (training and prefill): the WY / UT-transform
form of Yang et al. 2024 (DeltaNet), with the scalar gate of Gated DeltaNet and the per-key gate of
KDA. The derivation is in README.md.

Within a chunk of C tokens the log-gates are summed, b_t = sum_{j<=t} g_j, and every exponential is of
a difference b_t - b_i <= 0 (i <= t) or of b_t itself, so gates down to -1e4 per step underflow to 0
instead of overflowing: the same rules as ``edgeattn.ops.common.chunk``, whose score functions are reused.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.common.chunk import _causal, _head_scores, _keywise_scores
from edgeattn.ops.delta.step import expand_heads
from edgeattn.ops.utils import pad_time, tracing

torch = require("torch")


def substitution_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L: [..., C, C], by forward substitution, one row at a
    time (row i = e_i - L[i, :i] (I + L)^-1[:i]). Plain matmul and concat: differentiable and traceable."""
    C = L.shape[-1]
    eye = torch.eye(C, dtype=L.dtype, device=L.device)
    inv = eye[:1].expand(*L.shape[:-2], 1, C)  # [..., 1, C]
    for i in range(1, C):
        row = eye[i : i + 1] - L[..., i : i + 1, :i] @ inv  # [..., 1, C]
        inv = torch.cat([inv, row], dim=-2)  # [..., i + 1, C]
    return inv


def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L: ``solve_triangular`` in PyTorch (one fused op, about
    4x faster forward + backward at C = 64), ``substitution_inverse`` while tracing (ONNX has no
    triangular solve). tests/test_ops_delta.py compares the two."""
    if tracing():
        return substitution_inverse(L)
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    return torch.linalg.solve_triangular(
        L, eye, upper=False, unitriangular=True
    )  # reads only L's strict lower part


def chunk_delta_rule(q, k, v, beta, g, *, initial_state, chunk_size):
    """q, k: [B, T, H, K], v: [B, T, HV, V], beta: [B, T, HV], g: [B, T, HV, G] (G in {1, K}) or None,
    all float32 (or float64); initial_state: [B, HV, K, V] or None.

    Returns (o [B, T, HV, V] unscaled, final state [B, HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    C = chunk_size
    q, k = expand_heads(q, HV), expand_heads(k, HV)  # [B, T, HV, K]
    # Padded tokens have k = v = beta = 0 and g = 0: they change neither outputs nor the final state.
    q, k, v, beta = (pad_time(x, C) for x in (q, k, v, beta.unsqueeze(-1)))
    N = q.shape[1] // C

    def split(x):  # [B, N*C, HV, D] -> [B, HV, N, C, D]
        return x.reshape(B, N, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, beta = split(q), split(k), split(v), split(beta)
    causal = _causal(C, q.device)
    strict = causal.tril(-1)  # i < t
    if g is None:
        A_kk = (k @ k.transpose(-1, -2)).masked_fill(~strict, 0.0)  # [B, HV, N, C, C]
        A_qk = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
        k_in, q_in, k_out, chunk_decay = k, q, k, None
    else:
        # float64 sums in PyTorch; float32 in exported graphs (TensorRT has no float64).
        b = (
            split(pad_time(g, C)).to(torch.float32 if tracing() else torch.float64).cumsum(-2)
        )  # [B, HV, N, C, G]
        scores = _head_scores if b.shape[-1] == 1 else _keywise_scores
        A_kk = scores(k, k, b, causal).masked_fill(~strict, 0.0)  # k_t . k_i exp(b_t - b_i), i < t
        A_qk = scores(q, k, b, causal)  # q_t . k_i exp(b_t - b_i), i <= t
        decay_in = b.to(q.dtype).exp()  # exp(b_t): from the chunk's start to token t
        k_in, q_in = k * decay_in, q * decay_in
        k_out = k * (b[..., -1:, :] - b).to(q.dtype).exp()  # decays to the end of its chunk
        chunk_decay = b[..., -1, :].to(q.dtype).exp().unsqueeze(-1)  # [B, HV, N, G, 1]

    # The new values u_t = beta_t (v_t - k_t S_{t-1}) of the chunk solve (I + diag(beta) A_kk) U =
    # diag(beta) (V - K_in S0): U = u0 - w S0 with the UT transform T = (I + diag(beta) A_kk)^-1.
    T_inv = unit_lower_inverse(beta * A_kk)  # [B, HV, N, C, C]
    u0 = T_inv @ (beta * v)  # [B, HV, N, C, V]
    w = T_inv @ (beta * k_in)  # [B, HV, N, C, K]

    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state
    # unbind, not x[:, :, n]: each slice's backward would allocate a full-size gradient (quadratic in T).
    q_n, k_n, u0_n, w_n, A_n = q_in.unbind(2), k_out.unbind(2), u0.unbind(2), w.unbind(2), A_qk.unbind(2)
    decay_n = None if chunk_decay is None else chunk_decay.unbind(2)
    outs = []
    for n in range(N):
        u = u0_n[n] - w_n[n] @ S  # [B, HV, C, V]
        outs.append(q_n[n] @ S + A_n[n] @ u)
        dS = k_n[n].transpose(-1, -2) @ u  # [B, HV, K, V]
        S = dS + (S if decay_n is None else decay_n[n] * S)
    o = torch.stack(outs, dim=2)  # [B, HV, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, HV, V)[:, :T]
    return o, S
