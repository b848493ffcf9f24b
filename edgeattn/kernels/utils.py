"""Shared by the chunk and fused recurrent kernels: cumulative log-gates, dots, block sizes, checks.

Forward: ``gc`` holds the cumulative sums ``b`` of ``g`` within each chunk of BT tokens, so that token
i reaches token t of the same chunk with weight ``exp(b_t - b_i) <= 1``. After a gate of -1e4 the sums
are large and float32 would lose their small differences (its spacing at 1e4 is 1e-3), so the sums
are taken in float64 and kept as two float32 halves, ``b = hi + lo`` (``gc [B, T, H, G, 2]``), and
differences are taken as ``(hi_t - hi_i) + (lo_t - lo_i)``: exact where ``exp`` of them is not 0.
``EDGEATTN_GATE_SUM=float32`` keeps float32 sums instead (``gc [B, T, H, G, 1]``, fla's form; ``GS`` = 1
in the kernels, whose ``lo`` is then 0).

Backward (``gate_grad``): with ``B_t = sum_{j<=t} g_j`` the output depends on ``B`` only through
``q_t exp(B_t)``, ``k_t exp(-B_t)`` and the factor ``exp(B_T)`` of the final state, so

    dB_t = q_t * dq_t - k_t * dk_t  (+ sum_v S_T * dS_T at t = T),      dg_t = sum_{s >= t} dB_s

a reverse cumulative sum over the sequence (summed over keys for a whole-head gate).
"""

from __future__ import annotations

import functools
import os

from edgeattn._deps import require

torch = require("torch")
triton = require("triton")
tl = require("triton.language")

