"""Causal softmax attention over a preallocated KV buffer, as ONNX Runtime's ``com.microsoft.GroupQueryAttention``
runs it with past and present sharing one buffer (onnxruntime-genai's ``past_present_share_buffer``).

State: ``key``, ``value`` [B, H, L, D] (L = max_length; slots ``0 .. p-1`` hold the tokens seen) and
``position`` [B] (p, float32). T new tokens are written to slots ``p .. p+T-1`` and attend causally to
slots ``0 .. p+T-1``. In the exported graph this is one GQA node with

    seqlens_k = p + T - 1  (int32 [B]),  total_sequence_length = p + T  (int32 scalar)

and the runtime binds each buffer as both the past input and the present output, so a token writes D
floats per head into it instead of copying the cache (checked against the naive loop on ONNX Runtime
1.32: prompt chunks and single steps in any order). PyTorch computes the same thing for export and tests.

With ``rotary = (cos, sin)`` tables [L, R/2] the node also rotates q and k (``do_rotary``, rotate-half
convention, the first R dims of each head) at positions p .. p+T-1, so no rotary ops surround it; ONNX
Runtime takes R/2 a multiple of 8 and R <= D (``rope_tables``).
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor


def rope_tables(length: int, rotary_dim: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """GroupQueryAttention's cos and sin caches [length, rotary_dim / 2]: position p, frequency i is
    p * theta^(-2i / rotary_dim), multiplied in float32 as ``layers.softmax._rotate`` and transformers do."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    )
    freqs = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_freq
    return freqs.cos(), freqs.sin()


def gqa_rotary_ok(rotary_dim: int, head_dim: int) -> bool:
    """Whether GroupQueryAttention can rotate ``rotary_dim`` of ``head_dim`` dims itself (ONNX Runtime
    1.32's CPU kernel: cos_cache width <= head_dim / 2 and a multiple of 8)."""
    return rotary_dim <= head_dim and rotary_dim % 16 == 0


