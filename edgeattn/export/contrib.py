"""ONNX Runtime's contrib ops, for the `onnxruntime` export target: each a ``torch.autograd.Function``
whose ``symbolic`` writes one ``com.microsoft`` node. In PyTorch each computes with edgeattn's own ops.

``fused_onnxruntime_op()`` installs them into ``edgeattn.ops.backend`` while the exporter traces
(``use_contrib_ops``); the ops called with ``mode="auto"`` (what the layers call) then run these. Only
``edgeattn.export`` imports this module; the ops never do.

    com.microsoft.LinearAttention(query [B,T,HQ*K], key [B,T,HV*K], value [B,T,HV*V], past_state [B,HV,K,V],
                                  decay "" | [B,T,HV] | [B,T,HV*K], beta [B,T,HV]?) -> output [B,T,HV*V], present_state
        update_rule "linear" (no decay, no beta), "gated" (S_t = exp(g_t) S_{t-1} + k_t^T v_t), "delta" (no
        decay) or "gated_delta"; explicit scale. HQ < HV is ONNX Runtime's "inverse GQA": query head h
        serves KV heads h*HV/HQ ... (h+1)*HV/HQ - 1, the key is given per value head.
    com.microsoft.CausalConvWithState(input [B,D,T], weight [D,1,W], bias [D]?, past_state [B,D,W-1])
        -> output [B,D,T], present_state [B,D,W-1]; activation "silu" or "none".
    com.microsoft.LinearAttentionGate(a [B,T,HV], dt_bias [HV], decay_scale [HV], b [B,T,HV])
        -> decay = decay_scale * softplus(a + dt_bias), beta = sigmoid(b): Gated DeltaNet's two gates.
    com.microsoft.GatedRMSNorm(X [B,T,HV*V], scale [V], gate [B,T,HV*V]) -> Y [B,T,HV*V]: a per-head RMSNorm
        over each group of V values, times silu(gate) or sigmoid(gate); epsilon, activation.

The delta rules and the convolution need onnxruntime >= 1.31 (checked against 1.32). The TorchScript
exporter cannot write an empty optional input, so the decay-less "delta" node is traced with its beta in
the decay slot and the exporter's ``edgeattn.export.graph.fix_optional_inputs`` moves it to the beta slot
after export.
"""

from __future__ import annotations

import contextlib

from edgeattn._deps import require
from edgeattn.ops.backend import use_contrib_ops
from edgeattn.ops.common.chunk import chunk_gated_recurrence
from edgeattn.ops.conv import short_conv
from edgeattn.ops.delta import delta_rule
from edgeattn.ops.norm import gated_rms_norm

torch = require("torch")


def _is_none(x) -> bool:
    return x is None or (hasattr(x, "node") and x.node().mustBeNone())


class _LinearAttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, g, scale: float, num_heads: int):
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
        if not _is_none(decay):
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


