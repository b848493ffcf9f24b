"""Chunkwise and fully parallel forms of mixed-chunk attention (training and prefill).

The chunk form cuts the new tokens into blocks of C. With a state at position p, absolute chunks do
not start on block boundaries: the first C - p tokens of block n (its "head") end chunk n, the last p
(its "tail") begin chunk n + 1. So block n attends to itself and to the tail of block n - 1, whose
tokens sit exactly C places earlier; the state's buffered tokens become the tail of a block -1.
Relative offsets are then fixed per (query, key) slot, and positions enter only through float masks:
the form traces to a graph that takes any position. The state's ``chunk_state`` (the running
``k_lin^T v`` sum of its unfinished chunk) stands in for block -1's tail in the linear part. Without
an initial state (p = 0, training) heads are whole blocks and the block -1 half is skipped.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.flash.step import FlashState, offset_bias, zero_state
from edgeattn.ops.utils import pad_time

torch = require("torch")
F = torch.nn.functional


def _final_buffers(xs, tail_of_state, T, start, C):
    """The unfinished chunk at the end, slot b <- stream token ``start + b``.

    The stream is block -1 (``tail_of_state``) then the new tokens, padded with zeros; the unfinished
    chunk always lies in the stream's window [T, T + 2C). ``start``: [B] float, relative to the window."""
    B = start.shape[0]
    idx = torch.arange(2 * C, dtype=start.dtype, device=start.device)
    pick = (idx == start.view(B, 1, 1) + idx[:C].view(1, C, 1)).to(start.dtype)  # [B, C(slot), 2C]
    out = []
    for x, prev in zip(xs, tail_of_state):
        pad = x.new_zeros(B, 2 * C, x.shape[-1])
        stream = torch.cat([prev, x, pad], dim=1)  # [B, C + T + 2C, D]
        out.append(pick @ stream[:, T : T + 2 * C])
    return out


def chunk_mixed_attention(qq, kq, ql, kl, v, *, chunk_size, quad_scale, lin_scale, rel_bias, initial_state):
    """q_*, k_*: [B, T, S], v: [B, T, E], rel_bias: [C] or None, initial_state: FlashState or None.
    Returns (o [B, T, E], final FlashState)."""
    B, T, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    dt, dev = qq.dtype, qq.device
    aligned = initial_state is None
    state = zero_state(B, S, E, C, dt, dev) if aligned else initial_state
    S0, cur0, kq_buf, v_buf, pos = state
    # Padded tokens have k = v = 0: they change neither outputs nor the state.
    qq, kq, ql, kl, v = (pad_time(x, C) for x in (qq, kq, ql, kl, v))
    N = qq.shape[1] // C

    def blocks(x):  # [B, N*C, D] -> [B, N, C, D]
        return x.reshape(B, N, C, x.shape[-1])

    qq_b, kq_b, ql_b, kl_b, v_b = (blocks(x) for x in (qq, kq, ql, kl, v))
    idx = torch.arange(C, dtype=dt, device=dev)
    causal = (idx.view(C, 1) >= idx).to(dt)  # [C(i), C(j)]
    split = (C - pos).view(B, 1)  # first local index of each block's tail
    head = (idx < split).to(dt)  # [B, C]
    tail = 1.0 - head
    # Block -1: buffered slot b moves to local index b + C - p (slots >= p select nothing).
    shift = (idx.view(1, C, 1) == idx.view(1, 1, C) + split.view(B, 1, 1)).to(dt)  # [B, C(j), C(b)]
    kq_prev, v_prev = shift @ kq_buf, shift @ v_buf  # [B, C, D]

    def with_previous(x_b, prev):  # [B, N, C, D] -> keys of block n: [block n - 1, block n], [B, N, 2C, D]
        return torch.cat([torch.cat([prev.unsqueeze(1), x_b[:, :-1]], dim=1), x_b], dim=2)

    # Quadratic part: relu^2 attention inside each absolute chunk.
    if aligned:
        keys, values, mask = kq_b, v_b, causal
        offsets = idx.view(C, 1) - idx  # [C, C]
    else:
        keys, values = with_previous(kq_b, kq_prev), with_previous(v_b, v_prev)
        same = head.unsqueeze(-1) * head.unsqueeze(-2) + tail.unsqueeze(-1) * tail.unsqueeze(-2)
        # head queries see the previous block's tail; every query sees its own part of its block
        mask = torch.cat([head.unsqueeze(-1) * tail.unsqueeze(-2), causal * same], dim=-1)  # [B, C, 2C]
        mask = mask.unsqueeze(1)
        offsets = idx.view(C, 1) + C - torch.arange(2 * C, dtype=dt, device=dev)  # [C, 2C]
    scores = quad_scale * (qq_b @ keys.transpose(-1, -2))  # [B, N, C, C or 2C]
    if rel_bias is not None:
        scores = scores + offset_bias(rel_bias, offsets)
    o = (F.relu(scores).square() * mask) @ values  # [B, N, C, E]

    # Linear part: X_n sums chunk n (block n - 1's tail and block n's head; for n = 0 the state's
    # chunk_state and block 0's head); chunk n reads S0 + X_<n. X_N is block N - 1's tail: chunk N.
    if aligned:
        X = kl_b.transpose(-1, -2) @ v_b  # [B, N, S, E]
        X_all = torch.cat([X, X.new_zeros(B, 1, S, E)], dim=1)  # [B, N + 1, S, E]
    else:
        kv_tail = (kl_b * tail.view(B, 1, C, 1)).transpose(-1, -2) @ v_b
        kv_prev = torch.cat([cur0.unsqueeze(1), kv_tail[:, :-1]], dim=1)
        X = kv_prev + (kl_b * head.view(B, 1, C, 1)).transpose(-1, -2) @ v_b
        X_all = torch.cat([X, kv_tail[:, -1:]], dim=1)
    before = S0.unsqueeze(1) + torch.cat([X.new_zeros(B, 1, S, E), X.cumsum(1)], dim=1)  # [B, N + 1, S, E]
    o_lin = ql_b @ before[:, :N]
    if not aligned:  # tails belong to the next chunk, which has chunk n summed in too
        o_lin = o_lin + (ql_b * tail.view(B, 1, C, 1)) @ X
    o = (o + lin_scale * o_lin).reshape(B, N * C, E)[:, :T]

    # Final state: the chunk holding the end is unfinished; the sum stops before it and its own sum
    # (padded tokens add nothing) is the running chunk_state.
    end = pos + T
    last = torch.floor(end / C)  # [B] absolute index of the unfinished chunk, 0 <= last <= N
    chunk_ids = torch.arange(N + 1, dtype=dt, device=dev)
    pick_last = (chunk_ids == last.view(B, 1)).to(dt)  # [B, N + 1]
    lin = torch.einsum("bn,bnse->bse", pick_last, before)
    cur = torch.einsum("bn,bnse->bse", pick_last, X_all)
    # The stream (block -1, then the new tokens) starts chunk c at index c*C + C - p.
    start = last * C + C - pos - T
    kq_f, v_f = _final_buffers((kq[:, :T], v[:, :T]), (kq_prev, v_prev), T, start, C)
    return o, FlashState(lin, cur, kq_f, v_f, end - last * C)


