"""Chunkwise delta rule in Triton: forward and backward, for DeltaNet, Gated DeltaNet and KDA.

    S_t = exp(g_t) * S_{t-1},   S_t = S_t + beta_t k_t^T (v_t - k_t S_t),   o_t = scale * q_t S_t

with g None, one log-gate per head and token, or one per key (KDA). Tokens are cut into chunks of BT;
``b`` are the log-gates summed within a chunk (``utils.py``: float32 pairs, so gates down to -1e4 stay
exact), ``h[n]`` the state before chunk n, ``b_L`` the last ``b`` of the chunk. Within a chunk the
delta rule is a gated linear recurrence on corrected values ``v_new`` (the WY / UT form of Yang et
al. 2024):

    P[t, i]  = sum_k k_tk k_ik exp(b_tk - b_ik)  (i < t),   Tinv = (I + diag(beta) P)^-1
    w        = Tinv (beta * k * exp(b)),   u = Tinv (beta * v)
    v_new    = u - w h[n]
    o        = (q * exp(b)) h[n] + sum_{i <= t} Aqk[t, i] v_new_i,   Aqk[t, i] = sum_k q_tk k_ik exp(b_tk - b_ik)
    h[n + 1] = exp(b_L) * h[n] + (k * exp(b_L - b))^T v_new

(q already multiplied by ``scale``; the state starts at the initial state). Forward keeps Aqk, P
[B, T, HV, BT] and Tinv [B, NT, HV, BT, BT] float32 for backward, which recomputes w, u, v_new and
the per-chunk states.

What runs where:
  Triton (new here)   ``chunk_delta_fwd_h_kernel``: the sequential pass over chunks, v_new and h[n];
                      ``chunk_delta_bwd_dhu_kernel``: the sequential backward pass, from the last chunk:
                          dv_new = Aqk^T do + (k * exp(b_L - b)) dh[n],
                          dh[n - 1] = exp(b_L) dh[n] + (q * exp(b))^T do - w^T dv_new
                      (dh[n] the gradient of h[n + 1]).
  Triton (reused)     ``gated_chunk.py``: Aqk and P (its intra-chunk matrix, with q := k for P), the
                      output o, dAqk = do v_new^T, dq and dk of the recurrence on v_new and the
                      gate gradient of that part; the per-key intra-chunk backward also for P.
  PyTorch             per chunk, [BT, BT] and [BT, K] matrix products: the triangular solve for Tinv,
                      w and u, and their backward (dv, dbeta, the part of dk and dg that flows through
                      w and P); q and k repeated to the HV value heads (a copy when HV > H; q scaled in
                      the same pass) and their gradients summed back; the within-chunk reverse sum of
                      the WY part's gate gradient.
  Triton, opt-in      ``wy_fwd_kernel`` / ``wy_bwd_kernel``: the same WY algebra, one program per chunk and
                      head (Tinv by forward substitution), with EDGEATTN_DELTA_WY=triton; not yet timed
                      on a GPU (benchmarks/gpu_profile.py times both forms there).

Gate gradient: with ``db`` the gradient of the cumulative gate b, ``dg_t = sum_{s >= t in chunk} db_s +
sum_v h[n + 1] dh[n]``; the recurrence on v_new gives ``db = q dq - k dk`` (``gated_chunk.py``), the
WY part ``db = k * (dk_w + dk_row - dk_col)`` (k * exp(b) in w and as P's row, k * exp(-b) as P's column).

Layout: q, k [B, T, H, K], v [B, T, HV, V] (HV a multiple of H: key head h serves value heads
h * HV/H ... (h + 1) * HV/H - 1), beta [B, T, HV], g None, [B, T, HV] or [B, T, HV, K], states
[B, HV, K, V] float32. v_new, w, u are kept in the inputs' dtype (as fla does), sums and states in float32.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.kernels.gated_chunk import (
    BC,
    chunk_bwd_dA,
    chunk_bwd_dqk,
    chunk_bwd_dqk_intra_gk_kernel,
    chunk_fwd_A,
    chunk_fwd_o,
    chunk_size_to_block,
    launch,
    narrow,
)
from edgeattn.kernels.utils import (
    block_size,
    cast,
    chunk_local_cumsum,
    decay_to_chunk_end,
    dot,
    dot_precision,
    env_choice,
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
F = require("torch.nn.functional")


@triton.jit
def chunk_delta_fwd_h_kernel(
    k,
    w,
    u,
    gc,
    h,
    vn,
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
    # h[n] (the state before chunk n) and v_new = u - w h[n] for every chunk, then the final state.
    # v_new sums over keys: one program holds every key (BK >= K) of a [K, BV] slice of the state.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    vn += (bos * H + i_h) * V
    h += (i_b.to(tl.int64) * NT * H + i_h) * K * V  # h[b, 0, h]; chunk n is n * H * K * V further

    o_k, o_v, m_k, m_v, o_h, m_h = state_block(0, i_v, K, V, BK, BV)
    b_h = load_state(h0, i_bh, o_h, m_h, K, V, BK, BV, USE_H0)
    for i_t in range(NT):
        tl.store(h + o_h, b_h, mask=m_h)
        h += H * K * V
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        r_last = i_t * BT + BT - 1
        o_tk = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        o_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + o_tk, mask=m_tk, other=0)
        b_u = tl.load(u + o_tv, mask=m_tv, other=0).to(tl.float32)
        b_v = cast(b_u - dot(b_w, cast(b_h, b_w.dtype, PREC), PREC), vn.dtype.element_ty, PREC)
        tl.store(vn + o_tv, b_v, mask=m_tv)
        b_k = tl.load(k + o_tk, mask=m_tk, other=0)
        b_h, b_k = decay_to_chunk_end(
            b_h, b_k, gc, bos, i_h, o_t, o_k, m_k, r_last, T, H, K, GATE, GS, b_v.dtype, PREC
        )
        b_h += dot(tl.trans(b_k), b_v, PREC)
    tl.store(ht + i_bh.to(tl.int64) * K * V + o_h, b_h, mask=m_h)


@triton.jit
def chunk_delta_bwd_dhu_kernel(
    q,
    k,
    w,
    gc,
    A,
    do,
    dh,
    dv,
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
    # From the last chunk back: dh[n] (the gradient of h[n + 1]), dv_new of chunk n, then
    #   dh[n - 1] = exp(b_L) dh[n] + (q * exp(b))^T do - w^T dv_new;  finally dh0. q is already scaled.
    # dv_new sums over keys: one program holds every key (BK >= K).
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    A += (bos * H + i_h) * BT
    do += (bos * H + i_h) * V
    dv += (bos * H + i_h) * V
    dh += ((i_b.to(tl.int64) * NT + NT - 1) * H + i_h) * K * V  # dh[b, NT - 1, h], walked back

    o_k, o_v, m_k, m_v, o_h, m_h = state_block(0, i_v, K, V, BK, BV)
    b_dh = load_state(dht, i_bh, o_h, m_h, K, V, BK, BV, USE_DHT)
    for i_s in range(NT):
        i_t = NT - 1 - i_s
        tl.store(dh + o_h, b_dh, mask=m_h)
        dh -= H * K * V
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        r_last = i_t * BT + BT - 1
        o_tk = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        o_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + o_tk, mask=m_tk, other=0)
        b_k = tl.load(k + o_tk, mask=m_tk, other=0)
        b_w = tl.load(w + o_tk, mask=m_tk, other=0)
        b_do = cast(tl.load(do + o_tv, mask=m_tv, other=0), b_k.dtype, PREC)
        b_A = tl.load(A + o_t[:, None] * (H * BT) + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0)
        if GATE == 1:
            p_g = gc + GS * (bos * H + i_h)
            b_g, b_g_lo = gate_head(p_g, o_t, T, H, GS)
            b_gn, b_gn_lo = gate_head(p_g, r_last, T, H, GS)
            b_q = cast(b_q * tl.exp(b_g + b_g_lo)[:, None], b_q.dtype, PREC)
            b_k = cast(b_k * tl.exp((b_gn - b_g) + (b_gn_lo - b_g_lo))[:, None], b_k.dtype, PREC)
        elif GATE == 2:
            p_g = gc + GS * (bos * H + i_h) * K
            b_g, b_g_lo = gate_rows(p_g, o_t, o_k, m_k, T, H * K, GS)
            b_gn, b_gn_lo = gate_row(p_g, r_last, o_k, m_k, T, H * K, GS)
            b_q = cast(b_q * tl.exp(b_g + b_g_lo), b_q.dtype, PREC)
            b_k = cast(b_k * tl.exp((b_gn[None, :] - b_g) + (b_gn_lo[None, :] - b_g_lo)), b_k.dtype, PREC)
        b_dv = dot(cast(tl.trans(b_A), b_do.dtype, PREC), b_do, PREC)
        b_dv += dot(b_k, cast(b_dh, b_k.dtype, PREC), PREC)
        tl.store(dv + o_tv, b_dv, mask=m_tv)
        if GATE == 1:
            b_dh *= tl.exp(b_gn + b_gn_lo)
        elif GATE == 2:
            b_dh *= tl.exp(b_gn + b_gn_lo)[:, None]
        b_dh += dot(tl.trans(b_q), b_do, PREC)
        b_dh -= dot(tl.trans(b_w), cast(b_dv, b_w.dtype, PREC), PREC)
    tl.store(dh0 + i_bh.to(tl.int64) * K * V + o_h, b_dh, mask=m_h)


def _gate_kind(gc) -> int:
    """0: no gate, 1: one gate per head (G = 1), 2: one gate per key (G = K)."""
    return 0 if gc is None else (1 if gc.shape[-2] == 1 else 2)


def _blocks(K: int, V: int, dtype) -> tuple[int, int, int]:
    """(BK, BV, num_stages). Every key in one block (v_new and dv_new sum over them). Chosen from
    compiling for sm_80 and sm_90 at K = V = 64 and 128 (no GPU at hand; not timed): shared memory then
    stays under the 99 KB of consumer GPUs, except float32 with a whole-head gate at K = 64 (96 KB)."""
    BK = block_size(K)
    if dtype == torch.float32:  # tf32x3 dots: two pipeline stages would need up to 232 KB
        return BK, block_size(V, 16 if BK > 64 else 64), 1
    return BK, block_size(V, 32 if BK > 64 else 64), 2


def chunk_delta_fwd_h(k, w, u, gc, h0, BT: int):
    """States before every chunk h [B, NT, H, K, V] float32, v_new [B, T, H, V] in u's dtype and the
    final state [B, H, K, V] float32."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV, stages = _blocks(K, V, k.dtype)
    h = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=k.device)
    vn = torch.empty_like(u)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    chunk_delta_fwd_h_kernel[(triton.cdiv(V, BV), B * H)](
        k, w, u, gc, h, vn, h0, ht, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, GATE=_gate_kind(gc),
        USE_H0=h0 is not None, GS=gate_stride(gc), PREC=dot_precision(k.dtype),
        num_warps=launch(k.dtype)[0], num_stages=stages,
    )  # fmt: skip
    return h, vn, ht


