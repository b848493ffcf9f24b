"""Fused recurrent gated linear recurrence in Triton: one token at a time, the state kept in registers.

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t,      o_t = q_t S_t   (unscaled)

For short inputs (the launcher uses it for T <= 64 on CUDA) and single decoding steps, where the
chunk kernels would spend their time on launches and padding. Each program holds a [K, BV] slice
of one head's state. The backward pass replays the forward to get dq_t = S_t do_t^T, then walks back
in time with the state gradient dS_t = q_t^T do_t + exp(g_{t+1}) dS_{t+1}: dk_t = dS_t v_t^T,
dv_t = k_t dS_t. The gate gradient comes from q * dq - k * dk (``utils.py``). Only exp(g_t) <= 1
appears, so any gate >= -inf is stable.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.kernels.utils import (
    block_size,
    cast,
    check_inputs,
    dot_precision,
    empty_sequence,
    gate_grad,
    load_state,
    state_block,
)

torch = require("torch")
triton = require("triton")
tl = require("triton.language")


@triton.jit
def fused_recurrent_fwd_kernel(
    q,
    k,
    v,
    g,
    h0,
    o,
    ht,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    USE_H0: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T

    o_k, o_v, m_k, m_v, o_h, m_h = state_block(0, i_v, K, V, BK, BV)
    b_h = load_state(h0, i_bh, o_h, m_h, K, V, BK, BV, USE_H0)
    for t in range(T):
        o_tk = (bos + t) * (H * K) + i_h * K + o_k
        o_tv = (bos + t) * (H * V) + i_h * V + o_v
        b_q = tl.load(q + o_tk, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + o_tk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0).to(tl.float32)
        if GATE == 1:
            b_h *= tl.exp(tl.load(g + (bos + t) * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_h *= tl.exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))[:, None]
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o + o_tv, cast(b_o, o.dtype.element_ty, PREC), mask=m_v)
    tl.store(ht + i_bh.to(tl.int64) * K * V + o_h, b_h, mask=m_h)


@triton.jit
def fused_recurrent_bwd_kernel(
    q,
    k,
    v,
    g,
    h0,
    do,
    dht,
    dq,
    dk,
    dv,
    dh0,
    T,
    s_part,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    USE_H0: tl.constexpr,
    USE_DHT: tl.constexpr,
    PREC: tl.constexpr,
):
    # dq and dk sum over V: each V block writes its own part (offset s_part * i_v), summed afterwards.
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T

    o_k, o_v, m_k, m_v, o_h, m_h = state_block(0, i_v, K, V, BK, BV)
    p_dq = dq + i_v.to(tl.int64) * s_part
    p_dk = dk + i_v.to(tl.int64) * s_part

    # forward in time: dq_t = S_t do_t^T
    b_h = load_state(h0, i_bh, o_h, m_h, K, V, BK, BV, USE_H0)
    for t in range(T):
        o_tk = (bos + t) * (H * K) + i_h * K + o_k
        o_tv = (bos + t) * (H * V) + i_h * V + o_v
        b_k = tl.load(k + o_tk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0).to(tl.float32)
        b_do = tl.load(do + o_tv, mask=m_v, other=0).to(tl.float32)
        if GATE == 1:
            b_h *= tl.exp(tl.load(g + (bos + t) * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_h *= tl.exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))[:, None]
        b_h += b_k[:, None] * b_v[None, :]
        tl.store(p_dq + o_tk, tl.sum(b_h * b_do[None, :], axis=1), mask=m_k)

    # backward in time: dS_t = q_t^T do_t + exp(g_{t+1}) dS_{t+1}
    b_dh = load_state(dht, i_bh, o_h, m_h, K, V, BK, BV, USE_DHT)
    for i_s in range(T):
        t = T - 1 - i_s
        o_tk = (bos + t) * (H * K) + i_h * K + o_k
        o_tv = (bos + t) * (H * V) + i_h * V + o_v
        b_q = tl.load(q + o_tk, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + o_tk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0).to(tl.float32)
        b_do = tl.load(do + o_tv, mask=m_v, other=0).to(tl.float32)
        b_dh += b_q[:, None] * b_do[None, :]
        tl.store(p_dk + o_tk, tl.sum(b_dh * b_v[None, :], axis=1), mask=m_k)
        tl.store(dv + o_tv, cast(tl.sum(b_dh * b_k[:, None], axis=0), dv.dtype.element_ty, PREC), mask=m_v)
        if GATE == 1:
            b_dh *= tl.exp(tl.load(g + (bos + t) * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_dh *= tl.exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))[:, None]
    tl.store(dh0 + i_bh.to(tl.int64) * K * V + o_h, b_dh, mask=m_h)


def _blocks(K: int, V: int) -> tuple[int, int]:
    BK = block_size(K)  # the whole key dimension: o_t sums over it
    return BK, block_size(V, 64 if BK <= 64 else 32)


def _gate_kind(g) -> int:
    return 0 if g is None else (1 if g.shape[-1] == 1 else 2)


def fused_recurrent_fwd(q, k, v, g, h0):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = _blocks(K, V)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    fused_recurrent_fwd_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, h0, o, ht, T, H=H, K=K, V=V, BK=BK, BV=BV,
        GATE=_gate_kind(g), USE_H0=h0 is not None, PREC=dot_precision(q.dtype),
    )  # fmt: skip
    return o, ht


def fused_recurrent_bwd(q, k, v, g, h0, do, dht):
    """Returns (dq, dk float32, dv in v's dtype, dh0 float32)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = _blocks(K, V)
    NV = triton.cdiv(V, BV)
    dq = torch.empty(NV, B, T, H, K, dtype=torch.float32, device=q.device)
    dk = torch.empty(NV, B, T, H, K, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(v)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    fused_recurrent_bwd_kernel[(NV, B * H)](
        q, k, v, g, h0, do, dht, dq, dk, dv, dh0, T, dq.stride(0), H=H, K=K, V=V, BK=BK, BV=BV,
        GATE=_gate_kind(g), USE_H0=h0 is not None, USE_DHT=dht is not None, PREC=dot_precision(q.dtype),
    )  # fmt: skip
    return dq.sum(0), dk.sum(0), dv, dh0


class FusedRecurrentGatedRecurrenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state):
        o, ht = fused_recurrent_fwd(q, k, v, g, initial_state)
        ctx.save_for_backward(q, k, v, g, initial_state, ht)
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, h0, ht = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        dq, dk, dv, dh0 = fused_recurrent_bwd(q, k, v, g, h0, do, dht)
        dg = None
        if g is not None and ctx.needs_input_grad[3]:
            dg = gate_grad(q, k, dq, dk, g.shape[-1], ht, dht).to(g.dtype)
        dh0 = None if h0 is None else dh0.to(h0.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv, dg, dh0


def fused_recurrent_gated_recurrence(q, k, v, g, *, initial_state):
    """The fused recurrent Triton kernel. Same contract as ``chunk_gated_recurrence_kernel``
    (``edgeattn.kernels.gated_chunk``), without the chunk size; meant for T <= 64."""
    q, k, v, g, initial_state = check_inputs(q, k, v, g, initial_state)
    if q.shape[1] == 0:
        return empty_sequence(q, v, initial_state)
    return FusedRecurrentGatedRecurrenceFunction.apply(q, k, v, g, initial_state)