# Read when the kernels are decorated, as triton.jit does.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """tl.dot with float32 accumulation. PREC "bf16_as_f32" multiplies (bfloat16-rounded) operands in
    float32: the interpreter's own bfloat16 dot multiplies raw bits. On a GPU a bfloat16 dot is exact
    products accumulated in float32 too, so both round the same way up to the order of the sum."""
    if PREC == "bf16_as_f32":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def cast(x, dtype: tl.constexpr, PREC: tl.constexpr):
    """x.to(dtype), rounding to nearest even. Under PREC "bf16_as_f32" (the interpreter, which truncates
    to bfloat16) the rounding is done by hand on the float32 bits, as the GPU does it."""
    if PREC == "bf16_as_f32":
        if dtype == tl.bfloat16:
            u = x.to(tl.float32).to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            x = u.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def state_block(i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets and masks of block (i_k, i_v) of a row-major [K, V] state: o_k, o_v, m_k, m_v, o_h, m_h."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    return o_k, o_v, m_k, m_v, o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def load_state(
    p, i_bh, o_h, m_h, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE: tl.constexpr
):
    """A [BK, BV] float32 block of state ``i_bh`` of ``p`` ([B * H, K, V]), or zeros when not USE."""
    b = tl.zeros([BK, BV], dtype=tl.float32)
    if USE:
        b += tl.load(p + i_bh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    return b


@triton.jit
def chunk_local_cumsum_kernel(
    g, gc, T, H: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, GS: tl.constexpr
):
    i_t, i_g, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T

    o_t = i_t * BT + tl.arange(0, BT)
    o_g = i_g * BG + tl.arange(0, BG)
    m_g = (o_t < T)[:, None] & (o_g < G)[None, :]
    o_tg = (bos + o_t)[:, None] * (H * G) + i_h * G + o_g[None, :]
    if GS == 2:  # float64 sums kept as float32 (hi, lo)
        b_b = tl.cumsum(tl.load(g + o_tg, mask=m_g, other=0).to(tl.float64), axis=0)
        b_hi = b_b.to(tl.float32)
        tl.store(gc + 2 * o_tg, b_hi, mask=m_g)
        tl.store(gc + 2 * o_tg + 1, (b_b - b_hi.to(tl.float64)).to(tl.float32), mask=m_g)
    else:  # float32 sums
        tl.store(gc + o_tg, tl.cumsum(tl.load(g + o_tg, mask=m_g, other=0).to(tl.float32), axis=0), mask=m_g)


@triton.jit
def gate_rows(gc, o_t, o_k, m_k, T, HK: tl.constexpr, GS: tl.constexpr):
    """Per-key cumulative gates (hi, lo), each [len(o_t), BK], at tokens o_t of ``gc`` (already offset
    to its batch and head; row stride HK = H * K; GS: 2 for (hi, lo) pairs, 1 for float32 sums, whose lo
    is 0). Padded tokens read the last valid one: no decay."""
    p = gc + GS * (tl.minimum(o_t, T - 1)[:, None] * HK + o_k[None, :])
    hi = tl.load(p, mask=m_k[None, :], other=0)
    if GS == 2:
        lo = tl.load(p + 1, mask=m_k[None, :], other=0)
    else:
        lo = tl.zeros_like(hi)
    return hi, lo


@triton.jit
def gate_row(gc, t, o_k, m_k, T, HK: tl.constexpr, GS: tl.constexpr):
    """Per-key cumulative gates (hi, lo), each [BK], at token t (clamped to the last valid one)."""
    p = gc + GS * (tl.minimum(t, T - 1) * HK + o_k)
    hi = tl.load(p, mask=m_k, other=0)
    if GS == 2:
        lo = tl.load(p + 1, mask=m_k, other=0)
    else:
        lo = tl.zeros_like(hi)
    return hi, lo


@triton.jit
def gate_head(gc, t, T, H: tl.constexpr, GS: tl.constexpr):
    """Whole-head cumulative gates (hi, lo) at token(s) t (a scalar or a vector, clamped)."""
    p = gc + GS * tl.minimum(t, T - 1) * H
    hi = tl.load(p)
    if GS == 2:
        lo = tl.load(p + 1)
    else:
        lo = hi * 0
    return hi, lo


@triton.jit
def decay_to_chunk_end(
    b_h,
    b_k,
    gc,
    bos,
    i_h,
    o_t,
    o_k,
    m_k,
    r_last,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    GATE: tl.constexpr,
    GS: tl.constexpr,
    dtype: tl.constexpr,
    PREC: tl.constexpr,
):
    """Carry a state block over a chunk: h *= exp(b_last), k *= exp(b_last - b) (cast to dtype), for a
    whole-head (GATE 1) or per-key (GATE 2) gate; no gate (GATE 0) only casts k."""
    if GATE == 1:
        p_g = gc + GS * (bos * H + i_h)
        b_g, b_g_lo = gate_head(p_g, o_t, T, H, GS)
        b_gn, b_gn_lo = gate_head(p_g, r_last, T, H, GS)
        b_h *= tl.exp(b_gn + b_gn_lo)
        b_k = cast(b_k * tl.exp((b_gn - b_g) + (b_gn_lo - b_g_lo))[:, None], dtype, PREC)
    elif GATE == 2:
        p_g = gc + GS * (bos * H + i_h) * K
        b_g, b_g_lo = gate_rows(p_g, o_t, o_k, m_k, T, H * K, GS)
        b_gn, b_gn_lo = gate_row(p_g, r_last, o_k, m_k, T, H * K, GS)
        b_h *= tl.exp(b_gn + b_gn_lo)[:, None]
        b_k = cast(b_k * tl.exp((b_gn[None, :] - b_g) + (b_gn_lo[None, :] - b_g_lo)), dtype, PREC)
    else:
        b_k = cast(b_k, dtype, PREC)
    return b_h, b_k


@triton.jit
def chunk_bwd_dg_kernel(
    q,
    k,
    dq,
    dk,
    dgT,
    dg,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    USE_DGT: tl.constexpr,
):
    # Whole-head gates (G = 1) need all keys in one block: BK >= K and one program per head.
    i_k, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b.to(tl.int64) * T
    NT = tl.cdiv(T, BT)

    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    # b_c: the sum of dB over every later token, starting from the final-state term.
    b_c = tl.zeros([BK], dtype=tl.float32)
    if USE_DGT:
        b_c += tl.load(dgT + i_bh.to(tl.int64) * K + o_k, mask=m_k, other=0).to(tl.float32)
    if G == 1:
        b_c = tl.sum(b_c, axis=0)  # a scalar: the gate is shared by every key
    for i_s in range(NT):
        i_t = NT - 1 - i_s
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        o_tk = (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + o_tk, mask=m_tk, other=0).to(tl.float32)
        b_k = tl.load(k + o_tk, mask=m_tk, other=0).to(tl.float32)
        b_dq = tl.load(dq + o_tk, mask=m_tk, other=0).to(tl.float32)
        b_dk = tl.load(dk + o_tk, mask=m_tk, other=0).to(tl.float32)
        b_db = b_q * b_dq - b_k * b_dk
        if G == 1:
            b_db1 = tl.sum(b_db, axis=1)  # [BT]
            b_dg = tl.cumsum(b_db1, axis=0, reverse=True) + b_c
            tl.store(dg + (bos + o_t) * H + i_h, b_dg, mask=m_t)
            b_c += tl.sum(b_db1, axis=0)
        else:
            b_dg = tl.cumsum(b_db, axis=0, reverse=True) + b_c[None, :]
            tl.store(dg + (bos + o_t)[:, None] * (H * G) + i_h * G + o_k[None, :], b_dg, mask=m_tk)
            b_c += tl.sum(b_db, axis=0)


def block_size(n: int, cap: int | None = None) -> int:
    """The power of two >= n (and >= 16, the smallest tl.dot tile), optionally capped."""
    b = max(16, triton.next_power_of_2(n))
    return b if cap is None else min(b, cap)


F32_DOTS = ("ieee", "tf32", "tf32x3")


def _f32_dot_override() -> str | None:
    """EDGEATTN_TRITON_F32_DOT (ieee, tf32 or tf32x3): the float32 dots' precision, forced."""
    value = os.environ.get("EDGEATTN_TRITON_F32_DOT", "").strip().lower()
    if not value:
        return None
    if value not in F32_DOTS:
        raise ValueError(f"EDGEATTN_TRITON_F32_DOT must be one of {', '.join(F32_DOTS)}, got {value!r}")
    return value


