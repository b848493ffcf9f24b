"""Chunkwise gated linear recurrence in Triton: forward and backward, for training and prefill.

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t,      o_t = q_t S_t   (unscaled)

Tokens are cut into chunks of BT. With ``b`` the log-gates summed within a chunk (``utils.py``),
``h[n]`` the state before chunk n and ``b_L`` the last ``b`` of the chunk:

    o_t      = (q_t * exp(b_t)) h[n] + sum_{i <= t} A[t, i] v_i,   A[t, i] = sum_k q_tk k_ik exp(b_tk - b_ik)
    h[n + 1] = exp(b_L) * h[n] + (k * exp(b_L - b))^T v

Every exponent is a difference of cumulative sums that is <= 0, so gates down to -1e4 per step
underflow to 0 and never overflow; the sums are kept as float32 pairs so that their differences stay
exact (``utils.py``). A whole-head gate (G = 1) makes ``exp(b_t - b_i)`` a [BT, BT] mask applied to
``q k^T``. A per-key gate (G = K) cannot be factored like that: ``A`` is built from sub-chunks of BC
tokens, each off-diagonal pair through a reference ``b_r`` between them (``q exp(b - b_r)`` and
``k exp(b_r - b)``, both <= 1), each diagonal sub-chunk one column at a time.

Backward: ``dh[n]``, the gradient of the state after chunk n, runs from the last chunk back; then
dv, dq, dk chunk by chunk (the intra-chunk parts from ``dA[t, i] = do_t . v_i``, through the same
sub-chunks for a per-key gate) and dg within each chunk: ``dg_t = sum_{s >= t in the chunk}
(q_s dq_s - k_s dk_s) + sum_v h[n + 1] * dh[n]``, which equals the reverse sum of ``q dq - k dk``
over the whole sequence (``utils.py``) without its rounding errors growing with T.

Dots take 16-bit operands as they are (tensor cores) and float32 ones as PyTorch's tf32 setting says;
states, sums and accumulators are float32. Forward keeps ``A`` [B, T, H, BT] float32 for backward;
the per-chunk states [B, NT, H, K, V] are recomputed there.

Layout: q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, G], states [B, H, K, V] float32. Padded
tokens of the last chunk read k = v = 0 and the last valid cumulative gate (no decay). Offsets
within a sequence are int32: T * H * max(K, V) must stay below 2**31.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.kernels.utils import (
    block_size,
    cast,
    check_inputs,
    chunk_local_cumsum,
    decay_to_chunk_end,
    dot,
    dot_precision,
    empty_sequence,
    gate_head,
    gate_row,
    gate_rows,
    gate_stride,
    load_state,
    state_block,
)

torch = require("torch")
triton = require("triton")
tl = require("triton.language")

BC = 16  # sub-chunk of the per-key gate's intra-chunk matrix
# Launch settings by the inputs' dtype: (warps of the kernels holding [BT, 64] tiles, warps of the [BC, *]
# sub-chunk ones, pipeline stages), read at each launch (benchmarks/gpu_profile.py sweeps them on a GPU).
# 16-bit inputs (training): 4-4-1, the fastest over all four ops (gla, simple_gla, gated_delta, kda) of the
# 12 settings timed on an H200 (RESULTS.md, 2026-11-28): 3.7-16% faster forward + backward than 8-4-2,
# outputs and gradients equal to 1e-7; 16 warps gave wrong results there (Triton 3.6). float32: 8-4-2, the
# setting the compiled tests passed with on an H100 and an H200 (float32 spills at most 232 bytes on sm_90).
LAUNCH = {"16bit": (4, 4, 1), "float32": (8, 4, 2)}


def launch(dtype) -> tuple[int, int, int]:
    """(wide warps, narrow warps, stages) for inputs of ``dtype``."""
    return LAUNCH["float32" if dtype == torch.float32 else "16bit"]


def wide(dtype) -> dict:
    w, _, stages = launch(dtype)
    return dict(num_warps=w, num_stages=stages)


def narrow(dtype) -> dict:
    _, n, stages = launch(dtype)
    return dict(num_warps=n, num_stages=stages)


@triton.jit
def chunk_fwd_A_kernel(
    q,
    k,
    gc,
    A,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # A[t, i] = q_t . k_i * exp(b_t - b_i) for i <= t; no gate (GATE = 0) or a whole-head gate (1).
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    A += (bos * H + i_h) * BT

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        o_tk = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + o_tk, mask=m_tk, other=0)
        b_k = tl.load(k + o_tk, mask=m_tk, other=0)
        b_A += dot(b_q, tl.trans(b_k), PREC)
    m_A = o_i[:, None] >= o_i[None, :]
    if GATE == 1:
        b_g, b_g_lo = gate_head(gc + GS * (bos * H + i_h), o_t, T, H, GS)
        b_d = (b_g[:, None] - b_g[None, :]) + (b_g_lo[:, None] - b_g_lo[None, :])
        b_A *= tl.exp(tl.where(m_A, b_d, float("-inf")))
    else:
        b_A = tl.where(m_A, b_A, 0)
    tl.store(A + o_t[:, None] * (H * BT) + o_i[None, :], b_A, mask=m_t[:, None])


@triton.jit
def chunk_fwd_A_gk_kernel(
    q,
    k,
    gc,
    A,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # Per-key gate, one program per sub-chunk row block i of A: A[t, j] = sum_k q_tk k_jk exp(b_tk - b_jk).
    NC: tl.constexpr = BT // BC
    i_tc, i_bh = tl.program_id(0), tl.program_id(1)
    i_t, i_i = i_tc // NC, i_tc % NC
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gc += GS * (bos * H + i_h) * K
    A += (bos * H + i_h) * BT

    o_c = tl.arange(0, BC)
    o_i = i_t * BT + i_i * BC + o_c
    m_i = o_i < T
    p_A = A + o_i[:, None] * (H * BT) + o_c[None, :]  # + j * BC: column block j
    r_ref = i_t * BT + i_i * BC  # the first row of block i: after every row of the blocks j < i
    if r_ref >= T:  # a block of padding: A has no such rows
        return

    for j in range(0, i_i):
        o_j = i_t * BT + j * BC + o_c
        b_A = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = tl.load(
                q + o_i[:, None] * (H * K) + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0
            )
            b_k = tl.load(
                k + o_j[:, None] * (H * K) + o_k[None, :], mask=(o_j < T)[:, None] & m_k[None, :], other=0
            )
            b_gr, b_gr_lo = gate_row(gc, r_ref, o_k, m_k, T, H * K, GS)
            b_gq, b_gq_lo = gate_rows(gc, o_i, o_k, m_k, T, H * K, GS)
            b_gk, b_gk_lo = gate_rows(gc, o_j, o_k, m_k, T, H * K, GS)
            b_qg = b_q * tl.exp((b_gq - b_gr[None, :]) + (b_gq_lo - b_gr_lo[None, :]))
            b_kg = b_k * tl.exp((b_gr[None, :] - b_gk) + (b_gr_lo[None, :] - b_gk_lo))
            b_A += dot(cast(b_qg, b_q.dtype, PREC), tl.trans(cast(b_kg, b_k.dtype, PREC)), PREC)
        tl.store(p_A + j * BC, b_A, mask=m_i[:, None])

    # diagonal block: exp(b_t - b_j) only for t >= j, one column j at a time
    b_A = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q + o_i[:, None] * (H * K) + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0)
        b_q = b_q.to(tl.float32)
        b_gq, b_gq_lo = gate_rows(gc, o_i, o_k, m_k, T, H * K, GS)
        for jj in range(0, tl.minimum(BC, T - r_ref)):  # a padded column only meets padded rows
            r = r_ref + jj
            b_kj = tl.load(k + r * (H * K) + o_k, mask=m_k, other=0).to(tl.float32)
            b_gj, b_gj_lo = gate_row(gc, r, o_k, m_k, T, H * K, GS)
            b_d = (b_gq - b_gj[None, :]) + (b_gq_lo - b_gj_lo[None, :])
            b_e = tl.exp(tl.where((o_c >= jj)[:, None], b_d, float("-inf")))
            b_a = tl.sum(b_q * b_kj[None, :] * b_e, axis=1)
            b_A += tl.where(o_c[None, :] == jj, b_a[:, None], 0)
    tl.store(p_A + i_i * BC, b_A, mask=m_i[:, None])
    for j in range(i_i + 1, NC):
        tl.store(p_A + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=m_i[:, None])


@triton.jit
def chunk_fwd_h_kernel(
    k,
    v,
    gc,
    h,
    h0,
    ht,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    USE_H0: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # h[n] (the state before chunk n) for every chunk, then the final state.
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    k += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    h += (i_b.to(tl.int64) * NT * H + i_h) * K * V  # h[b, 0, h]; chunk n is n * H * K * V further

    o_k, o_v, m_k, m_v, o_h, m_h = state_block(i_k, i_v, K, V, BK, BV)
    b_h = load_state(h0, i_bh, o_h, m_h, K, V, BK, BV, USE_H0)
    for i_t in range(NT):
        tl.store(h + o_h, b_h, mask=m_h)
        h += H * K * V
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        r_last = i_t * BT + BT - 1
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
        b_h, b_k = decay_to_chunk_end(
            b_h, b_k, gc, bos, i_h, o_t, o_k, m_k, r_last, T, H, K, GATE, GS, b_v.dtype, PREC
        )
        b_h += dot(tl.trans(b_k), b_v, PREC)
    tl.store(ht + i_bh.to(tl.int64) * K * V + o_h, b_h, mask=m_h)


@triton.jit
def chunk_fwd_o_kernel(
    q,
    v,
    gc,
    h,
    A,
    o,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # o = (q * exp(b)) h[n] + A v
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    q += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    o += (bos * H + i_h) * V
    A += (bos * H + i_h) * BT
    h += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        if GATE == 1:
            b_g, b_g_lo = gate_head(gc + GS * (bos * H + i_h), o_t, T, H, GS)
            b_q = cast(b_q * tl.exp(b_g + b_g_lo)[:, None], b_q.dtype, PREC)
        elif GATE == 2:
            b_g, b_g_lo = gate_rows(gc + GS * (bos * H + i_h) * K, o_t, o_k, m_k, T, H * K, GS)
            b_q = cast(b_q * tl.exp(b_g + b_g_lo), b_q.dtype, PREC)
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_o += dot(b_q, cast(b_h, b_q.dtype, PREC), PREC)
    b_A = tl.load(A + o_t[:, None] * (H * BT) + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0)
    o_tv = o_t[:, None] * (H * V) + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v + o_tv, mask=m_tv, other=0)
    b_o += dot(cast(b_A, b_v.dtype, PREC), b_v, PREC)
    tl.store(o + o_tv, cast(b_o, o.dtype.element_ty, PREC), mask=m_tv)


@triton.jit
def chunk_bwd_dh_kernel(
    q,
    do,
    gc,
    dh,
    dht,
    dh0,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    USE_DHT: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # dh[n]: the gradient of the state after chunk n (of h[n + 1]), from the last chunk back; then
    # dh0, that of the initial state:  dh[n - 1] = exp(b_L) * dh[n] + (q * exp(b))^T do  over chunk n.
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    q += (bos * H + i_h) * K
    do += (bos * H + i_h) * V
    dh += ((i_b.to(tl.int64) * NT + NT - 1) * H + i_h) * K * V  # dh[b, NT - 1, h], walked back

    o_k, o_v, m_k, m_v, o_h, m_h = state_block(i_k, i_v, K, V, BK, BV)
    b_dh = load_state(dht, i_bh, o_h, m_h, K, V, BK, BV, USE_DHT)
    for i_s in range(NT):
        i_t = NT - 1 - i_s
        tl.store(dh + o_h, b_dh, mask=m_h)
        dh -= H * K * V
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        r_last = i_t * BT + BT - 1
        b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        b_do = tl.load(do + o_t[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
        if GATE == 1:
            p_g = gc + GS * (bos * H + i_h)
            b_g, b_g_lo = gate_head(p_g, o_t, T, H, GS)
            b_gn, b_gn_lo = gate_head(p_g, r_last, T, H, GS)
            b_dh *= tl.exp(b_gn + b_gn_lo)
            b_q = cast(b_q * tl.exp(b_g + b_g_lo)[:, None], b_q.dtype, PREC)
        elif GATE == 2:
            p_g = gc + GS * (bos * H + i_h) * K
            b_g, b_g_lo = gate_rows(p_g, o_t, o_k, m_k, T, H * K, GS)
            b_gn, b_gn_lo = gate_row(p_g, r_last, o_k, m_k, T, H * K, GS)
            b_dh *= tl.exp(b_gn + b_gn_lo)[:, None]
            b_q = cast(b_q * tl.exp(b_g + b_g_lo), b_q.dtype, PREC)
        b_dh += dot(tl.trans(b_q), cast(b_do, b_q.dtype, PREC), PREC)
    tl.store(dh0 + i_bh.to(tl.int64) * K * V + o_h, b_dh, mask=m_h)


@triton.jit
def chunk_bwd_dA_kernel(
    v,
    do,
    dA,
    T,
    H: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    # dA[t, i] = do_t . v_i for i <= t
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    v += (bos * H + i_h) * V
    do += (bos * H + i_h) * V
    dA += (bos * H + i_h) * BT

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        o_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + o_tv, mask=m_tv, other=0)
        b_do = cast(tl.load(do + o_tv, mask=m_tv, other=0), b_v.dtype, PREC)
        b_dA += dot(b_do, tl.trans(b_v), PREC)
    b_dA = tl.where(o_i[:, None] >= o_i[None, :], b_dA, 0)
    tl.store(dA + o_t[:, None] * (H * BT) + o_i[None, :], b_dA, mask=m_t[:, None])


@triton.jit
def chunk_bwd_dv_kernel(
    k,
    gc,
    A,
    do,
    dh,
    dv,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # dv = A^T do + (k * exp(b_L - b)) dh[n]
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    k += (bos * H + i_h) * K
    do += (bos * H + i_h) * V
    dv += (bos * H + i_h) * V
    A += (bos * H + i_h) * BT
    dh += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_tv = o_t[:, None] * (H * V) + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    r_last = i_t * BT + BT - 1

    b_A = tl.load(A + o_t[:, None] * (H * BT) + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0)
    b_do = cast(tl.load(do + o_tv, mask=m_tv, other=0), k.dtype.element_ty, PREC)
    b_dv = dot(cast(tl.trans(b_A), b_do.dtype, PREC), b_do, PREC)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        if GATE == 1:
            p_g = gc + GS * (bos * H + i_h)
            b_g, b_g_lo = gate_head(p_g, o_t, T, H, GS)
            b_gn, b_gn_lo = gate_head(p_g, r_last, T, H, GS)
            b_k = cast(b_k * tl.exp((b_gn - b_g) + (b_gn_lo - b_g_lo))[:, None], b_k.dtype, PREC)
        elif GATE == 2:
            p_g = gc + GS * (bos * H + i_h) * K
            b_g, b_g_lo = gate_rows(p_g, o_t, o_k, m_k, T, H * K, GS)
            b_gn, b_gn_lo = gate_row(p_g, r_last, o_k, m_k, T, H * K, GS)
            b_k = cast(b_k * tl.exp((b_gn[None, :] - b_g) + (b_gn_lo[None, :] - b_g_lo)), b_k.dtype, PREC)
        b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_dv += dot(b_k, cast(b_dh, b_k.dtype, PREC), PREC)
    tl.store(dv + o_tv, cast(b_dv, dv.dtype.element_ty, PREC), mask=m_tv)


@triton.jit
def chunk_bwd_dqk_intra_gk_kernel(
    q,
    k,
    gc,
    dA,
    dq,
    dk,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # Per-key gate, the intra-chunk part of dq and dk for the rows of sub-chunk block i:
    #   dq_t = sum_{j <= t} dA[t, j] k_j exp(b_t - b_j),   dk_j = sum_{t >= j} dA[t, j] q_t exp(b_t - b_j)
    NC: tl.constexpr = BT // BC
    i_k, i_tc, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_t, i_i = i_tc // NC, i_tc % NC
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gc += GS * (bos * H + i_h) * K
    dq += (bos * H + i_h) * K
    dk += (bos * H + i_h) * K
    dA += (bos * H + i_h) * BT

    o_c = tl.arange(0, BC)
    o_i = i_t * BT + i_i * BC + o_c
    m_i = o_i < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    r_first = i_t * BT + i_i * BC
    if r_first >= T:  # a block of padding: nothing to write
        return
    b_gi, b_gi_lo = gate_rows(gc, o_i, o_k, m_k, T, H * K, GS)

    # dq from the blocks j < i, through the first row of block i
    b_gr, b_gr_lo = gate_row(gc, r_first, o_k, m_k, T, H * K, GS)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    for j in range(0, i_i):
        o_j = i_t * BT + j * BC + o_c
        b_k = tl.load(
            k + o_j[:, None] * (H * K) + o_k[None, :], mask=(o_j < T)[:, None] & m_k[None, :], other=0
        )
        b_gk, b_gk_lo = gate_rows(gc, o_j, o_k, m_k, T, H * K, GS)
        b_kg = cast(b_k * tl.exp((b_gr[None, :] - b_gk) + (b_gr_lo[None, :] - b_gk_lo)), b_k.dtype, PREC)
        b_dA = tl.load(dA + o_i[:, None] * (H * BT) + j * BC + o_c[None, :], mask=m_i[:, None], other=0)
        b_dq += dot(cast(b_dA, b_k.dtype, PREC), b_kg, PREC)
    b_dq *= tl.exp((b_gi - b_gr[None, :]) + (b_gi_lo - b_gr_lo[None, :]))

    # dk from the blocks j > i, through the last row of block i
    b_gr, b_gr_lo = gate_row(gc, r_first + BC - 1, o_k, m_k, T, H * K, GS)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for j in range(i_i + 1, tl.minimum(NC, tl.cdiv(T - i_t * BT, BC))):
        o_j = i_t * BT + j * BC + o_c
        m_j = o_j < T
        b_q = tl.load(q + o_j[:, None] * (H * K) + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0)
        b_gq, b_gq_lo = gate_rows(gc, o_j, o_k, m_k, T, H * K, GS)
        b_qg = cast(b_q * tl.exp((b_gq - b_gr[None, :]) + (b_gq_lo - b_gr_lo[None, :])), b_q.dtype, PREC)
        b_dA = tl.load(dA + o_j[:, None] * (H * BT) + i_i * BC + o_c[None, :], mask=m_j[:, None], other=0)
        b_dk += dot(cast(tl.trans(b_dA), b_q.dtype, PREC), b_qg, PREC)
    b_dk *= tl.exp((b_gr[None, :] - b_gi) + (b_gr_lo[None, :] - b_gi_lo))

    # the diagonal block, one token jj at a time: its column of dA feeds dq, its row feeds dk
    for jj in range(0, tl.minimum(BC, T - r_first)):  # a padded token only meets padded rows
        r = r_first + jj
        b_qj = tl.load(q + r * (H * K) + o_k, mask=m_k, other=0).to(tl.float32)
        b_kj = tl.load(k + r * (H * K) + o_k, mask=m_k, other=0).to(tl.float32)
        b_gj, b_gj_lo = gate_row(gc, r, o_k, m_k, T, H * K, GS)
        b_dAc = tl.load(dA + o_i * (H * BT) + i_i * BC + jj, mask=m_i, other=0)  # dA[t, jj]
        b_dAr = tl.load(dA + r * (H * BT) + i_i * BC + o_c)  # dA[jj, t]
        b_d = (b_gi - b_gj[None, :]) + (b_gi_lo - b_gj_lo[None, :])  # b_t - b_jj
        b_eq = tl.exp(tl.where((o_c >= jj)[:, None], b_d, float("-inf")))
        b_ek = tl.exp(tl.where((o_c <= jj)[:, None], -b_d, float("-inf")))
        b_dq += b_dAc[:, None] * b_kj[None, :] * b_eq
        b_dk += b_dAr[:, None] * b_qj[None, :] * b_ek
    o_ik = o_i[:, None] * (H * K) + o_k[None, :]
    m_ik = m_i[:, None] & m_k[None, :]
    tl.store(dq + o_ik, b_dq, mask=m_ik)
    tl.store(dk + o_ik, b_dk, mask=m_ik)


@triton.jit
def chunk_bwd_dqk_kernel(
    q,
    k,
    v,
    gc,
    h,
    do,
    dh,
    dA,
    dq,
    dk,
    dg,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # dq = exp(b) * (do h[n]^T) + intra,   dk = exp(b_L - b) * (v dh[n]^T) + intra.
    # The per-key gate's intra part was written to dq, dk by chunk_bwd_dqk_intra_gk_kernel: added here.
    # dg per key, within the chunk only (a sum over the whole sequence would pile up rounding errors):
    #   dg_t = sum_{s >= t in chunk} (q_s dq_s - k_s dk_s) + sum_v h[n + 1] * dh[n]
    # with h[n + 1] = exp(b_L) h[n] + sum_i (k_i * exp(b_L - b_i))^T v_i, the state after the chunk.
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    dq += (bos * H + i_h) * K
    dk += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    do += (bos * H + i_h) * V
    dA += (bos * H + i_h) * BT
    h += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V
    dh += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K * V

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_tk = o_t[:, None] * (H * K) + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    r_last = i_t * BT + BT - 1

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # sum_v h[n] * dh[n]
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        o_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(v + o_tv, mask=m_tv, other=0)
        b_do = cast(tl.load(do + o_tv, mask=m_tv, other=0), b_v.dtype, PREC)
        o_kv = o_k[:, None] * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + o_kv, mask=m_kv, other=0)
        b_dh = tl.load(dh + o_kv, mask=m_kv, other=0)
        if GATE != 0:
            b_hdh += tl.sum(b_h * b_dh, axis=1)
        b_dq += dot(b_do, tl.trans(cast(b_h, b_v.dtype, PREC)), PREC)
        b_dk += dot(b_v, tl.trans(cast(b_dh, b_v.dtype, PREC)), PREC)

    b_q = tl.load(q + o_tk, mask=m_tk, other=0)
    b_k = tl.load(k + o_tk, mask=m_tk, other=0)
    if GATE == 2:
        p_g = gc + GS * (bos * H + i_h) * K
        b_g, b_g_lo = gate_rows(p_g, o_t, o_k, m_k, T, H * K, GS)
        b_gn, b_gn_lo = gate_row(p_g, r_last, o_k, m_k, T, H * K, GS)
        b_dq = b_dq * tl.exp(b_g + b_g_lo) + tl.load(dq + o_tk, mask=m_tk, other=0)
        b_dk *= tl.exp((b_gn[None, :] - b_g) + (b_gn_lo[None, :] - b_g_lo))
        # sum_v h[n + 1] * dh[n], from h[n] and the chunk's own part of dk
        b_hdh = b_hdh * tl.exp(b_gn + b_gn_lo) + tl.sum(b_k * b_dk, axis=0)
        b_dk += tl.load(dk + o_tk, mask=m_tk, other=0)
    else:
        b_dA = tl.load(dA + o_t[:, None] * (H * BT) + o_i[None, :], mask=m_t[:, None], other=0)
        if GATE == 1:
            p_g = gc + GS * (bos * H + i_h)
            b_g, b_g_lo = gate_head(p_g, o_t, T, H, GS)
            b_gn, b_gn_lo = gate_head(p_g, r_last, T, H, GS)
            b_dq *= tl.exp(b_g + b_g_lo)[:, None]
            b_dk *= tl.exp((b_gn - b_g) + (b_gn_lo - b_g_lo))[:, None]
            b_hdh = b_hdh * tl.exp(b_gn + b_gn_lo) + tl.sum(b_k * b_dk, axis=0)
            b_d = (b_g[:, None] - b_g[None, :]) + (b_g_lo[:, None] - b_g_lo[None, :])
            b_dA *= tl.exp(tl.where(o_i[:, None] >= o_i[None, :], b_d, float("-inf")))
        b_dA = cast(b_dA, b_k.dtype, PREC)
        b_dq += dot(b_dA, b_k, PREC)
        b_dk += dot(tl.trans(b_dA), b_q, PREC)
    tl.store(dq + o_tk, cast(b_dq, dq.dtype.element_ty, PREC), mask=m_tk)
    tl.store(dk + o_tk, cast(b_dk, dk.dtype.element_ty, PREC), mask=m_tk)
    if GATE != 0:
        b_dg = tl.cumsum(b_q * b_dq - b_k * b_dk, axis=0, reverse=True) + b_hdh[None, :]
        tl.store(dg + (bos * H + i_h) * K + o_tk, b_dg, mask=m_tk)


def _gate_kind(gc) -> int:
    """0: no gate, 1: one gate per head (G = 1), 2: one gate per key (G = K)."""
    return 0 if gc is None else (1 if gc.shape[-2] == 1 else 2)


def _blocks(K: int, V: int) -> tuple[int, int]:
    return block_size(K, 64), block_size(V, 64)


def chunk_fwd_h(k, v, gc, h0, BT: int):
    """States before every chunk [B, NT, H, K, V] and the final state [B, H, K, V], float32."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV = _blocks(K, V)
    h = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=k.device)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    chunk_fwd_h_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        k, v, gc, h, h0, ht, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        GATE=_gate_kind(gc), USE_H0=h0 is not None, GS=gate_stride(gc), PREC=dot_precision(k.dtype),
        **wide(k.dtype),
    )  # fmt: skip
    return h, ht


