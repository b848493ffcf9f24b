"""AFT with a per-channel decay, optionally a window bias, in Triton: forward and backward, for
training (a zero initial state; no final state).

    o_t = sigmoid(q_t) * sum_{i<=t} exp(k_i + w_{t,i}) v_i / sum_{i<=t} exp(k_i + w_{t,i})
    w_{t,i} = (t-i) d, or window_bias[t-i] for t - i < W when a window bias [W, D] is given

Every channel is its own scalar recurrence, so a program takes a block of channels of one sequence
and scans the tokens in order (a fused recurrent kernel: the work per token is elementwise, so the
scan is bound by memory, not by a chunked matmul). With the running maximum ``m_t = max(m_{t-1} + d,
k_t)`` of the decayed keys, numerator and denominator are kept relative to it:

    num_t = exp(m_{t-1} + d - m_t) num_{t-1} + exp(k_t - m_t) v_t       (den likewise with v = 1)

Every exponent is <= 0 and ``den_t >= 1`` (the heaviest token weighs exactly 1), so keys of +-80 and
decays of -1e4 neither overflow nor divide 0 by 0.

Backward, with ``g_t = do_t * sigmoid(q_t)`` and ``r_t = num_t / den_t`` (kept by the forward):

    P_i = sum_{t>=i} g_t / den_t * exp(m_i + (t-i) d - m_t)  = g_i / den_i + exp(m_i + d - m_{i+1}) P_{i+1}
    R_i = the same sum of g_t r_t / den_t
    dv_i = exp(k_i - m_i) P_i,   dk_i = exp(k_i - m_i) (v_i P_i - R_i),   dq_t = do_t r_t s_t (1 - s_t)

a reverse scan, again with exponents <= 0. The output depends on k and d only through
``k_i - i d`` (the factor ``exp(t d)`` cancels between numerator and denominator), so
``dd = -sum_i i dk_i``, summed by each program and then over the batch.

With a window bias (``aft_window_*``) the forward runs that recurrence first, then gives token t
the recurrence at token t - W decayed W more steps (``exp(m_{t-W} + W d) num_{t-W}``: every token at
distance >= W) merged with its W window tokens under a running maximum ``M_t`` (total ``Z_t``). The
backward feeds the far part into the same reverse scan at u = t - W, with weight ``g_t / Z_t *
exp(m_u + W d - M_t)`` (<= g_t / Z_t), and gathers the window part per key from its W outputs;
dd now needs the sums weighted by t - i explicitly (the window part does not depend on d), and the
window bias's gradient is summed per offset. The window costs O(T W) per channel.

Layout: q, k, v [B, T, D] (float32/bfloat16/float16), decay [D]; float32 scan state.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.kernels.utils import block_size

torch = require("torch")
triton = require("triton")
tl = require("triton.language")


@triton.jit
def aft_fwd_kernel(q, k, v, decay, o, r, m, den, T, D: tl.constexpr, BD: tl.constexpr):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    bos = i_b.to(tl.int64) * T * D
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_d = tl.load(decay + o_d, mask=m_d, other=0).to(tl.float32)
    b_m = tl.full([BD], float("-inf"), dtype=tl.float32)
    b_num = tl.zeros([BD], dtype=tl.float32)
    b_den = tl.zeros([BD], dtype=tl.float32)
    for t in range(T):
        o_td = bos + t * D + o_d
        b_k = tl.load(k + o_td, mask=m_d, other=0).to(tl.float32)
        b_v = tl.load(v + o_td, mask=m_d, other=0).to(tl.float32)
        b_q = tl.load(q + o_td, mask=m_d, other=0).to(tl.float32)
        b_mn = tl.maximum(b_m + b_d, b_k)
        b_a = tl.exp(b_m + b_d - b_mn)  # 0 at t = 0 (m = -inf)
        b_e = tl.exp(b_k - b_mn)
        b_num = b_a * b_num + b_e * b_v
        b_den = b_a * b_den + b_e
        b_m = b_mn
        b_r = b_num / b_den
        tl.store(o + o_td, (tl.sigmoid(b_q) * b_r).to(o.dtype.element_ty), mask=m_d)
        tl.store(r + o_td, b_r, mask=m_d)
        tl.store(m + o_td, b_m, mask=m_d)
        tl.store(den + o_td, b_den, mask=m_d)


@triton.jit
def aft_bwd_kernel(
    q, k, v, decay, r, m, den, do, dq, dk, dv, dd, T, D: tl.constexpr, BD: tl.constexpr
):  # fmt: skip
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    bos = i_b.to(tl.int64) * T * D
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_d = tl.load(decay + o_d, mask=m_d, other=0).to(tl.float32)
    b_P = tl.zeros([BD], dtype=tl.float32)
    b_R = tl.zeros([BD], dtype=tl.float32)
    b_dd = tl.zeros([BD], dtype=tl.float32)
    b_mn = tl.full([BD], float("inf"), dtype=tl.float32)  # m_{i+1}; +inf: nothing after the last token
    for i_s in range(T):
        i = T - 1 - i_s
        o_td = bos + i * D + o_d
        b_q = tl.load(q + o_td, mask=m_d, other=0).to(tl.float32)
        b_k = tl.load(k + o_td, mask=m_d, other=0).to(tl.float32)
        b_v = tl.load(v + o_td, mask=m_d, other=0).to(tl.float32)
        b_do = tl.load(do + o_td, mask=m_d, other=0).to(tl.float32)
        b_r = tl.load(r + o_td, mask=m_d, other=0)
        b_m = tl.load(m + o_td, mask=m_d, other=0)
        b_den = tl.load(den + o_td, mask=m_d, other=1)
        b_s = tl.sigmoid(b_q)
        b_g = b_do * b_s / b_den
        b_a = tl.exp(b_m + b_d - b_mn)
        b_P = b_a * b_P + b_g
        b_R = b_a * b_R + b_g * b_r
        b_e = tl.exp(b_k - b_m)
        b_dk = b_e * (b_v * b_P - b_R)
        b_dd -= i.to(tl.float32) * b_dk
        tl.store(dq + o_td, b_do * b_r * b_s * (1 - b_s), mask=m_d)
        tl.store(dk + o_td, b_dk, mask=m_d)
        tl.store(dv + o_td, b_e * b_P, mask=m_d)
        b_mn = b_m
    tl.store(dd + i_b * D + o_d, b_dd, mask=m_d)


@triton.jit
def aft_window_fwd_kernel(
    q, k, v, decay, wb, o, r, m, num, den, M, Z, T, W, D: tl.constexpr, BD: tl.constexpr
):  # fmt: skip
    # Pass 1: the plain decayed recurrence (m, num, den per token, as in aft_fwd_kernel).
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    bos = i_b.to(tl.int64) * T * D
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_d = tl.load(decay + o_d, mask=m_d, other=0).to(tl.float32)
    b_m = tl.full([BD], float("-inf"), dtype=tl.float32)
    b_num = tl.zeros([BD], dtype=tl.float32)
    b_den = tl.zeros([BD], dtype=tl.float32)
    for t in range(T):
        o_td = bos + t * D + o_d
        b_k = tl.load(k + o_td, mask=m_d, other=0).to(tl.float32)
        b_v = tl.load(v + o_td, mask=m_d, other=0).to(tl.float32)
        b_mn = tl.maximum(b_m + b_d, b_k)
        b_a = tl.exp(b_m + b_d - b_mn)
        b_e = tl.exp(b_k - b_mn)
        b_num = b_a * b_num + b_e * b_v
        b_den = b_a * b_den + b_e
        b_m = b_mn
        tl.store(m + o_td, b_m, mask=m_d)
        tl.store(num + o_td, b_num, mask=m_d)
        tl.store(den + o_td, b_den, mask=m_d)
    tl.debug_barrier()
    # Pass 2: token t = the recurrence at t - W, decayed W more steps, and the W window tokens, merged
    # under a running maximum M.
    for t in range(T):
        o_td = bos + t * D + o_d
        b_M = tl.full([BD], float("-inf"), dtype=tl.float32)
        b_N = tl.zeros([BD], dtype=tl.float32)
        b_Z = tl.zeros([BD], dtype=tl.float32)
        if t >= W:
            o_ud = bos + (t - W) * D + o_d
            b_M = tl.load(m + o_ud, mask=m_d, other=0) + W * b_d
            b_N = tl.load(num + o_ud, mask=m_d, other=0)
            b_Z = tl.load(den + o_ud, mask=m_d, other=0)
        for j in range(tl.minimum(W, t + 1)):
            o_jd = bos + (t - j) * D + o_d
            b_L = tl.load(k + o_jd, mask=m_d, other=0).to(tl.float32)
            b_L += tl.load(wb + j * D + o_d, mask=m_d, other=0).to(tl.float32)
            b_v = tl.load(v + o_jd, mask=m_d, other=0).to(tl.float32)
            b_Mn = tl.maximum(b_M, b_L)
            b_a = tl.exp(b_M - b_Mn)
            b_e = tl.exp(b_L - b_Mn)
            b_N = b_a * b_N + b_e * b_v
            b_Z = b_a * b_Z + b_e
            b_M = b_Mn
        b_q = tl.load(q + o_td, mask=m_d, other=0).to(tl.float32)
        b_r = b_N / b_Z
        tl.store(o + o_td, (tl.sigmoid(b_q) * b_r).to(o.dtype.element_ty), mask=m_d)
        tl.store(r + o_td, b_r, mask=m_d)
        tl.store(M + o_td, b_M, mask=m_d)
        tl.store(Z + o_td, b_Z, mask=m_d)


@triton.jit
def aft_window_bwd_kernel(
    q, k, v, decay, wb, r, m, M, Z, do, dq, dk, dv, dd, dwb, T, W,
    D: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # Reverse scan over keys i. Far part: output t = i + W reaches the recurrence at u = i through
    # g'_u = g_t / Z_t * exp(m_u + W d - M_t) (<= 1 times g_t / Z_t); P, R as in aft_bwd_kernel, and
    # Qp, Qr the same sums weighted by u - i, for dd = sum_i e_i (v_i (Qp + W P) - (Qr + W R)).
    # Near part: each key i gathers its W outputs t = i + j directly.
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    bos = i_b.to(tl.int64) * T * D
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    b_d = tl.load(decay + o_d, mask=m_d, other=0).to(tl.float32)
    b_P = tl.zeros([BD], dtype=tl.float32)
    b_R = tl.zeros([BD], dtype=tl.float32)
    b_Qp = tl.zeros([BD], dtype=tl.float32)
    b_Qr = tl.zeros([BD], dtype=tl.float32)
    b_dd = tl.zeros([BD], dtype=tl.float32)
    b_dwb = tl.zeros([BW, BD], dtype=tl.float32)
    b_mn = tl.full([BD], float("inf"), dtype=tl.float32)
    for i_s in range(T):
        i = T - 1 - i_s
        o_id = bos + i * D + o_d
        b_k = tl.load(k + o_id, mask=m_d, other=0).to(tl.float32)
        b_v = tl.load(v + o_id, mask=m_d, other=0).to(tl.float32)
        b_m = tl.load(m + o_id, mask=m_d, other=0)
        # the query side of token i
        b_q = tl.load(q + o_id, mask=m_d, other=0).to(tl.float32)
        b_do = tl.load(do + o_id, mask=m_d, other=0).to(tl.float32)
        b_s = tl.sigmoid(b_q)
        tl.store(dq + o_id, b_do * tl.load(r + o_id, mask=m_d, other=0) * b_s * (1 - b_s), mask=m_d)
        # far part
        b_g = tl.zeros([BD], dtype=tl.float32)
        b_gr = tl.zeros([BD], dtype=tl.float32)
        if i + W < T:
            o_td = bos + (i + W) * D + o_d
            b_qt = tl.load(q + o_td, mask=m_d, other=0).to(tl.float32)
            b_dot = tl.load(do + o_td, mask=m_d, other=0).to(tl.float32)
            b_Zt = tl.load(Z + o_td, mask=m_d, other=1)
            b_Mt = tl.load(M + o_td, mask=m_d, other=0)
            b_g = b_dot * tl.sigmoid(b_qt) / b_Zt * tl.exp(b_m + W * b_d - b_Mt)
            b_gr = b_g * tl.load(r + o_td, mask=m_d, other=0)
        b_a = tl.exp(b_m + b_d - b_mn)
        b_Qp = b_a * (b_Qp + b_P)
        b_Qr = b_a * (b_Qr + b_R)
        b_P = b_a * b_P + b_g
        b_R = b_a * b_R + b_gr
        b_e = tl.exp(b_k - b_m)
        b_dk = b_e * (b_v * b_P - b_R)
        b_dv = b_e * b_P
        b_dd += b_e * (b_v * (b_Qp + W * b_P) - (b_Qr + W * b_R))
        b_mn = b_m
        # near part: outputs t = i + j, j < W
        for j in range(tl.minimum(W, T - i)):
            o_td = bos + (i + j) * D + o_d
            b_qt = tl.load(q + o_td, mask=m_d, other=0).to(tl.float32)
            b_dot = tl.load(do + o_td, mask=m_d, other=0).to(tl.float32)
            b_Zt = tl.load(Z + o_td, mask=m_d, other=1)
            b_Mt = tl.load(M + o_td, mask=m_d, other=0)
            b_w = tl.load(wb + j * D + o_d, mask=m_d, other=0).to(tl.float32)
            b_c = b_dot * tl.sigmoid(b_qt) / b_Zt * tl.exp(b_k + b_w - b_Mt)
            b_ck = b_c * (b_v - tl.load(r + o_td, mask=m_d, other=0))
            b_dv += b_c
            b_dk += b_ck
            b_dwb += tl.where((o_w == j)[:, None], b_ck[None, :], 0)
        tl.store(dk + o_id, b_dk, mask=m_d)
        tl.store(dv + o_id, b_dv, mask=m_d)
    tl.store(dd + i_b * D + o_d, b_dd, mask=m_d)
    o_wd = (i_b.to(tl.int64) * BW + o_w[:, None]) * D + o_d[None, :]
    tl.store(dwb + o_wd, b_dwb, mask=(o_w < W)[:, None] & m_d[None, :])


def _block(D: int) -> int:
    return block_size(D, 128)


def aft_fwd(q, k, v, decay):
    """Returns (o in q's dtype, r = num / den, m, den: float32 [B, T, D] kept for backward)."""
    B, T, D = q.shape
    BD = _block(D)
    o = torch.empty_like(q)
    r, m, den = (torch.empty(B, T, D, dtype=torch.float32, device=q.device) for _ in range(3))
    aft_fwd_kernel[(triton.cdiv(D, BD), B)](q, k, v, decay, o, r, m, den, T, D=D, BD=BD)
    return o, r, m, den


def aft_bwd(q, k, v, decay, r, m, den, do):
    """Returns (dq, dk, dv float32 [B, T, D], dd float32 [D])."""
    B, T, D = q.shape
    BD = _block(D)
    dq, dk, dv = (torch.empty(B, T, D, dtype=torch.float32, device=q.device) for _ in range(3))
    dd = torch.empty(B, D, dtype=torch.float32, device=q.device)
    aft_bwd_kernel[(triton.cdiv(D, BD), B)](q, k, v, decay, r, m, den, do, dq, dk, dv, dd, T, D=D, BD=BD)
    return dq, dk, dv, dd.sum(0)


def aft_window_fwd(q, k, v, decay, wb):
    """Returns (o in q's dtype, r, m, M, Z: float32 [B, T, D] kept for backward)."""
    B, T, D = q.shape
    BD = _block(D)
    o = torch.empty_like(q)
    r, m, num, den, M, Z = (torch.empty(B, T, D, dtype=torch.float32, device=q.device) for _ in range(6))
    aft_window_fwd_kernel[(triton.cdiv(D, BD), B)](
        q, k, v, decay, wb, o, r, m, num, den, M, Z, T, wb.shape[0], D=D, BD=BD
    )
    return o, r, m, M, Z


def aft_window_bwd(q, k, v, decay, wb, r, m, M, Z, do):
    """Returns (dq, dk, dv float32 [B, T, D], dd float32 [D], dwb float32 [W, D])."""
    B, T, D = q.shape
    W = wb.shape[0]
    BD, BW = _block(D), triton.next_power_of_2(W)
    dq, dk, dv = (torch.empty(B, T, D, dtype=torch.float32, device=q.device) for _ in range(3))
    dd = torch.empty(B, D, dtype=torch.float32, device=q.device)
    dwb = torch.empty(B, BW, D, dtype=torch.float32, device=q.device)
    aft_window_bwd_kernel[(triton.cdiv(D, BD), B)](
        q, k, v, decay, wb, r, m, M, Z, do, dq, dk, dv, dd, dwb, T, W, D=D, BD=BD, BW=BW
    )
    return dq, dk, dv, dd.sum(0), dwb[:, :W].sum(0)


class AFTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, decay):
        o, r, m, den = aft_fwd(q, k, v, decay)
        ctx.save_for_backward(q, k, v, decay, r, m, den)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, decay, r, m, den = ctx.saved_tensors
        dq, dk, dv, dd = aft_bwd(q, k, v, decay, r, m, den, do.contiguous())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dd.to(decay.dtype)


class AFTWindowFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, decay, wb):
        o, r, m, M, Z = aft_window_fwd(q, k, v, decay, wb)
        ctx.save_for_backward(q, k, v, decay, wb, r, m, M, Z)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, decay, wb, r, m, M, Z = ctx.saved_tensors
        dq, dk, dv, dd, dwb = aft_window_bwd(q, k, v, decay, wb, r, m, M, Z, do.contiguous())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dd.to(decay.dtype), dwb.to(wb.dtype)


def aft_triton(q, k, v, decay, window_bias=None):
    """AFT with a decay and optionally a window bias, from a zero state. q, k, v: [B, T, D] of one
    dtype (float32/bfloat16/float16), decay: [D] log-space (<= 0), window_bias None or [W, D] (both
    taken as float32). Returns o [B, T, D] in q's dtype; differentiable in every tensor."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be [B, T, D] of one shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q, k, v must share one dtype of float32/bfloat16/float16, got {q.dtype}")
    if decay.shape != (q.shape[-1],):
        raise ValueError(f"decay must be [D] = [{q.shape[-1]}], got {tuple(decay.shape)}")
    if q.shape[1] == 0:
        return torch.zeros_like(q)
    if window_bias is not None and window_bias.shape[0] > 0:
        if window_bias.dim() != 2 or window_bias.shape[1] != q.shape[-1]:
            raise ValueError(f"window_bias must be [W, D], got {tuple(window_bias.shape)}")
        qkv = (q.contiguous(), k.contiguous(), v.contiguous())
        return AFTWindowFunction.apply(*qkv, decay.float().contiguous(), window_bias.float().contiguous())
    return AFTFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), decay.float().contiguous())