@functools.cache
def _major(index: int) -> int:
    """CUDA device ``index``'s compute capability major: asked once per device, not per launch."""
    return torch.cuda.get_device_capability(index)[0]


def _hopper_or_newer() -> bool:
    """Whether the current CUDA device is sm_90 or newer (wgmma / tcgen05 tensor cores)."""
    return torch.cuda.is_available() and _major(torch.cuda.current_device()) >= 9


def dot_precision(dtype) -> str:
    """The ``PREC`` of ``dot``. 16-bit operands go to the tensor cores as they are. float32 operands
    follow PyTorch: tf32 when torch.backends.cuda.matmul.allow_tf32, otherwise "tf32x3" (three tf32
    products, float32 accuracy on the tensor cores; Triton's "ieee" dot runs on the CUDA cores and
    spills registers in these kernels) -- except on sm_90 and newer, where float32 dots are "ieee":
    compiled there by Triton 3.6 (an H100, benchmarks/gpu_check.py, RESULTS.md), the tf32x3 dots gave
    dv errors of 5e-2 and illegal memory accesses in the backward while every bfloat16 case passed.
    ``EDGEATTN_TRITON_F32_DOT`` (ieee, tf32, tf32x3) forces one."""
    if dtype == torch.bfloat16 and INTERPRET:
        return "bf16_as_f32"
    if dtype != torch.float32:
        return "tf32"  # ignored by tl.dot for 16-bit operands
    forced = _f32_dot_override()
    if forced is not None:
        return forced
    if not INTERPRET and _hopper_or_newer():
        return "ieee"
    if not torch.backends.cuda.matmul.allow_tf32:
        return "tf32x3"
    return "tf32"


# How the chunk kernels keep the cumulative gates: "pair" (float64 sums as float32 (hi, lo), exact
# differences down to gates of -1e4 a step) or "float32" (fla's form: float32 sums, half the bytes, read
# contiguously; a difference of two sums near 1e4 is off by up to 1e-3, a relative 1e-3 on its exp). On an
# H200 (RESULTS.md, 2026-11-28) the per-key gate cost our kernels 5-7x and fla's 1.4-2.4x, the kernels
# bound by the memory pipeline short of DRAM: the pairs are 4x a bfloat16 key's bytes, read at a stride
# of 2. "pair" stays the default until benchmarks/gpu_check.py has timed both (its "triton-f32g" rows).
GATE_SUMS = ("pair", "float32")
GATE_SUM = "pair"