def chunk_fwd_A(q, k, gc, BT: int):
    """The intra-chunk matrix A [B, T, H, BT] float32: A[t, i] = sum_k q_tk k_ik exp(b_tk - b_ik), i <= t."""
    B, T, H, K = q.shape
    NT = triton.cdiv(T, BT)
    BK = block_size(K, 64)
    gate, prec = _gate_kind(gc), dot_precision(q.dtype)
    A = torch.empty(B, T, H, BT, dtype=torch.float32, device=q.device)
    if gate == 2:
        chunk_fwd_A_gk_kernel[(NT * (BT // BC), B * H)](
            q, k, gc, A, T, H=H, K=K, BT=BT, BC=BC, BK=BK, GS=gate_stride(gc), PREC=prec, **narrow(q.dtype)
        )
    else:
        chunk_fwd_A_kernel[(NT, B * H)](
            q, k, gc, A, T, H=H, K=K, BT=BT, BK=BK, GATE=gate, GS=gate_stride(gc), PREC=prec, **wide(q.dtype)
        )
    return A


def chunk_fwd_o(q, v, gc, h, A, BT: int):
    """o = (q * exp(b)) h[n] + A v, [B, T, H, V] in q's dtype, from the states before every chunk h."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV = _blocks(K, V)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    chunk_fwd_o_kernel[(triton.cdiv(V, BV), NT, B * H)](
        q, v, gc, h, A, o, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        GATE=_gate_kind(gc), GS=gate_stride(gc), PREC=dot_precision(q.dtype), **wide(q.dtype),
    )  # fmt: skip
    return o


def chunk_fwd(q, k, v, gc, h0, BT: int):
    """Returns (o [B, T, H, V] in q's dtype, final state, A [B, T, H, BT] the intra-chunk matrix)."""
    A = chunk_fwd_A(q, k, gc, BT)
    h, ht = chunk_fwd_h(k, v, gc, h0, BT)
    return chunk_fwd_o(q, v, gc, h, A, BT), ht, A


def chunk_bwd_dA(v, do, BT: int):
    """dA [B, T, H, BT] float32: dA[t, i] = do_t . v_i for i <= t (0 above the diagonal)."""
    B, T, H, V = v.shape
    dA = torch.empty(B, T, H, BT, dtype=torch.float32, device=v.device)
    chunk_bwd_dA_kernel[(triton.cdiv(T, BT), B * H)](
        v, do, dA, T, H=H, V=V, BT=BT, BV=block_size(V, 64), PREC=dot_precision(v.dtype), **wide(v.dtype),
    )  # fmt: skip
    return dA


def chunk_bwd_dqk(q, k, v, gc, h, do, dh, dA, BT: int):
    """dq, dk [B, T, H, K] float32 of o = (q * exp(b)) h[n] + A v and of the states, given the states
    h, their gradients dh (of h[n + 1]) and dA; and dg [B, T, H, K] float32 per key (None without a
    gate; a whole-head gate's gradient is its sum over keys)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    BK = block_size(K, 64)
    gate, prec = _gate_kind(gc), dot_precision(q.dtype)
    dq = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    dk = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    dg = None if gate == 0 else torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    if gate == 2:
        chunk_bwd_dqk_intra_gk_kernel[(triton.cdiv(K, BK), NT * (BT // BC), B * H)](
            q,
            k,
            gc,
            dA,
            dq,
            dk,
            T,
            H=H,
            K=K,
            BT=BT,
            BC=BC,
            BK=BK,
            GS=gate_stride(gc),
            PREC=prec,
            **narrow(q.dtype),
        )
    chunk_bwd_dqk_kernel[(triton.cdiv(K, BK), NT, B * H)](
        q, k, v, gc, h, do, dh, dA, dq, dk, dg, T, H=H, K=K, V=V, BT=BT, BK=BK,
        BV=block_size(V, 32),  # [BT, BK] dq, dk and [BT, BT] dA are live across the V loop
        GATE=gate, GS=gate_stride(gc), PREC=prec, **wide(q.dtype),
    )  # fmt: skip
    return dq, dk, dg


def chunk_bwd(q, k, v, gc, A, h0, do, dht, BT: int):
    """Returns (dq, dk, dv, dg float32 [B, T, H, G] or None, dh0 float32 [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV = _blocks(K, V)
    gate, prec = _gate_kind(gc), dot_precision(q.dtype)
    h, _ = chunk_fwd_h(k, v, gc, h0, BT)  # recomputed: cheaper than keeping [B, NT, H, K, V] alive

    dh = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    chunk_bwd_dh_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        q, do, gc, dh, dht, dh0, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        GATE=gate, USE_DHT=dht is not None, GS=gate_stride(gc), PREC=prec, **wide(q.dtype),
    )  # fmt: skip

    dA = chunk_bwd_dA(v, do, BT)
    dv = torch.empty_like(v)
    chunk_bwd_dv_kernel[(triton.cdiv(V, BV), NT, B * H)](
        k, gc, A, do, dh, dv, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        GATE=gate, GS=gate_stride(gc), PREC=prec, **wide(q.dtype),
    )  # fmt: skip
    dq, dk, dg = chunk_bwd_dqk(q, k, v, gc, h, do, dh, dA, BT)
    if gate == 1:
        dg = dg.sum(-1, keepdim=True)  # a whole-head gate: the sum of its keys' gradients
    return dq, dk, dv, dg, dh0


def chunk_size_to_block(chunk_size: int) -> int:
    """The kernels' chunk: ``chunk_size`` rounded up to a power of two within [16, 64]. The result
    does not depend on it beyond rounding; 64 is what the kernels are laid out for."""
    return min(64, block_size(chunk_size))


class ChunkGatedRecurrenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, chunk_size: int):
        BT = chunk_size_to_block(chunk_size)
        gc = None if g is None else chunk_local_cumsum(g, BT)
        o, ht, A = chunk_fwd(q, k, v, gc, initial_state, BT)
        ctx.save_for_backward(q, k, v, gc, A, initial_state)
        ctx.BT = BT
        ctx.g_dtype = None if g is None else g.dtype
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, A, h0 = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        dq, dk, dv, dg, dh0 = chunk_bwd(q, k, v, gc, A, h0, do, dht, ctx.BT)
        dg = None if dg is None else dg.to(ctx.g_dtype)
        dh0 = None if h0 is None else dh0.to(h0.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv, dg, dh0, None


def chunk_gated_recurrence_kernel(q, k, v, g, *, initial_state, chunk_size: int = 64):
    """The chunkwise Triton kernels, whatever the length. Same contract as
    ``edgeattn.ops.common.chunk.chunk_gated_recurrence``: q, k [B, T, H, K], v [B, T, H, V],
    g None or [B, T, H, G] (G = 1 or K) log-gates, initial_state None or [B, H, K, V].
    Returns (o [B, T, H, V] unscaled in q's dtype, final state [B, H, K, V] float32); differentiable
    in q, k, v, g and initial_state."""
    q, k, v, g, initial_state = check_inputs(q, k, v, g, initial_state)
    if q.shape[1] == 0:
        return empty_sequence(q, v, initial_state)
    return ChunkGatedRecurrenceFunction.apply(q, k, v, g, initial_state, chunk_size)
