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


def _buffer_attention(q, k, v, past_key, past_value, seqlens_k, num_heads: int, scale: float):
    """q, k, v packed [B, T, H*D]; returns (o [B, T, H*D], key, value) with the new tokens written in."""
    B, T, _ = q.shape
    H = num_heads
    D = q.shape[-1] // H
    p = int(seqlens_k[0]) - T + 1  # one position for the whole batch (edgeattn sessions keep one)
    key, value = past_key.clone(), past_value.clone()
    key[:, :, p : p + T] = k.view(B, T, H, D).transpose(1, 2).to(key.dtype)
    value[:, :, p : p + T] = v.view(B, T, H, D).transpose(1, 2).to(value.dtype)
    qh = q.view(B, T, H, D).transpose(1, 2).to(key.dtype)  # [B, H, T, D]
    scores = scale * qh @ key[:, :, : p + T].transpose(-1, -2)  # [B, H, T, p + T]
    i = torch.arange(T).unsqueeze(1) + p
    j = torch.arange(p + T).unsqueeze(0)
    scores = scores.masked_fill(j > i, float("-inf"))
    o = torch.softmax(scores, -1) @ value[:, :, : p + T]  # [B, H, T, D]
    return o.transpose(1, 2).reshape(B, T, H * D), key, value


class _GroupQueryAttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, past_key, past_value, seqlens_k, total, num_heads: int, scale: float):
        return _buffer_attention(q, k, v, past_key, past_value, seqlens_k, num_heads, scale)

    @staticmethod
    def symbolic(g, q, k, v, past_key, past_value, seqlens_k, total, num_heads: int, scale: float):
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
            kv_num_heads_i=num_heads,
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
    """q, k, v: [B, T, H, D]; key, value: [B, H, L, D] float32; position [B] float32 (tokens in the buffer).

    Returns (o [B, T, H, D], key, value, position + T). Traces to one GroupQueryAttention node.
    """
    B, T, H, D = q.shape
    if position.dim() != 1 or key.dim() != 4 or key.shape[1] != H or key.shape[3] != D:
        raise ValueError(
            f"key must be [B, {H}, L, {D}] and position [B], got {list(key.shape)} and {list(position.shape)}"
        )
    pos = position.to(torch.int32)
    seqlens_k = pos + (T - 1)  # [B] int32: index of the last valid slot after this call
    total = (pos[:1] + T).reshape(())  # int32 scalar: valid slots after this call
    packed = [x.reshape(B, T, H * D).float() for x in (q, k, v)]
    o, key, value = _GroupQueryAttentionOp.apply(*packed, key, value, seqlens_k, total, int(H), float(scale))
    return o.view(B, T, H, D), key, value, position + T