def chunk_delta_bwd_dhu(q, k, w, gc, A, do, dht, BT: int):
    """dh [B, NT, H, K, V] (dh[n] the gradient of h[n + 1]), dv_new [B, T, H, V] and dh0 [B, H, K, V],
    all float32."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV, stages = _blocks(K, V, q.dtype)
    dh = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=q.device)
    dv = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    chunk_delta_bwd_dhu_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, w, gc, A, do, dh, dv, dht, dh0, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, GATE=_gate_kind(gc),
        USE_DHT=dht is not None, GS=gate_stride(gc), PREC=dot_precision(q.dtype),
        num_warps=launch(q.dtype)[0], num_stages=stages,
    )  # fmt: skip
    return dh, dv, dh0


# -- per-chunk pieces in PyTorch ------------------------------------------------------------------


def chunked(x, BT: int, pad_last: bool = False):
    """[B, T, H, D] -> [B, NT, H, BT, D] float32, the tokens padded to NT * BT with zeros (or, with
    ``pad_last``, with the last token: cumulative gates of padding do not decay)."""
    B, T, H, D = x.shape
    pad = triton.cdiv(T, BT) * BT - T
    x = x.float()
    if pad:
        x = torch.cat([x, x[:, -1:].expand(B, pad, H, D)], 1) if pad_last else F.pad(x, (0, 0, 0, 0, 0, pad))
    return x.view(B, -1, BT, H, D).transpose(2, 3)


def unchunked(x, T: int):
    """[B, NT, H, BT, D] -> [B, T, H, D]."""
    B, NT, H, BT, D = x.shape
    return x.transpose(2, 3).reshape(B, NT * BT, H, D)[:, :T]


def gate_factors(gc, BT: int):
    """(exp(b) [B, NT, H, BT, G], the strictly lower [BT, BT] mask of exp(b_t - b_i) [B, NT, H, BT, BT]
    for a whole-head gate (None for a per-key one)) from the cumulative gates, or (None, None)."""
    if gc is None:
        return None, None
    hi = chunked(gc[..., 0], BT, pad_last=True)
    lo = chunked(gc[..., 1], BT, pad_last=True) if gc.shape[-1] == 2 else torch.zeros_like(hi)
    gamma = torch.exp(hi + lo)
    if gc.shape[-2] != 1:
        return gamma, None
    hi, lo = hi.squeeze(-1), lo.squeeze(-1)
    d = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])  # b_t - b_i
    strict = torch.ones(BT, BT, dtype=torch.bool, device=gc.device).tril(-1)
    return gamma, torch.exp(d.masked_fill(~strict, float("-inf")))


def wy_fwd(k, v, beta, gamma, P, BT: int):
    """Tinv [B, NT, H, BT, BT] float32, w [B, T, H, K] in k's dtype, u [B, T, H, V] in v's dtype."""
    T = k.shape[1]
    kc, vc, bc = chunked(k, BT), chunked(v, BT), chunked(beta.unsqueeze(-1), BT)
    kg = kc if gamma is None else kc * gamma
    # unitriangular: the solve reads only the strictly lower part, the diagonal is taken as 1
    eye = torch.eye(BT, dtype=torch.float32, device=k.device)
    Tinv = torch.linalg.solve_triangular(bc * chunked(P, BT), eye, upper=False, unitriangular=True)
    w = unchunked(Tinv @ (bc * kg), T).to(k.dtype).contiguous()
    u = unchunked(Tinv @ (bc * vc), T).to(v.dtype).contiguous()
    return Tinv, w, u


def wy_bwd(k, v, beta, gamma, L, P, Tinv, h, dvn, gc, BT: int):
    """Through v_new = u - w h[n]: returns dv, dbeta, dk [B, T, H, *] and db (the gradient of the
    cumulative gate per key, still in chunks [B, NT, H, BT, K]; None without a gate) of the WY part,
    all float32."""
    T = k.shape[1]
    kc, vc, bc = chunked(k, BT), chunked(v, BT), chunked(beta.unsqueeze(-1), BT)
    kg = kc if gamma is None else kc * gamma
    du = chunked(dvn, BT)  # [B, NT, H, BT, V]
    dw = -(du @ h.transpose(-1, -2))  # [B, NT, H, BT, K]
    Tt = Tinv.transpose(-1, -2)
    Tt_du, Tt_dw = Tt @ du, Tt @ dw
    dTinv = du @ (bc * vc).transpose(-1, -2) + dw @ (bc * kg).transpose(-1, -2)
    dM = -(Tt @ dTinv @ Tt).tril(-1)  # M = I + diag(beta) P, strictly lower
    Pc = chunked(P, BT).tril(-1)
    dv = bc * Tt_du
    dbeta = (vc * Tt_du).sum(-1) + (kg * Tt_dw).sum(-1) + (dM * Pc).sum(-1)
    dk_w = bc * Tt_dw if gamma is None else bc * gamma * Tt_dw
    dP = bc * dM  # [B, NT, H, BT, BT]
    if gc is not None and gc.shape[-2] != 1:
        # per-key gate: P's [BT, BT, K] factors are built in sub-chunks by the Triton kernel
        dk_row, dk_col = intra_gk_bwd(k, gc, unchunked(dP, T).contiguous(), BT)
        dk_row, dk_col = chunked(dk_row, BT), chunked(dk_col, BT)
    else:
        dPL = dP if L is None else dP * L
        dk_row, dk_col = dPL @ kc, dPL.transpose(-1, -2) @ kc
    dk = dk_w + dk_row + dk_col
    db = None if gc is None else kc * (dk_w + dk_row - dk_col)
    return unchunked(dv, T), unchunked(dbeta.unsqueeze(-1), T).squeeze(-1), unchunked(dk, T), db


def intra_gk_bwd(k, gc, dP, BT: int):
    """Per-key gate: dk_row_t = sum_{i<t} dP[t, i] k_i exp(b_t - b_i), dk_col_i = sum_{t>i} dP[t, i]
    k_t exp(b_t - b_i), [B, T, H, K] float32 each (the intra-chunk dq/dk kernel with q := k)."""
    B, T, H, K = k.shape
    BK = block_size(K, 64)
    NT = triton.cdiv(T, BT)
    dk_row = torch.empty(B, T, H, K, dtype=torch.float32, device=k.device)
    dk_col = torch.empty(B, T, H, K, dtype=torch.float32, device=k.device)
    chunk_bwd_dqk_intra_gk_kernel[(triton.cdiv(K, BK), NT * (BT // BC), B * H)](
        k, k, gc, dP, dk_row, dk_col, T, H=H, K=K, BT=BT, BC=BC, BK=BK, GS=gate_stride(gc),
        PREC=dot_precision(k.dtype),
        **narrow(k.dtype),
    )  # fmt: skip
    return dk_row, dk_col


# -- the WY part in Triton (EDGEATTN_DELTA_WY=triton; PyTorch's by default until timed on a GPU) ----------

# On an H200 (RESULTS.md, 2026-11-28) the PyTorch WY part took ~9 of gated_delta's 12.3 ms forward +
# backward (B=8, T=2048, H=16, K=V=128): ~60 small kernels and float32 GEMMs on the CUDA cores, where fla
# runs three Triton kernels. These two kernels do the same algebra as wy_fwd / wy_bwd; they are tested
# against them in Triton's interpreter and not yet timed on a GPU, so PyTorch's stays the default.
WY_FORMS = ("torch", "triton")
WY = "torch"


def wy_form() -> str:
    """EDGEATTN_DELTA_WY (torch or triton), else the module's WY: where the WY part runs."""
    return env_choice("EDGEATTN_DELTA_WY", WY_FORMS, WY)