def parallel_mixed_attention(
    qq, kq, ql, kl, v, *, chunk_size, quad_scale, lin_scale, rel_bias, initial_state
):
    """The whole sequence as one [T, C + T] masked matrix over the buffered and the new tokens.
    Quadratic in T: a reference for short sequences. Same arguments and results as the chunk form."""
    B, T, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    dt, dev = qq.dtype, qq.device
    state = zero_state(B, S, E, C, dt, dev) if initial_state is None else initial_state
    S0, cur0, kq_buf, v_buf, pos = state
    slots = torch.arange(C, dtype=dt, device=dev)
    # Every key at its place from the start of the current chunk: buffered slots < p, then new tokens.
    a_new = pos.view(B, 1) + torch.arange(T, dtype=dt, device=dev)  # [B, T]
    a_key = torch.cat([slots.expand(B, C), a_new], dim=1)  # [B, C + T]
    valid = torch.cat([slots < pos.view(B, 1), a_new >= 0], dim=1)  # [B, C + T]
    c_new, c_key = torch.floor(a_new / C), torch.floor(a_key / C)
    keys_q, values = torch.cat([kq_buf, kq], dim=1), torch.cat([v_buf, v], dim=1)

    d = a_new.unsqueeze(-1) - a_key.unsqueeze(-2)  # [B, T, C + T] offsets t - j
    same = (c_new.unsqueeze(-1) == c_key.unsqueeze(-2)) & (d >= 0) & valid.unsqueeze(1)
    scores = quad_scale * (qq @ keys_q.transpose(-1, -2))
    if rel_bias is not None:
        scores = scores + rel_bias[d.clamp(0, C - 1).long()]
    o = (F.relu(scores).square() * same) @ values
    # Linear part over the new keys; the buffered ones enter through their sum cur0 (chunk 0).
    earlier = (c_new.unsqueeze(-2) < c_new.unsqueeze(-1)).to(dt)  # [B, T(query), T(key)]
    after_first = (c_new > 0).to(dt).unsqueeze(-1)  # [B, T, 1]
    o_lin = ql @ S0 + after_first * (ql @ cur0) + ((ql @ kl.transpose(-1, -2)) * earlier) @ v
    o = o + lin_scale * o_lin

    end = pos + T
    last = torch.floor(end / C)
    done = (c_new < last.view(B, 1)).to(dt).unsqueeze(-1)  # [B, T, 1]
    in_last = (c_new == last.view(B, 1)).to(dt).unsqueeze(-1)
    first_done = (last > 0).to(dt).view(B, 1, 1)
    lin = S0 + first_done * cur0 + (kl * done).transpose(-1, -2) @ v
    cur = (1.0 - first_done) * cur0 + (kl * in_last).transpose(-1, -2) @ v
    pick = (a_key.unsqueeze(1) == (last * C).view(B, 1, 1) + slots.view(1, C, 1)) & valid.unsqueeze(1)
    pick = pick.to(dt)  # [B, C(slot), C + T]
    return o, FlashState(lin, cur, pick @ keys_q, pick @ values, end - last * C)