def env_choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    """The environment variable ``name`` (case and spaces ignored) when set, else ``default``; ValueError
    unless it is one of ``allowed``."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def gate_sum_form() -> str:
    """EDGEATTN_GATE_SUM (pair or float32), else the module's GATE_SUM: how the cumulative gates are kept."""
    return env_choice("EDGEATTN_GATE_SUM", GATE_SUMS, GATE_SUM)


def gate_stride(gc) -> int:
    """The kernels' GS for cumulative gates ``gc``: 2 for (hi, lo) pairs, 1 for float32 sums (or none)."""
    return 1 if gc is None else gc.shape[-1]


def chunk_local_cumsum(g, BT: int, form: str | None = None):
    """g: [B, T, H, G] log-gates (any float dtype) -> their sums within chunks of BT tokens: float32
    halves [B, T, H, G, 2] (hi, lo) of float64 sums, or [B, T, H, G, 1] float32 sums where ``form``
    (default ``gate_sum_form()``) is "float32"."""
    B, T, H, G = g.shape
    form = form or gate_sum_form()
    if form not in GATE_SUMS:
        raise ValueError(f"the gate sums' form must be one of {', '.join(GATE_SUMS)}, got {form!r}")
    GS = 2 if form == "pair" else 1
    gc = torch.empty(B, T, H, G, GS, dtype=torch.float32, device=g.device)
    # keys in blocks of 32: a [64, 128] float64 scan in one program held 255 registers a thread and 64 KB of
    # shared memory on an H200 (ncu: 12.5% occupancy, 1.33 ms for B=8, T=2048, H=16, K=128; fla's 0.07 ms)
    BG = block_size(G, 32)
    chunk_local_cumsum_kernel[(triton.cdiv(T, BT), triton.cdiv(G, BG), B * H)](
        g, gc, T, H=H, G=G, BT=BT, BG=BG, GS=GS
    )
    return gc


def gate_grad(q, k, dq, dk, G: int, ht=None, dht=None, BT: int = 16):
    """dg [B, T, H, G] float32 from q, k, their gradients dq, dk (float32) and the final state's term.
    The reverse sum runs over the whole sequence: its rounding errors grow with T, so the chunk
    kernels compute dg chunk by chunk instead; this serves the fused recurrent kernel (T <= 64).

    ``ht``/``dht``: the final state [B, H, K, V] and its gradient (None when unused)."""
    B, T, H, K = q.shape
    dg = torch.empty(B, T, H, G, dtype=torch.float32, device=q.device)
    dgT = None if dht is None else (ht * dht).sum(-1).contiguous()  # [B, H, K]
    BK = block_size(K) if G == 1 else block_size(K, 64)
    chunk_bwd_dg_kernel[(triton.cdiv(K, BK), B * H)](
        q, k, dq, dk, dgT, dg, T, H=H, K=K, G=G, BT=BT, BK=BK, USE_DGT=dgT is not None
    )
    return dg


def check_inputs(q, k, v, g, initial_state):
    """Shapes and dtypes of the kernels' contract; returns them contiguous, the state float32."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [B, T, H, K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q, k, v must share one dtype of float32/bfloat16/float16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if K > 256:
        raise ValueError(f"the Triton kernels take head sizes K <= 256, got {K}")
    if g is not None and (g.dim() != 4 or g.shape[:3] != q.shape[:3] or g.shape[-1] not in (1, K)):
        raise ValueError(f"g must be [B, T, H, 1] or [B, T, H, K], got {tuple(g.shape)}")
    V = v.shape[-1]
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, H, K, V):
            raise ValueError(
                f"initial_state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.float().contiguous()
    g = None if g is None else g.contiguous()
    return q.contiguous(), k.contiguous(), v.contiguous(), g, initial_state


def empty_sequence(q, v, initial_state):
    """The result for T = 0: an empty output and the initial state (zeros if None)."""
    B, _, H, K = q.shape
    S = initial_state if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    return torch.zeros_like(v, dtype=q.dtype), S