@triton.jit
def chunk_keys(
    k,
    gc,
    bos,
    i_h,
    o_t,
    m_t,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    GS: tl.constexpr,
):
    """One chunk's keys of one head as float32 [BT, BK], their decays exp(b) ([BT, 1] for a whole-head gate,
    [BT, BK] per key, [1, 1] ones without a gate), and the keys' offsets and masks."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    o_tk = (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_k = tl.load(k + o_tk, mask=m_tk, other=0).to(tl.float32)
    if GATE == 1:
        b_g, b_g_lo = gate_head(gc + GS * (bos * H + i_h), o_t, T, H, GS)
        b_gam = tl.exp(b_g + b_g_lo)[:, None]
    elif GATE == 2:
        b_g, b_g_lo = gate_rows(gc + GS * (bos * H + i_h) * K, o_t, o_k, m_k, T, H * K, GS)
        b_gam = tl.exp(b_g + b_g_lo)
    else:
        b_gam = tl.full([1, 1], 1.0, tl.float32)
    return b_k, b_gam, o_k, m_k, o_tk, m_tk


@triton.jit
def wy_chunk(beta, T, H: tl.constexpr, BT: tl.constexpr):
    """The WY kernels' program (chunk i_t of batch and head i_bh): i_h, bos, i_n (the chunk's index in the
    [B, NT, H] blocks of Tinv and h), the chunk's row offsets o_i and tokens o_t with their mask m_t, and its
    betas [BT] float32."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    i_n = (i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t) * H + i_h
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0).to(tl.float32)
    return i_h, bos, i_n, o_i, o_t, m_t, b_beta


