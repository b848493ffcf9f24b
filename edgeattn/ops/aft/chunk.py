"""Chunkwise-parallel and fully parallel forms of AFT (training and prefill).

AFT works channel by channel, so a chunk of C tokens is a [C, W + C] table of log weights per channel:
token c sees the W tokens before the chunk and the chunk itself, with w = window_bias[d] for a distance
d < W and d * decay beyond. Everything older is the old part (numerator, denominator, max, max_age),
carried from chunk to chunk by a loop over [B, D] tensors. Each weight is an exponent minus the maximum
of its row, so keys of +-80 and decays of -1e4 neither overflow nor turn into 0 / 0.
Cost: O(T (W + C) D) time and memory.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.aft.step import NEG, canonical, merge
from edgeattn.ops.utils import pad_time

torch = require("torch")


def _windows(x, W: int, C: int, N: int):
    """x: [B, W + N*C, ...] -> [B, N, W + C, ...], window n = indices n*C .. n*C + W + C - 1."""
    if torch.onnx.is_in_onnx_export():
        # A gather by a constant index: the exporter's Unfold needs the axis size, which it loses once
        # the batch is symbolic (export --dynamic-batch).
        idx = torch.tensor([n * C + j for n in range(N) for j in range(W + C)], device=x.device)
        return x.index_select(1, idx).unflatten(1, (N, W + C))  # [B, N, W + C, ...]
    # unfold, not a list of slices: each slice's backward would allocate a full-size gradient (quadratic in T).
    u = x.unfold(1, W + C, C)  # [B, N, ..., W + C]
    return u.permute(0, 1, u.dim() - 1, *range(2, u.dim() - 1))  # positive axes: ONNX Transpose needs them


def _log_bias(decay, window_bias, C: int):
    """[C, W + C, D] log biases of token c (in a chunk) and window index j at distance c + W - j,
    NEG where j is later than c, and the [C, W + C] causal mask."""
    W = window_bias.shape[0]
    far = torch.arange(W, W + C, dtype=decay.dtype, device=decay.device).unsqueeze(1) * decay  # [C, D]
    table = torch.cat([window_bias, far]) if W else far  # [W + C, D], by distance
    # Constants built in Python, so that exported graphs hold them as they are.
    dist = [[c + W - j for j in range(W + C)] for c in range(C)]
    causal = torch.tensor([[d >= 0 for d in row] for row in dist], device=decay.device)  # [C, W + C]
    idx = torch.tensor([[max(d, 0) for d in row] for row in dist], device=decay.device)
    return torch.where(causal.unsqueeze(-1), table[idx], NEG), causal


def chunk_aft(q, k, v, decay, window_bias, state, *, chunk_size):
    """q, k, v: [B, T, D] with T >= 1, decay: [D], window_bias: [W, D] (W may be 0), state: the 4-tuple
    (numerator, denominator, max, max_age) for W = 0, else the 7-tuple adding (key, value, position), all
    in q's dtype. Returns (o [B, T, D], final state of the same layout)."""
    B, T, D = q.shape
    W, C = window_bias.shape[0], chunk_size
    # Padded tokens (k = v = 0) come after every real token: no real output sees them, and the final
    # state below is taken at token T - 1.
    q, k, v = (pad_time(x, C) for x in (q, k, v))
    N = q.shape[1] // C
    lens = [C] * (N - 1) + [T - (N - 1) * C]
    if W:
        key0, value0, pos0 = state[4:]
        keys, values = torch.cat([key0, k], 1), torch.cat([value0, v], 1)  # [B, W + N*C, D]
        # Buffer slot j (distance W - j from the first token) holds a token iff W - j <= position.
        # The chunk's own tokens get distance -1 (always valid). Windowed without the batch, so the unfold
        # has a size known at export even when the batch is symbolic.
        slot_dist = torch.tensor(
            [float(W - j) for j in range(W)] + [-1.0] * (N * C), dtype=q.dtype, device=q.device
        )
        dist_w = slot_dist.unfold(0, W + C, C)  # [N, W + C]
        valid = dist_w.unsqueeze(0) < pos0.reshape(-1, 1, 1) + 0.5  # [B, N, W + C]
    else:
        keys, values, valid = k, v, None
    kw, vw = _windows(keys, W, C, N), _windows(values, W, C, N)  # [B, N, W + C, D]

    # What chunk n hands to the old part by its last token: window indices x < len_n, then at distance
    # len_n - 1 + W - x >= W. As a part of the state: sums under its heaviest token, that token's key and
    # distance.
    handed = torch.tensor([[x < n for x in range(C)] for n in lens], device=q.device)  # [N, C]
    end_dist = torch.tensor([[n - 1 + W - x for x in range(C)] for n in lens], dtype=q.dtype, device=q.device)
    end_dist = end_dist.unsqueeze(-1)  # [N, C, 1]
    if valid is not None:
        handed = handed & valid[:, :, :C]  # [B, N, C]
    handed = handed.unsqueeze(-1)
    a = torch.where(handed, kw[:, :, :C] + end_dist * decay, NEG)  # [B, N, C, D]
    top = a.argmax(2, keepdim=True)  # [B, N, 1, D]
    mx_loc = kw[:, :, :C].gather(2, top).squeeze(2)  # [B, N, D]
    age_loc = end_dist[:, 0] - top.squeeze(2).to(q.dtype)  # the distance of index top
    rel = (kw[:, :, :C] - mx_loc.unsqueeze(2)) + (end_dist - age_loc.unsqueeze(2)) * decay  # a - a_top
    e = torch.exp(torch.where(handed, rel, NEG))  # masked before exp: no inf, not even in the backward
    num_loc, den_loc = (e * vw[:, :, :C]).sum(2), e.sum(2)

    # The old part at the start of each chunk: a loop over chunks on [B, D] tensors.
    old = state[:4]
    starts = []
    local = list(zip(*(t.unbind(1) for t in (num_loc, den_loc, mx_loc, age_loc))))  # per chunk, no slicing
    for n in range(N):
        starts.append(old)
        old = merge(old, local[n], decay, lens[n])
    num_s, den_s, mx_s, age_s = (torch.stack(s, 1).unsqueeze(2) for s in zip(*starts))  # [B, N, 1, D]

    # Token c of chunk n: its window row, and the old part c + 1 tokens after the chunk's start.
    bias, causal = _log_bias(decay, window_bias, C)
    L = kw.unsqueeze(2) + bias  # [B, N, C, W + C, D]
    if valid is not None:
        L = torch.where((causal & valid.unsqueeze(2)).unsqueeze(-1), L, NEG)
    ahead = torch.arange(1, C + 1, dtype=q.dtype, device=q.device).unsqueeze(1)  # [C, 1]
    L_old = torch.where(den_s > 0, mx_s + (age_s + ahead) * decay, NEG)  # [B, N, C, D]
    M = torch.maximum(L.amax(3), L_old).detach()  # a shift only: the output does not depend on it
    e = torch.exp(L - M.unsqueeze(3))
    e_old = torch.exp(L_old - M)
    num_o = (e * vw.unsqueeze(2)).sum(3) + e_old * num_s
    den_o = e.sum(3) + e_old * den_s
    o = torch.sigmoid(q.view(B, N, C, D)) * num_o / den_o
    o = o.reshape(B, N * C, D)[:, :T]

    final = canonical(old)
    if W:
        final += (keys[:, T : T + W], values[:, T : T + W], torch.clamp(pos0 + T, max=float(W)))
    return o, final


def parallel_aft(q, k, v, decay, window_bias, state):
    """The whole sequence as one chunk: a [T, W + T] table per channel. Quadratic in T, a reference
    for short sequences. Same arguments and results as ``chunk_aft``."""
    return chunk_aft(q, k, v, decay, window_bias, state, chunk_size=q.shape[1])


def parallel_aft_full(q, k, v, w):
    """AFT-full, q, k, v: [B, T, D], w: [T_max, T_max] with T <= T_max. Returns o: [B, T, D]."""
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    L = torch.where(causal.unsqueeze(-1), k.unsqueeze(1) + w[:T, :T].unsqueeze(-1), NEG)  # [B, T, T, D]
    M = L.amax(2, keepdim=True).detach()
    e = torch.exp(L - M)
    return torch.sigmoid(q) * (e * v.unsqueeze(1)).sum(2) / e.sum(2)