class _DeltaRuleOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, g, beta, scale: float, q_heads: int, kv_heads: int):
        B, T, _ = q.shape
        HQ, HV = q_heads, kv_heads
        K, V = q.shape[-1] // HQ, v.shape[-1] // HV
        qh = q.view(B, T, HQ, K).repeat_interleave(HV // HQ, dim=2)  # [B, T, HV, K]
        gate = (
            None
            if g is None
            else g.view(B, T, HV, -1).squeeze(-1)
            if g.shape[-1] == HV
            else g.view(B, T, HV, K)
        )
        o, S = delta_rule(
            qh,
            k.view(B, T, HV, K),
            v.view(B, T, HV, V),
            beta,
            gate,
            scale=scale,
            initial_state=state,
            output_final_state=True,
        )
        return o.reshape(B, T, HV * V), S

    @staticmethod
    def symbolic(g, q, k, v, state, decay, beta, scale: float, q_heads: int, kv_heads: int):
        gated = not _is_none(decay)
        inputs = [q, k, v, state, decay, beta] if gated else [q, k, v, state, beta]
        out, present = g.op(
            "com.microsoft::LinearAttention",
            *inputs,
            q_num_heads_i=q_heads,
            kv_num_heads_i=kv_heads,
            scale_f=float(scale),
            update_rule_s="gated_delta" if gated else "delta",
            outputs=2,
        )
        out.setType(v.type())
        present.setType(state.type())
        return out, present


def fused_delta_rule(q, k, v, beta, g, state, *, scale: float):
    """q, k: [B, T, H, K], v: [B, T, HV, V], beta: [B, T, HV], g: None, [B, T, HV] or [B, T, HV, K]
    (log space), state [B, HV, K, V]. Returns (o [B, T, HV, V] scaled, new state)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    k = k.repeat_interleave(HV // H, dim=2) if HV != H else k  # the op takes one key per value head
    qp, kp, vp = (x.reshape(B, T, -1).float() for x in (q, k, v))
    decay = None if g is None else g.reshape(B, T, -1).float()
    # Plain ints: a traced size passed to apply() breaks the TorchScript tracer.
    o, S = _DeltaRuleOp.apply(qp, kp, vp, state, decay, beta.float(), float(scale), int(H), int(HV))
    return o.view(B, T, HV, V), S


class _CausalConvOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state, activation: str):
        y, S = short_conv(
            x.transpose(1, 2),
            weight.squeeze(1),
            bias,
            activation=None if activation == "none" else activation,
            initial_state=state,
            output_final_state=True,
        )
        return y.transpose(1, 2), S

    @staticmethod
    def symbolic(g, x, weight, bias, state, activation: str):
        out, present = g.op(
            "com.microsoft::CausalConvWithState", x, weight, bias, state, activation_s=activation, outputs=2
        )
        out.setType(x.type())
        present.setType(state.type())
        return out, present


def fused_short_conv(x, weight, bias, state, *, activation: str | None):
    """x: [B, T, D], weight [D, W], bias [D] or None, state [B, D, W-1] -> (y [B, T, D], new state)."""
    y, S = _CausalConvOp.apply(
        x.float().transpose(1, 2),  # [B, D, T]
        weight.float().unsqueeze(1),  # [D, 1, W], ONNX Conv's depthwise layout
        # A zero bias rather than an absent one: the exporter cannot write an empty optional input.
        weight.new_zeros(weight.shape[0]) if bias is None else bias.float(),
        state.float(),
        "none" if activation is None else activation,
    )
    return y.transpose(1, 2), S


class _GateOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, dt_bias, decay_scale, b):
        return decay_scale * torch.nn.functional.softplus(a + dt_bias), torch.sigmoid(b)

    @staticmethod
    def symbolic(g, a, dt_bias, decay_scale, b):
        decay, beta = g.op("com.microsoft::LinearAttentionGate", a, dt_bias, decay_scale, b, outputs=2)
        decay.setType(a.type())
        beta.setType(b.type())
        return decay, beta


def fused_gate(a, dt_bias, decay_scale, b):
    """a, b [B, T, HV]; dt_bias, decay_scale [HV] (decay_scale = -exp(A_log)) -> (log-space decay
    decay_scale * softplus(a + dt_bias), beta = sigmoid(b)), both [B, T, HV] float32."""
    return _GateOp.apply(a.float(), dt_bias.float(), decay_scale.float(), b.float())


class _GatedNormOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps: float, activation: str, width: int):
        V = weight.shape[0]
        heads = (*x.shape[:-1], -1, V)  # [B, T, HV, V]
        y = gated_rms_norm(
            x.view(heads), weight, gate.view(heads), eps=eps, activation=activation, mode="plain"
        )
        return y.reshape(x.shape)

    @staticmethod
    def symbolic(g, x, weight, gate, eps: float, activation: str, width: int):
        y = g.op("com.microsoft::GatedRMSNorm", x, weight, gate, epsilon_f=eps, activation_s=activation)
        # x's traced type has lost its sizes here; without the known width the exporter's shape inference
        # loses every later state output's shape too
        y.setType(x.type().with_sizes([None, None, width]))
        return y


def fused_gated_rms_norm(x, weight, gate, *, eps: float, activation: str):
    """x, gate [B, T, HV, V], weight [V] -> rmsnorm(x) * weight * act(gate) [B, T, HV, V] float32, the norm
    over each head's V values; ``activation`` "silu" or "sigmoid"."""
    B, T, HV, V = x.shape
    y = _GatedNormOp.apply(
        x.reshape(B, T, HV * V).float(),
        weight.float(),
        gate.reshape(B, T, HV * V).float(),
        float(eps),
        activation,
        int(HV * V),
    )
    return y.view(B, T, HV, V)


# What the export installs for the ops' mode="auto" (edgeattn.ops.backend.contrib_op), by op name.
CONTRIB_OPS = {
    "linear_attention": fused_linear_attention,
    "delta_rule": fused_delta_rule,
    "short_conv": fused_short_conv,
    "gated_delta_gates": fused_gate,
    "gated_rms_norm": fused_gated_rms_norm,
}


@contextlib.contextmanager
def fused_onnxruntime_op(enabled: bool = True):
    """Within this block the ops' ``mode="auto"`` runs (and traces to) the contrib ops (export only)."""
    with use_contrib_ops(CONTRIB_OPS if enabled else None):
        yield
