"""FLASH mixed-chunk attention in Triton: forward and backward, for training (no initial state).

Chunks are the aligned groups of C tokens from the start. For token t of chunk n:

    o_t = sum_{j in n, j <= t} relu(a * qq_t . kq_j + b_{t-j})^2 v_j + c * ql_t H_n
    H_n = sum_{m < n} kl_m^T v_m

Forward: one program per (block of BE value columns, sequence) walks the chunks in order, carrying
H_n [S, BE] in registers: the quadratic part is a masked [C, C] matrix per chunk, the linear part a
product with the carried state.

Backward, with P = relu(s)^2 (masked) and s = a qq kq^T + b:
  * per chunk (``flash_bwd_quad_kernel``, all value columns): dP = do v^T, ds = 2 relu(s) dP,
    dqq = a ds kq, dkq = a ds^T qq, db[d] = sum of ds over the diagonal t - j = d (ds goes through a
    per-program scratch and is read back skewed);
  * per (value block, sequence) (``flash_bwd_lin_kernel``): dql_n = c do_n H_n^T forward, then
    backward over chunks with G_m = c sum_{n>m} ql_n^T do_n: dv_m = P_m^T do_m + kl_m G_m,
    dkl_m = v_m G_m^T. dql and dkl are summed over the value blocks afterwards.

Everything is computed in float32 (16-bit inputs are widened when loaded). Layout: q_*, k_* [B, T, S],
v [B, T, E]; C need not be a power of two (tiles of BT = next power of two >= C, masked).
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.kernels.utils import block_size, dot, dot_precision

torch = require("torch")
triton = require("triton")
tl = require("triton.language")


@triton.jit
def _scores(
    qq, kq, bias, o_t, m_t, o_c, o_s, m_s, quad_scale,
    S: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """s = a qq kq^T + b and the causal mask of one chunk, [BT, BT] float32."""
    m_ts = m_t[:, None] & m_s[None, :]
    o_ts = o_t[:, None] * S + o_s[None, :]
    b_qq = tl.load(qq + o_ts, mask=m_ts, other=0).to(tl.float32)
    b_kq = tl.load(kq + o_ts, mask=m_ts, other=0).to(tl.float32)
    b_s = dot(b_qq, tl.trans(b_kq), PREC) * quad_scale
    m_c = (o_c[:, None] >= o_c[None, :]) & m_t[:, None] & m_t[None, :]
    if HAS_BIAS:
        b_s += tl.load(bias + (o_c[:, None] - o_c[None, :]), mask=m_c, other=0).to(tl.float32)
    return b_s, m_c, b_qq, b_kq


@triton.jit
def flash_fwd_kernel(
    qq, kq, ql, kl, v, bias, o, T, quad_scale, lin_scale,
    S: tl.constexpr, E: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    BE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_e, i_b = tl.program_id(0), tl.program_id(1)
    qq += i_b.to(tl.int64) * T * S
    kq += i_b.to(tl.int64) * T * S
    ql += i_b.to(tl.int64) * T * S
    kl += i_b.to(tl.int64) * T * S
    v += i_b.to(tl.int64) * T * E
    o += i_b.to(tl.int64) * T * E
    o_c = tl.arange(0, BT)
    o_s = tl.arange(0, BS)
    m_s = o_s < S
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    b_h = tl.zeros([BS, BE], dtype=tl.float32)
    for i_n in range(tl.cdiv(T, C)):
        o_t = i_n * C + o_c
        m_t = (o_c < C) & (o_t < T)
        b_s, m_c, _, _ = _scores(qq, kq, bias, o_t, m_t, o_c, o_s, m_s, quad_scale, S, HAS_BIAS, PREC)
        b_p = tl.where(m_c, tl.maximum(b_s, 0) * tl.maximum(b_s, 0), 0)
        m_te = m_t[:, None] & m_e[None, :]
        b_v = tl.load(v + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        m_ts = m_t[:, None] & m_s[None, :]
        b_ql = tl.load(ql + o_t[:, None] * S + o_s[None, :], mask=m_ts, other=0).to(tl.float32)
        b_kl = tl.load(kl + o_t[:, None] * S + o_s[None, :], mask=m_ts, other=0).to(tl.float32)
        b_o = dot(b_p, b_v, PREC) + lin_scale * dot(b_ql, b_h, PREC)
        tl.store(o + o_t[:, None] * E + o_e[None, :], b_o.to(o.dtype.element_ty), mask=m_te)
        b_h += dot(tl.trans(b_kl), b_v, PREC)


@triton.jit
def flash_bwd_quad_kernel(
    qq, kq, v, bias, do, dqq, dkq, ds, db, T, quad_scale,
    S: tl.constexpr, E: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    BE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_n, i_b = tl.program_id(0), tl.program_id(1)
    NC = tl.cdiv(T, C)
    qq += i_b.to(tl.int64) * T * S
    kq += i_b.to(tl.int64) * T * S
    dqq += i_b.to(tl.int64) * T * S
    dkq += i_b.to(tl.int64) * T * S
    v += i_b.to(tl.int64) * T * E
    do += i_b.to(tl.int64) * T * E
    o_c = tl.arange(0, BT)
    o_s = tl.arange(0, BS)
    m_s = o_s < S
    o_t = i_n * C + o_c
    m_t = (o_c < C) & (o_t < T)
    b_s, m_c, b_qq, b_kq = _scores(qq, kq, bias, o_t, m_t, o_c, o_s, m_s, quad_scale, S, HAS_BIAS, PREC)
    b_dp = tl.zeros([BT, BT], dtype=tl.float32)
    for i_e in range(tl.cdiv(E, BE)):
        o_e = i_e * BE + tl.arange(0, BE)
        m_te = m_t[:, None] & (o_e < E)[None, :]
        b_v = tl.load(v + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        b_do = tl.load(do + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        b_dp += dot(b_do, tl.trans(b_v), PREC)
    b_ds = tl.where(m_c, 2 * tl.maximum(b_s, 0) * b_dp, 0)  # the gradient of s
    m_ts = m_t[:, None] & m_s[None, :]
    o_ts = o_t[:, None] * S + o_s[None, :]
    tl.store(dqq + o_ts, quad_scale * dot(b_ds, b_kq, PREC), mask=m_ts)
    tl.store(dkq + o_ts, quad_scale * dot(tl.trans(b_ds), b_qq, PREC), mask=m_ts)
    if HAS_BIAS:
        # db[d] = sum_t ds[t, t - d]: through this program's own scratch, read back skewed.
        p_ds = ds + (i_b.to(tl.int64) * NC + i_n) * BT * BT
        tl.store(p_ds + o_c[:, None] * BT + o_c[None, :], b_ds)
        tl.debug_barrier()
        m_d = (o_c[:, None] >= o_c[None, :]) & (o_c[:, None] < C)  # rows t, columns d <= t
        b_sk = tl.load(p_ds + o_c[:, None] * BT + (o_c[:, None] - o_c[None, :]), mask=m_d, other=0)
        tl.store(db + (i_b.to(tl.int64) * NC + i_n) * BT + o_c, tl.sum(b_sk, axis=0))


@triton.jit
def flash_bwd_lin_kernel(
    qq, kq, ql, kl, v, bias, do, dql, dkl, dv, T, quad_scale, lin_scale,
    S: tl.constexpr, E: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    BE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_e, i_b = tl.program_id(0), tl.program_id(1)
    B = tl.num_programs(1)
    qq += i_b.to(tl.int64) * T * S
    kq += i_b.to(tl.int64) * T * S
    ql += i_b.to(tl.int64) * T * S
    kl += i_b.to(tl.int64) * T * S
    v += i_b.to(tl.int64) * T * E
    do += i_b.to(tl.int64) * T * E
    dv += i_b.to(tl.int64) * T * E
    # dql, dkl: [NE, B, T, S] partial sums, one slice per value block
    dql += (i_e.to(tl.int64) * B + i_b) * T * S
    dkl += (i_e.to(tl.int64) * B + i_b) * T * S
    NC = tl.cdiv(T, C)
    o_c = tl.arange(0, BT)
    o_s = tl.arange(0, BS)
    m_s = o_s < S
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E

    b_h = tl.zeros([BS, BE], dtype=tl.float32)
    for i_n in range(NC):
        o_t = i_n * C + o_c
        m_t = (o_c < C) & (o_t < T)
        m_te = m_t[:, None] & m_e[None, :]
        m_ts = m_t[:, None] & m_s[None, :]
        o_ts = o_t[:, None] * S + o_s[None, :]
        b_do = tl.load(do + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        b_v = tl.load(v + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        b_kl = tl.load(kl + o_ts, mask=m_ts, other=0).to(tl.float32)
        tl.store(dql + o_ts, lin_scale * dot(b_do, tl.trans(b_h), PREC), mask=m_ts)
        b_h += dot(tl.trans(b_kl), b_v, PREC)

    b_g = tl.zeros([BS, BE], dtype=tl.float32)
    for i_r in range(NC):
        i_n = NC - 1 - i_r
        o_t = i_n * C + o_c
        m_t = (o_c < C) & (o_t < T)
        m_te = m_t[:, None] & m_e[None, :]
        m_ts = m_t[:, None] & m_s[None, :]
        o_ts = o_t[:, None] * S + o_s[None, :]
        b_s, m_c, _, _ = _scores(qq, kq, bias, o_t, m_t, o_c, o_s, m_s, quad_scale, S, HAS_BIAS, PREC)
        b_p = tl.where(m_c, tl.maximum(b_s, 0) * tl.maximum(b_s, 0), 0)
        b_do = tl.load(do + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        b_v = tl.load(v + o_t[:, None] * E + o_e[None, :], mask=m_te, other=0).to(tl.float32)
        b_kl = tl.load(kl + o_ts, mask=m_ts, other=0).to(tl.float32)
        b_ql = tl.load(ql + o_ts, mask=m_ts, other=0).to(tl.float32)
        b_dv = dot(tl.trans(b_p), b_do, PREC) + dot(b_kl, b_g, PREC)
        tl.store(dv + o_t[:, None] * E + o_e[None, :], b_dv, mask=m_te)
        tl.store(dkl + o_ts, dot(b_v, tl.trans(b_g), PREC), mask=m_ts)
        b_g += lin_scale * dot(tl.trans(b_ql), b_do, PREC)


# Launch settings: one pipeline stage and 8 warps. Compiled for sm_90 (no GPU at hand), float32
# inputs, tf32x3 dots, E = 1024, BE = 64, the largest shared memory of the three kernels: 64 KB at
# C = S = 64, 96 KB at C = 64, S = 128, 192 KB at C = 128, S = 64 (fits sm_90's 227 KB, not sm_80's
# 163 KB) and 256 KB at C = S = 128 (fits no GPU), hence MAX_TILE. Not run or timed on a GPU.
WARPS, STAGES = 8, 1
MAX_TILE = 64 * 128  # the largest [chunk, S] tile (powers of two) the kernels take


def covers(chunk_size: int, S: int) -> bool:
    """Whether the kernels take this chunk size and query/key size (their [C, S] tiles fit)."""
    return block_size(chunk_size) * block_size(S) <= MAX_TILE


def _blocks(C: int, S: int, E: int) -> tuple[int, int, int]:
    return block_size(C), block_size(S), block_size(E, 64)


def flash_fwd(qq, kq, ql, kl, v, bias, C, quad_scale, lin_scale):
    B, T, S = qq.shape
    E = v.shape[-1]
    BT, BS, BE = _blocks(C, S, E)
    o = torch.empty(B, T, E, dtype=qq.dtype, device=qq.device)
    flash_fwd_kernel[(triton.cdiv(E, BE), B)](
        qq, kq, ql, kl, v, bias, o, T, quad_scale, lin_scale, S=S, E=E, C=C, BT=BT, BS=BS, BE=BE,
        HAS_BIAS=bias is not None, PREC=dot_precision(torch.float32), num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return o


def flash_bwd(qq, kq, ql, kl, v, bias, do, C, quad_scale, lin_scale):
    """Returns float32 (dqq, dkq, dql, dkl, dv, db or None)."""
    B, T, S = qq.shape
    E = v.shape[-1]
    BT, BS, BE = _blocks(C, S, E)
    NC, NE = triton.cdiv(T, C), triton.cdiv(E, BE)
    prec, has_bias = dot_precision(torch.float32), bias is not None
    f32 = dict(dtype=torch.float32, device=qq.device)
    dqq, dkq = torch.empty(B, T, S, **f32), torch.empty(B, T, S, **f32)
    ds = torch.empty(B, NC, BT, BT, **f32) if has_bias else None
    db = torch.empty(B, NC, BT, **f32) if has_bias else None
    flash_bwd_quad_kernel[(NC, B)](
        qq, kq, v, bias, do, dqq, dkq, ds, db, T, quad_scale, S=S, E=E, C=C, BT=BT, BS=BS, BE=BE,
        HAS_BIAS=has_bias, PREC=prec, num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    dql, dkl = torch.empty(NE, B, T, S, **f32), torch.empty(NE, B, T, S, **f32)
    dv = torch.empty(B, T, E, **f32)
    flash_bwd_lin_kernel[(NE, B)](
        qq, kq, ql, kl, v, bias, do, dql, dkl, dv, T, quad_scale, lin_scale, S=S, E=E, C=C, BT=BT, BS=BS,
        BE=BE, HAS_BIAS=has_bias, PREC=prec, num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    db = None if db is None else db.sum((0, 1))[:C]
    return dqq, dkq, dql.sum(0), dkl.sum(0), dv, db


class MixedChunkAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qq, kq, ql, kl, v, bias, chunk_size, quad_scale, lin_scale):
        o = flash_fwd(qq, kq, ql, kl, v, bias, chunk_size, quad_scale, lin_scale)
        ctx.save_for_backward(qq, kq, ql, kl, v, bias)
        ctx.args = (chunk_size, quad_scale, lin_scale)
        return o

    @staticmethod
    def backward(ctx, do):
        qq, kq, ql, kl, v, bias = ctx.saved_tensors
        grads = flash_bwd(qq, kq, ql, kl, v, bias, do.contiguous(), *ctx.args)
        dqq, dkq, dql, dkl, dv, db = grads
        db = None if db is None else db.to(bias.dtype)
        return (dqq.to(qq.dtype), dkq.to(kq.dtype), dql.to(ql.dtype), dkl.to(kl.dtype), dv.to(v.dtype), db,
                None, None, None)  # fmt: skip


def mixed_chunk_attention_triton(
    q_quad, k_quad, q_lin, k_lin, v, *, chunk_size, quad_scale, lin_scale, rel_bias=None
):
    """Mixed-chunk attention from the start of a sequence (no initial state). q_*, k_* [B, T, S],
    v [B, T, E] of one dtype (float32/bfloat16/float16), rel_bias None or [chunk_size] (float32).
    Returns o [B, T, E] in q_quad's dtype; differentiable in every tensor."""
    xs = (q_quad, k_quad, q_lin, k_lin, v)
    B, T, S = q_quad.shape
    if any(x.dim() != 3 or x.shape[:2] != (B, T) for x in xs) or any(x.shape[-1] != S for x in xs[:4]):
        raise ValueError(f"q_*, k_* must be [B, T, S] and v [B, T, E], got {[tuple(x.shape) for x in xs]}")
    if len({x.dtype for x in xs}) != 1 or q_quad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"inputs must share one dtype of float32/bfloat16/float16, got {[x.dtype for x in xs]}"
        )
    if not covers(chunk_size, S):
        raise ValueError(
            f"the Triton kernels take chunk_size * S up to {MAX_TILE} (rounded up to powers of two), "
            f"got chunk_size = {chunk_size}, S = {S}"
        )
    if T == 0:
        return torch.zeros_like(v)
    bias = None if rel_bias is None else rel_bias.float().contiguous()
    xs = tuple(x.contiguous() for x in xs)
    return MixedChunkAttentionFunction.apply(*xs, bias, chunk_size, float(quad_scale), float(lin_scale))