@triton.jit
def wy_fwd_kernel(
    k,
    v,
    beta,
    gc,
    P,
    Tinv,
    w,
    u,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    SOLVE: tl.constexpr,
    GS: tl.constexpr,
    PREC: tl.constexpr,
):
    # One chunk of one head: Tinv = (I + diag(beta) P_strict)^-1 by forward substitution (SOLVE; else read
    # back), then w = Tinv (beta * k * exp(b)) and u = Tinv (beta * v). Sums and dots in float32.
    i_h, bos, i_n, o_i, o_t, m_t, b_beta = wy_chunk(beta, T, H, BT)
    p_T = Tinv + i_n * BT * BT + o_i[:, None] * BT + o_i[None, :]
    if SOLVE:
        b_P = tl.load(P + ((bos + o_t) * H + i_h)[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0)
        b_N = tl.where(o_i[:, None] > o_i[None, :], b_beta[:, None] * b_P, 0)
        b_X = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
        for i in range(1, BT):  # row i of X = e_i - N[i, :] X (rows < i final, N[i, j >= i] = 0)
            b_row = tl.sum(tl.where(o_i[:, None] == i, b_N, 0), axis=0)
            b_new = tl.sum(b_row[:, None] * b_X, axis=0)
            b_X = tl.where(o_i[:, None] == i, b_X - b_new[None, :], b_X)
        tl.store(p_T, b_X)
    else:
        b_X = tl.load(p_T)

    b_k, b_gam, o_k, m_k, o_tk, m_tk = chunk_keys(k, gc, bos, i_h, o_t, m_t, T, H, K, BK, GATE, GS)
    b_w = dot(b_X, b_beta[:, None] * b_k * b_gam, PREC)
    tl.store(w + o_tk, b_w.to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        o_tv = (bos + o_t)[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v + o_tv, mask=m_tv, other=0).to(tl.float32)
        b_u = dot(b_X, b_beta[:, None] * b_v, PREC)
        tl.store(u + o_tv, b_u.to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def wy_bwd_kernel(
    k,
    v,
    beta,
    gc,
    P,
    Tinv,
    h,
    dvn,
    dv,
    dbeta,
    dk,
    dP,
    db,
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
    # The backward of v_new = u - w h[n] through w, u, Tinv and P, one chunk of one head (wy_bwd's
    # algebra). No gate or a whole-head one: dk complete (w's part, P's rows and columns) and the gate's
    # db, summed over keys and over the later tokens of the chunk. A per-key gate: dk of w's part and dP;
    # P's part runs in the per-key intra-chunk kernel.
    i_h, bos, i_n, o_i, o_t, m_t, b_beta = wy_chunk(beta, T, H, BT)
    strict = o_i[:, None] > o_i[None, :]
    b_Tt = tl.load(Tinv + i_n * BT * BT + o_i[None, :] * BT + o_i[:, None])  # Tinv transposed
    o_tA = ((bos + o_t) * H + i_h)[:, None] * BT + o_i[None, :]
    b_P = tl.where(strict, tl.load(P + o_tA, mask=m_t[:, None], other=0), 0)

    b_k, b_gam, o_k, m_k, o_tk, m_tk = chunk_keys(k, gc, bos, i_h, o_t, m_t, T, H, K, BK, GATE, GS)
    b_kg = b_k * b_gam

    p_h = h + i_n * K * V
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)  # dbeta
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        o_tv = (bos + o_t)[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_du = tl.load(dvn + o_tv, mask=m_tv, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_tv, other=0).to(tl.float32)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_dw -= dot(b_du, tl.trans(b_h), PREC)
        b_Ttdu = dot(b_Tt, b_du, PREC)
        tl.store(dv + o_tv, b_beta[:, None] * b_Ttdu, mask=m_tv)
        b_db += tl.sum(b_v * b_Ttdu, axis=1)
        b_dT += dot(b_du, tl.trans(b_beta[:, None] * b_v), PREC)
    b_Ttdw = dot(b_Tt, b_dw, PREC)
    b_dT += dot(b_dw, tl.trans(b_beta[:, None] * b_kg), PREC)
    b_db += tl.sum(b_kg * b_Ttdw, axis=1)
    b_dkw = b_beta[:, None] * b_gam * b_Ttdw
    b_dM = -dot(dot(b_Tt, b_dT, PREC), b_Tt, PREC)
    b_dM = tl.where(strict, b_dM, 0)
    b_db += tl.sum(b_dM * b_P, axis=1)
    tl.store(dbeta + (bos + o_t) * H + i_h, b_db, mask=m_t)
    b_dP = b_beta[:, None] * b_dM
    if GATE == 2:
        tl.store(dP + o_tA, b_dP, mask=m_t[:, None])
        tl.store(dk + o_tk, b_dkw, mask=m_tk)
    else:
        if GATE == 1:
            b_g, b_g_lo = gate_head(gc + GS * (bos * H + i_h), o_t, T, H, GS)
            b_d = (b_g[:, None] - b_g[None, :]) + (b_g_lo[:, None] - b_g_lo[None, :])
            b_dP *= tl.exp(tl.where(strict, b_d, float("-inf")))
        b_row = dot(b_dP, b_k, PREC)
        b_col = dot(tl.trans(b_dP), b_k, PREC)
        tl.store(dk + o_tk, b_dkw + b_row + b_col, mask=m_tk)
        if GATE == 1:
            b_g1 = tl.sum(b_k * (b_dkw + b_row - b_col), axis=1)  # [BT]: summed over keys
            b_rev = tl.sum(b_g1, axis=0) - tl.cumsum(b_g1, axis=0) + b_g1  # over s >= t in the chunk
            tl.store(db + (bos + o_t) * H + i_h, b_rev, mask=m_t)


def wy_launch(dtype) -> dict:
    """The narrow kernels' warps, one stage: a second stage took wy_bwd_kernel to 128 KB of shared memory
    at K = 128 on sm_80 (float32 inputs), over the 99 KB of consumer GPUs."""
    return dict(num_warps=narrow(dtype)["num_warps"], num_stages=1)


def wy_fwd_triton(k, v, beta, gc, P, BT: int, Tinv=None):
    """wy_fwd in one Triton kernel from the cumulative gates: (Tinv, w, u); with ``Tinv`` given, w and u
    recomputed from it (backward)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    solve = Tinv is None
    if solve:
        Tinv = torch.empty(B, NT, H, BT, BT, dtype=torch.float32, device=k.device)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    wy_fwd_kernel[(NT, B * H)](
        k, v, beta, gc, P, Tinv, w, u, T, H=H, K=K, V=V, BT=BT, BK=block_size(K), BV=block_size(V, 64),
        GATE=_gate_kind(gc), SOLVE=solve, GS=gate_stride(gc), PREC=dot_precision(torch.float32),
        **wy_launch(k.dtype),
    )  # fmt: skip
    return Tinv, w, u


def wy_bwd_triton(k, v, beta, gc, P, Tinv, h, dvn, BT: int):
    """wy_bwd in Triton: (dv, dbeta, dk of the WY part, db) with db as chunk_delta_bwd adds it: a per-key
    gate's per key, still to be summed over the chunk's later tokens ([B, NT, H, BT, K]); a whole-head
    gate's already summed over keys and later tokens ([B, T, H, 1]); None without a gate."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    gate = _gate_kind(gc)
    dv = torch.empty(B, T, H, V, dtype=torch.float32, device=k.device)
    dbeta = torch.empty(B, T, H, dtype=torch.float32, device=k.device)
    dk = torch.empty(B, T, H, K, dtype=torch.float32, device=k.device)
    dP = torch.empty(B, T, H, BT, dtype=torch.float32, device=k.device) if gate == 2 else None
    db = torch.empty(B, T, H, dtype=torch.float32, device=k.device) if gate == 1 else None
    wy_bwd_kernel[(NT, B * H)](
        k, v, beta, gc, P, Tinv, h, dvn, dv, dbeta, dk, dP, db, T, H=H, K=K, V=V, BT=BT, BK=block_size(K),
        BV=block_size(V, 32), GATE=gate, GS=gate_stride(gc), PREC=dot_precision(torch.float32),
        **wy_launch(k.dtype),
    )  # fmt: skip
    if gate == 1:
        return dv, dbeta, dk, db.unsqueeze(-1)
    if gate == 0:
        return dv, dbeta, dk, None
    dk_row, dk_col = intra_gk_bwd(k, gc, dP, BT)
    kc = chunked(k, BT)
    dk_w = chunked(dk, BT)
    db_k = kc * (dk_w + chunked(dk_row, BT) - chunked(dk_col, BT))
    return dv, dbeta, dk + dk_row + dk_col, db_k


# -- launchers and autograd -----------------------------------------------------------------------


def chunk_delta_fwd(q, k, v, beta, gc, h0, BT: int, wy: str = "torch"):
    """q (scaled), k [B, T, HV, K] at the value heads. Returns o, the final state and what backward
    keeps: Aqk, P [B, T, HV, BT], Tinv [B, NT, HV, BT, BT]."""
    Aqk = chunk_fwd_A(q, k, gc, BT)
    P = chunk_fwd_A(k, k, gc, BT)  # its diagonal k_t . k_t is not used
    if wy == "triton":
        Tinv, w, u = wy_fwd_triton(k, v, beta, gc, P, BT)
    else:
        gamma, _ = gate_factors(gc, BT)
        Tinv, w, u = wy_fwd(k, v, beta, gamma, P, BT)
    h, vn, ht = chunk_delta_fwd_h(k, w, u, gc, h0, BT)
    o = chunk_fwd_o(q, vn, gc, h, Aqk, BT)
    return o, ht, Aqk, P, Tinv


def chunk_delta_bwd(q, k, v, beta, gc, Aqk, P, Tinv, h0, do, dht, BT: int, wy: str = "torch"):
    """Returns (dq, dk, dv, dbeta, dg [B, T, HV, G] or None, dh0), float32, at the value heads."""
    T = q.shape[1]
    triton_wy = wy == "triton"
    if triton_wy:
        _, w, u = wy_fwd_triton(k, v, beta, gc, P, BT, Tinv=Tinv)
    else:
        gamma, L = gate_factors(gc, BT)
        kc, vc, bc = chunked(k, BT), chunked(v, BT), chunked(beta.unsqueeze(-1), BT)
        kg = kc if gamma is None else kc * gamma
        w = unchunked(Tinv @ (bc * kg), T).to(k.dtype).contiguous()
        u = unchunked(Tinv @ (bc * vc), T).to(v.dtype).contiguous()
    h, vn, _ = chunk_delta_fwd_h(k, w, u, gc, h0, BT)  # recomputed, as gated_chunk.py does

    dAqk = chunk_bwd_dA(vn, do, BT)
    dh, dvn, dh0 = chunk_delta_bwd_dhu(q, k, w, gc, Aqk, do, dht, BT)
    dq, dk, dg = chunk_bwd_dqk(q, k, vn, gc, h, do, dh, dAqk, BT)
    if triton_wy:
        dv, dbeta, dk_wy, db_wy = wy_bwd_triton(k, v, beta, gc, P, Tinv, h, dvn, BT)
        dk = dk + dk_wy
        if gc is not None and gc.shape[-2] == 1:  # db_wy already summed over keys and later tokens
            return dq, dk, dv, dbeta, dg.sum(-1, keepdim=True) + db_wy, dh0
    else:
        dv, dbeta, dk_wy, db_wy = wy_bwd(k, v, beta, gamma, L, P, Tinv, h, dvn, gc, BT)
        dk = dk + dk_wy
    if gc is not None:
        # the WY part's db is summed over the later tokens of its chunk, as the recurrence's dg already is
        dg = dg + unchunked(db_wy.flip(-2).cumsum(-2).flip(-2), T)
        if gc.shape[-2] == 1:
            dg = dg.sum(-1, keepdim=True)  # a whole-head gate: the sum of its keys' gradients
    return dq, dk, dv, dbeta, dg, dh0


class ChunkDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, initial_state, scale: float, chunk_size: int):
        BT = chunk_size_to_block(chunk_size)
        H, HV = q.shape[2], v.shape[2]
        # [B, T, HV, K]: each key head repeated for the value heads it serves; q scaled once here
        qe = (q.repeat_interleave(HV // H, dim=2) * scale).to(q.dtype)
        ke = k.repeat_interleave(HV // H, dim=2) if HV != H else k
        gc = None if g is None else chunk_local_cumsum(g, BT)
        ctx.wy = wy_form()  # the backward runs the form the forward ran
        o, ht, Aqk, P, Tinv = chunk_delta_fwd(qe, ke, v, beta, gc, initial_state, BT, ctx.wy)
        ctx.save_for_backward(qe, ke, v, beta, gc, Aqk, P, Tinv, initial_state)
        ctx.BT, ctx.scale, ctx.H = BT, scale, H
        ctx.g_dtype = None if g is None else g.dtype
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        qe, ke, v, beta, gc, Aqk, P, Tinv, h0 = ctx.saved_tensors
        do = torch.zeros_like(v, dtype=qe.dtype) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        dq, dk, dv, dbeta, dg, dh0 = chunk_delta_bwd(
            qe, ke, v, beta, gc, Aqk, P, Tinv, h0, do, dht, ctx.BT, ctx.wy
        )
        B, T, HV, K = dq.shape
        dq = dq.view(B, T, ctx.H, HV // ctx.H, K).sum(3) * ctx.scale  # back to the key heads
        dk = dk.view(B, T, ctx.H, HV // ctx.H, K).sum(3)
        dg = None if dg is None else dg.to(ctx.g_dtype)
        dh0 = None if h0 is None else dh0.to(h0.dtype)
        return dq.to(qe.dtype), dk.to(ke.dtype), dv.to(v.dtype), dbeta.to(beta.dtype), dg, dh0, None, None


def check_delta_inputs(q, k, v, beta, g, initial_state):
    """Shapes and dtypes of the contract; returns them contiguous, g as [B, T, HV, 1 or K], the state
    float32."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [B, T, H, K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % H != 0:
        raise ValueError(
            f"v must be [B, T, HV, V] with B, T of q and HV a multiple of H = {H}, got {tuple(v.shape)}"
        )
    HV, V = v.shape[2], v.shape[3]
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q, k, v must share one dtype of float32/bfloat16/float16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if K > 128:  # one block holds every key; larger ones would not fit shared memory
        raise ValueError(f"the Triton delta-rule kernels take head sizes K <= 128, got {K}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if g is not None:
        if tuple(g.shape) == (B, T, HV):
            g = g.unsqueeze(-1)
        elif g.dim() != 4 or g.shape[:3] != v.shape[:3] or g.shape[3] not in (1, K):
            raise ValueError(
                f"g must be None, [B, T, HV] = {(B, T, HV)}, [B, T, HV, 1] or [B, T, HV, K], got {tuple(g.shape)}"
            )
        g = g.contiguous()
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, HV, K, V):
            raise ValueError(
                f"initial_state must be [B, HV, K, V] = {(B, HV, K, V)}, got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.float().contiguous()
    return q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), g, initial_state


def chunk_delta_rule_triton(q, k, v, beta, g=None, *, scale: float, initial_state=None, chunk_size: int = 64):
    """The chunkwise delta rule in Triton (see the module docstring): q, k [B, T, H, K], v [B, T, HV, V],
    beta [B, T, HV], g None, [B, T, HV], [B, T, HV, 1] or [B, T, HV, K] log-gates, initial_state None or
    [B, HV, K, V]. ``scale`` (required: the output is ``scale * q S``, no default to apply twice). Returns (o [B, T, HV, V] in q's dtype, final state
    [B, HV, K, V] float32); differentiable in q, k, v, beta, g and initial_state. ``chunk_size`` is
    only a tile (rounded to a power of two in [16, 64])."""
    q, k, v, beta, g, initial_state = check_delta_inputs(q, k, v, beta, g, initial_state)
    B, T, H, K = q.shape
    if T == 0:
        S = (
            initial_state
            if initial_state is not None
            else q.new_zeros(B, v.shape[2], K, v.shape[3], dtype=torch.float32)
        )
        return torch.zeros_like(v, dtype=q.dtype), S
    o, ht = ChunkDeltaRuleFunction.apply(q, k, v, beta, g, initial_state, float(scale), chunk_size)
    return o, ht
