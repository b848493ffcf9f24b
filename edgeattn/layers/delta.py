"""The delta-rule families: DeltaNet, Gated DeltaNet (Qwen3.5) and Kimi Delta Attention (Kimi Linear).

One mixer: project q, k (``H`` heads of width ``K``) and v (``HV`` heads of width ``V``), run one short
causal depthwise convolution over the concatenated q|k|v channels (SiLU; one ``conv_state`` as
Qwen3.5 and onnxruntime-genai keep it), L2-normalise q and k, beta = sigmoid(x W_b), then the delta rule

    S_t = exp(g_t) * S_{t-1},  S_t = S_t + beta_t k_t^T (v_t - k_t S_t),  o_t = K^-0.5 q_t S_t

with the family's gate g (None, per head, per key dimension), a per-head output RMSNorm (gated in the
gated families) and o_proj. State: ``conv_state`` [B, 2*H*K + HV*V, W-1] and ``recurrent_state``
[B, HV, K, V]. Each op is called with ``mode="auto"``: the single-token step for T == 1, the chunk form
for T > 1, ONNX Runtime's contrib ops when exporting for onnxruntime (``edgeattn.ops.backend``).
"""

from __future__ import annotations

import math

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.conv import short_conv
from edgeattn.ops.delta import delta_beta, delta_rule, gated_delta_gates
from edgeattn.ops.norm import gated_rms_norm

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last dimension (fla's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def init_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4):
    """Mamba's time-step bias: softplus(dt_bias) log-uniform in [dt_min, dt_max]."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))  # inverse softplus


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension (one head), times an optional activated gate."""

    def __init__(self, dim: int, eps: float, activation: str = "silu"):
        super().__init__()
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o, gate=None):
        return gated_rms_norm(o, self.weight, gate, eps=self.eps, activation=self.activation)


class DeltaRuleMixer(Mixer):
    """DeltaNet and the shared parts of its gated variants (``gate`` and ``output_gate`` differ)."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D, H = cfg.d_model, cfg.n_heads
        HV = cfg.num_v_heads or H
        if HV % H:
            raise ValueError(f"num_v_heads ({HV}) must be a multiple of n_heads ({H})")
        K = cfg.head_dim
        V = int(K * cfg.expand_v)
        self.n_heads, self.n_v_heads, self.key_dim, self.value_dim = H, HV, K, V
        self.conv_size = cfg.conv_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, HV * V, bias=False)
        self.b_proj = nn.Linear(D, HV, bias=False)
        # One depthwise conv over the q|k|v channels: [2*H*K + HV*V, W], nn.Conv1d's default init.
        C = 2 * H * K + HV * V
        bound = 1 / math.sqrt(cfg.conv_size)
        self.conv_weight = nn.Parameter(torch.empty(C, cfg.conv_size).uniform_(-bound, bound))
        self.o_norm = GatedRMSNorm(V, cfg.norm_eps, self.gate_activation)
        self.o_proj = nn.Linear(HV * V, D, bias=False)

    gate_activation = "silu"

    @property
    def conv_channels(self) -> int:
        return self.conv_weight.shape[0]

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B = batch_size
        return [
            StateSpec("conv_state", (B, self.conv_channels, self.conv_size - 1)),
            StateSpec("recurrent_state", (B, self.n_v_heads, self.key_dim, self.value_dim)),
        ]

    def gate(self, x):
        """Log-space gate: None, [B, T, HV] or [B, T, HV, K]."""
        return None

    def gates(self, x):
        """(beta [B, T, HV] float32, the log-space gate ``gate(x)``)."""
        return delta_beta(self.b_proj(x), self.cfg.allow_neg_eigval), self.gate(x)

    def output_gate(self, x):
        """[B, T, HV, V] or None."""
        return None

    def forward(self, x, state=None):
        B, T, _ = x.shape
        H, HV, K, V = self.n_heads, self.n_v_heads, self.key_dim, self.value_dim
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, C]
        qkv, conv_state = short_conv(
            qkv, self.conv_weight, initial_state=state["conv_state"], output_final_state=True, mode="auto"
        )
        q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
        q = l2_normalize(q.reshape(B, T, H, K))
        k = l2_normalize(k.reshape(B, T, H, K))
        v = v.reshape(B, T, HV, V)
        beta, g = self.gates(x)
        S0, scale = state["recurrent_state"], K**-0.5
        o, S = delta_rule(
            q,
            k,
            v,
            beta,
            g,
            scale=scale,
            initial_state=S0,
            output_final_state=True,
            mode="auto",
            chunk_size=self.cfg.chunk_size,
        )
        o = self.o_norm(o, self.output_gate(x))  # [B, T, HV, V]
        y = self.o_proj(o.reshape(B, T, HV * V).to(x.dtype))
        return y, {"conv_state": conv_state, "recurrent_state": S}


@register_mixer("deltanet")
class DeltaNet(DeltaRuleMixer):
    """DeltaNet (Yang et al. 2024, fla's layer): no decay, per-head RMSNorm on the output."""


@register_mixer("gated_deltanet")
class GatedDeltaNet(DeltaRuleMixer):
    """Gated DeltaNet (fla, Qwen3.5): g = -exp(A_log) * softplus(x W_a + dt_bias) per value head,
    output RMSNorm times SiLU(x W_g)."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D, HV = cfg.d_model, self.n_v_heads
        self.a_proj = nn.Linear(D, HV, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(HV).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(init_dt_bias(HV))
        self.g_proj = nn.Linear(D, HV * self.value_dim, bias=False)

    def gates(self, x):
        # -exp(A_log) * softplus(.): no log-sigmoid, so no Log(Sigmoid) underflow in exported graphs.
        decay_scale = -torch.exp(self.A_log.float())
        return gated_delta_gates(
            self.a_proj(x),
            self.b_proj(x),
            self.dt_bias,
            decay_scale,
            allow_neg_eigval=self.cfg.allow_neg_eigval,
        )

    def output_gate(self, x):
        return self.g_proj(x).view(*x.shape[:2], self.n_v_heads, self.value_dim)


@register_mixer("kda")
class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi Delta Attention (Kimi Linear, fla's KDA layer): a per-key-dimension gate
    g = -exp(A_log_h) * softplus(x W_f1 W_f2 + dt_bias) [B, T, HV, K] from a low-rank projection of rank V,
    output RMSNorm times sigmoid(x W_g1 W_g2) (no bias, as Kimi Linear; fla adds one)."""

    gate_activation = "sigmoid"

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D, HV, K, V = cfg.d_model, self.n_v_heads, self.key_dim, self.value_dim
        self.f_down = nn.Linear(D, V, bias=False)
        self.f_up = nn.Linear(V, HV * K, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(HV).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(init_dt_bias(HV * K))
        self.g_down = nn.Linear(D, V, bias=False)
        self.g_up = nn.Linear(V, HV * V, bias=False)

    def gate(self, x):
        B, T, _ = x.shape
        HV, K = self.n_v_heads, self.key_dim
        f = (self.f_up(self.f_down(x)).float() + self.dt_bias.float()).view(B, T, HV, K)
        return -torch.exp(self.A_log.float()).view(HV, 1) * F.softplus(f)

    def output_gate(self, x):
        return self.g_up(self.g_down(x)).view(*x.shape[:2], self.n_v_heads, self.value_dim)