def _rotate_half(x, cos, sin):
    """x [B, T, heads, D]; cos, sin [T, R/2]: the first R dims rotated (rotate-half), the rest kept."""
    R = 2 * cos.shape[-1]
    c = torch.cat([cos, cos], -1)[None, :, None, :]  # [1, T, 1, R]
    s = torch.cat([sin, sin], -1)[None, :, None, :]
    xr, xp = x[..., :R], x[..., R:]
    rotated = torch.cat([-xr[..., R // 2 :], xr[..., : R // 2]], dim=-1)
    return torch.cat([xr * c + rotated * s, xp], dim=-1)


def _buffer_attention(
    q, k, v, past_key, past_value, seqlens_k, num_heads: int, kv_num_heads: int, scale: float, rotary=None
):
    """q packed [B, T, H*D], k, v [B, T, Hkv*D]; returns (o [B, T, H*D], key, value) with the new tokens
    written in. Query head h reads KV head h // (H / Hkv). ``rotary``: (cos, sin) [L, R/2] or None."""
    B, T, _ = q.shape
    H, Hkv = num_heads, kv_num_heads
    D = q.shape[-1] // H
    p = int(seqlens_k[0]) - T + 1  # one position for the whole batch (edgeattn sessions keep one)
    if rotary is not None:
        cos, sin = (t[p : p + T] for t in rotary)
        q = _rotate_half(q.view(B, T, H, D), cos, sin).reshape(B, T, H * D)
        k = _rotate_half(k.view(B, T, Hkv, D), cos, sin).reshape(B, T, Hkv * D)
    key, value = past_key.clone(), past_value.clone()
    key[:, :, p : p + T] = k.view(B, T, Hkv, D).transpose(1, 2).to(key.dtype)
    value[:, :, p : p + T] = v.view(B, T, Hkv, D).transpose(1, 2).to(value.dtype)
    kr, vr = key[:, :, : p + T], value[:, :, : p + T]  # [B, Hkv, p + T, D]
    if H != Hkv:
        kr, vr = kr.repeat_interleave(H // Hkv, dim=1), vr.repeat_interleave(H // Hkv, dim=1)
    qh = q.view(B, T, H, D).transpose(1, 2).to(key.dtype)  # [B, H, T, D]
    scores = scale * qh @ kr.transpose(-1, -2)  # [B, H, T, p + T]
    i = torch.arange(T).unsqueeze(1) + p
    j = torch.arange(p + T).unsqueeze(0)
    scores = scores.masked_fill(j > i, float("-inf"))
    o = torch.softmax(scores, -1) @ vr  # [B, H, T, D]
    return o.transpose(1, 2).reshape(B, T, H * D), key, value


def _gqa_node(g, inputs: list, num_heads: int, kv_num_heads: int, scale: float, **rotary):
    q, past_key, past_value = inputs[0], inputs[3], inputs[4]
    out, key, value = g.op(
        "com.microsoft::GroupQueryAttention",
        *inputs,
        num_heads_i=num_heads,
        kv_num_heads_i=kv_num_heads,
        scale_f=float(scale),
        **rotary,
        outputs=3,
    )
    out.setType(q.type())
    key.setType(past_key.type())
    value.setType(past_value.type())
    return out, key, value


class _GroupQueryAttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, past_key, past_value, seqlens_k, total, num_heads: int, kv_num_heads: int, scale
    ):
        return _buffer_attention(q, k, v, past_key, past_value, seqlens_k, num_heads, kv_num_heads, scale)

    @staticmethod
    def symbolic(
        g, q, k, v, past_key, past_value, seqlens_k, total, num_heads: int, kv_num_heads: int, scale
    ):
        inputs = [q, k, v, past_key, past_value, seqlens_k, total]
        return _gqa_node(g, inputs, num_heads, kv_num_heads, scale)


class _RotaryGroupQueryAttentionOp(torch.autograd.Function):
    """The same node rotating q and k itself: cos and sin caches [L, R/2] as its inputs 7 and 8."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        past_key,
        past_value,
        seqlens_k,
        total,
        cos,
        sin,
        num_heads: int,
        kv_num_heads: int,
        scale,
    ):
        return _buffer_attention(
            q, k, v, past_key, past_value, seqlens_k, num_heads, kv_num_heads, scale, (cos, sin)
        )

    @staticmethod
    def symbolic(
        g, q, k, v, past_key, past_value, seqlens_k, total, cos, sin, num_heads: int, kv_num_heads: int, scale
    ):
        inputs = [q, k, v, past_key, past_value, seqlens_k, total, cos, sin]
        return _gqa_node(g, inputs, num_heads, kv_num_heads, scale, do_rotary_i=1, rotary_interleaved_i=0)


def buffer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key: Tensor,
    value: Tensor,
    position: Tensor,
    *,
    scale: float,
    rotary: tuple[Tensor, Tensor] | None = None,
):
    """q: [B, T, H, D]; k, v: [B, T, Hkv, D] (``H`` a multiple of ``Hkv``: grouped KV heads); key, value:
    [B, Hkv, L, D] float32; position [B] float32 (tokens in the buffer); ``rotary``: (cos, sin) [L, R/2]
    from ``rope_tables`` to rotate q and k at their positions first.

    Returns (o [B, T, H, D], key, value, position + T). Traces to one GroupQueryAttention node.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D or H % Hkv:
        raise ValueError(
            f"k and v must be [B, T, Hkv, {D}] with {H} a multiple of Hkv, got {list(k.shape)} and {list(v.shape)}"
        )
    if position.dim() != 1 or key.dim() != 4 or key.shape[1] != Hkv or key.shape[3] != D:
        raise ValueError(
            f"key must be [B, {Hkv}, L, {D}] and position [B], got {list(key.shape)} and {list(position.shape)}"
        )
    new_position = position + T  # [B] float32: tokens in the buffer after this call
    end = new_position.to(torch.int32)
    seqlens_k = end - 1  # [B] int32: index of the last valid slot after this call
    total = end.max()  # int32 scalar: valid slots after this call (one position for the whole batch)
    if rotary is not None:
        R2 = rotary[0].shape[-1]
        if rotary[0].shape != (key.shape[2], R2) or rotary[1].shape != rotary[0].shape or 2 * R2 > D:
            raise ValueError(
                f"rotary tables must be [{key.shape[2]}, R/2] with R <= {D}, got "
                f"{list(rotary[0].shape)} and {list(rotary[1].shape)}"
            )
    packed = [x.reshape(B, T, -1).float() for x in (q, k, v)]  # [B, T, H*D], [B, T, Hkv*D] x2
    if rotary is None:
        o, key, value = _GroupQueryAttentionOp.apply(
            *packed, key, value, seqlens_k, total, int(H), int(Hkv), float(scale)
        )
    else:
        cos, sin = (t.float() for t in rotary)
        o, key, value = _RotaryGroupQueryAttentionOp.apply(
            *packed, key, value, seqlens_k, total, cos, sin, int(H), int(Hkv), float(scale)
        )
    return o.view(B, T, H, D), key, value, new_position
