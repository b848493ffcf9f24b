"""ONNX Runtime's fused ``com.microsoft.LinearAttention`` contrib op, for the `onnxruntime` export target.

In PyTorch this computes the gated recurrence with our own code; when the model is traced for ONNX
export inside ``fused_onnxruntime_op()``, it becomes one contrib node instead of plain ops:

    com.microsoft.LinearAttention(query [B,T,H*K], key [B,T,H*K], value [B,T,H*V], past_state [B,H,K,V],
                                  decay [B,T,H*K] or [B,T,H]) -> output [B,T,H*V], present_state
    update_rule = "gated" (S_t = exp(g_t) S_{t-1} + k_t^T v_t) or "linear" (no decay), explicit scale.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from edgeattn._deps import require

torch = require("torch")

_FUSED: ContextVar[bool] = ContextVar("edgeattn_fused_onnxruntime", default=False)


@contextlib.contextmanager
def fused_onnxruntime_op(enabled: bool = True):
    """Within this block, gated recurrences trace to com.microsoft.LinearAttention (export only)."""
    token = _FUSED.set(enabled)
    try:
        yield
    finally:
        _FUSED.reset(token)


def fused_enabled() -> bool:
    return _FUSED.get()


class _LinearAttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, g, scale: float, num_heads: int):
        from edgeattn.ops.common.chunk import chunk_gated_recurrence

        if torch.jit.is_tracing():
            # Traced for ONNX export: ``symbolic`` replaces this node, so the recurrence need not be traced
            # into it (its traced body broke the exporter's peephole pass for one head with a gate).
            return v.clone(), state.clone()
        B, T, _ = q.shape
        H = num_heads
        K, V = q.shape[-1] // H, v.shape[-1] // H
        gate = None
        if g is not None:
            gate = g.view(B, T, H, -1)  # [B, T, H, 1] or [B, T, H, K]
        o, S = chunk_gated_recurrence(
            q.view(B, T, H, K),
            k.view(B, T, H, K),
            v.view(B, T, H, V),
            gate,
            initial_state=state,
            chunk_size=64,
        )
        return (o * scale).reshape(B, T, H * V), S

    @staticmethod
    def symbolic(g, q, k, v, state, decay, scale: float, num_heads: int):
        inputs = [q, k, v, state]
        rule = "linear"
        if decay is not None and not (hasattr(decay, "node") and decay.node().mustBeNone()):
            inputs.append(decay)
            rule = "gated"
        out, present = g.op(
            "com.microsoft::LinearAttention",
            *inputs,
            q_num_heads_i=num_heads,
            kv_num_heads_i=num_heads,
            scale_f=float(scale),
            update_rule_s=rule,
            outputs=2,
        )
        # The output has the packed value's shape and the new state the old one's.
        out.setType(v.type())
        present.setType(state.type())
        return out, present


def fused_linear_attention(q, k, v, g, state, *, scale: float):
    """q, k: [B, T, H, K], v: [B, T, H, V], g: None, [B, T, H, 1] or [B, T, H, K] (log-space),
    state [B, H, K, V]. Returns (o [B, T, H, V] scaled, new state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    packed = [x.reshape(B, T, H * x.shape[-1]).float() for x in (q, k, v)]
    decay = None if g is None else g.reshape(B, T, H * g.shape[-1]).float()
    # Plain ints: a traced size passed to apply() breaks the TorchScript tracer.
    o, S = _LinearAttentionOp.apply(*packed, state, decay, float(scale), int(H))
    return o.view(B, T, H, V), S
