"""Causal softmax attention over a preallocated KV buffer, as ONNX Runtime's ``com.microsoft.GroupQueryAttention``
runs it with past and present sharing one buffer (onnxruntime-genai's ``past_present_share_buffer``).

State: ``key``, ``value`` [B, H, L, D] (L = max_length; slots ``0 .. p-1`` hold the tokens seen) and
``position`` [B] (p, float32). T new tokens are written to slots ``p .. p+T-1`` and attend causally to
slots ``0 .. p+T-1``. In the exported graph this is one GQA node with

    seqlens_k = p + T - 1  (int32 [B]),  total_sequence_length = p + T  (int32 scalar)

and the runtime binds each buffer as both the past input and the present output, so a token writes D
floats per head into it instead of copying the cache (checked against the naive loop on ONNX Runtime
1.32: prompt chunks and single steps in any order). PyTorch computes the same thing for export and tests.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor


def _buffer_attention(
    q, k, v, past_key, past_value, seqlens_k, num_heads: int, kv_num_heads: int, scale: float
):
    """q packed [B, T, H*D], k, v [B, T, Hkv*D]; returns (o [B, T, H*D], key, value) with the new tokens
    written in. Query head h reads KV head h // (H / Hkv)."""
    B, T, _ = q.shape
    H, Hkv = num_heads, kv_num_heads
    D = q.shape[-1] // H
    p = int(seqlens_k[0]) - T + 1  # one position for the whole batch (edgeattn sessions keep one)
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
        out, key, value = g.op(
            "com.microsoft::GroupQueryAttention",
            q,
            k,
            v,
            past_key,
            past_value,
            seqlens_k,
            total,
            num_heads_i=num_heads,
            kv_num_heads_i=kv_num_heads,
            scale_f=float(scale),
            outputs=3,
        )
        out.setType(q.type())
        key.setType(past_key.type())
        value.setType(past_value.type())
        return out, key, value


def buffer_attention(
    q: Tensor, k: Tensor, v: Tensor, key: Tensor, value: Tensor, position: Tensor, *, scale: float
):
    """q: [B, T, H, D]; k, v: [B, T, Hkv, D] (``H`` a multiple of ``Hkv``: grouped KV heads); key, value:
    [B, Hkv, L, D] float32; position [B] float32 (tokens in the buffer).

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
    pos = position.to(torch.int32)
    seqlens_k = pos + (T - 1)  # [B] int32: index of the last valid slot after this call
    total = (pos[:1] + T).reshape(())  # int32 scalar: valid slots after this call
    packed = [x.reshape(B, T, -1).float() for x in (q, k, v)]  # [B, T, H*D], [B, T, Hkv*D] x2
    o, key, value = _GroupQueryAttentionOp.apply(
        *packed, key, value, seqlens_k, total, int(H), int(Hkv), float(scale)
    )
    return o.view(B, T, H, D), key, value, position + T
