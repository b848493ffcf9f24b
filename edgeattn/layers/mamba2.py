"""Mamba2 (Dao & Gu 2024), the mixer of transformers' ``Mamba2Mixer`` (torch_forward) and Nemotron-H.

in_proj splits x W into the gate z [I], xBC [I + 2 G N] and dt [Hm]; a short causal depthwise conv (SiLU)
runs over xBC; then per head h with dt = softplus(dt + dt_bias), A = -exp(A_log):

    S_t = exp(dt_t A) S_{t-1} + B_t^T (dt_t x_t),   y_t = C_t S_t + D x_t

which is ``gated_linear_attention`` with C as the query, B as the key (group g serves heads
g*Hm/G ... (g+1)*Hm/G - 1), dt*x as the value, a [B, T, Hm] gate dt*A and scale 1; not a delta rule.
Then RMSNorm(y * SiLU(z)) in G groups and out_proj. Sizes: I = mamba_expand * d_model, Hm = I / P with
P = mamba_head_dim, N = ssm_state_size, G = mamba_n_groups. State: ``conv_state`` [B, I + 2 G N, W-1]
and ``recurrent_state`` [B, Hm, N, P] (transformers keeps [B, Hm, P, N]: the transpose).
"""

from __future__ import annotations

import math

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.layers.delta import init_dt_bias
from edgeattn.ops.common import gated_linear_attention
from edgeattn.ops.conv import short_conv

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


@register_mixer("mamba2")
class Mamba2(Mixer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        I = cfg.mamba_expand * D  # noqa: E741
        P, N, G = cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups
        if I % P:
            raise ValueError(f"mamba_expand * d_model ({I}) must be a multiple of mamba_head_dim ({P})")
        Hm = I // P
        if Hm % G:
            raise ValueError(f"the {Hm} mamba2 heads must be a multiple of mamba_n_groups ({G})")
        self.inner, self.n_heads, self.head_dim, self.state_size, self.n_groups = I, Hm, P, N, G
        self.conv_size = cfg.conv_size
        self.conv_dim = I + 2 * G * N
        self.in_proj = nn.Linear(D, I + self.conv_dim + Hm, bias=False)
        bound = 1 / math.sqrt(cfg.conv_size)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.conv_size).uniform_(-bound, bound))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim).uniform_(-bound, bound))
        self.dt_bias = nn.Parameter(init_dt_bias(Hm))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, Hm + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(Hm))
        self.norm_weight = nn.Parameter(torch.ones(I))
        self.o_proj = nn.Linear(I, D, bias=False)  # transformers' out_proj

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B = batch_size
        return [
            StateSpec("conv_state", (B, self.conv_dim, self.conv_size - 1)),
            StateSpec("recurrent_state", (B, self.n_heads, self.state_size, self.head_dim)),
        ]

    def forward(self, x, state=None):
        B, T, _ = x.shape
        I, Hm, P, N, G = self.inner, self.n_heads, self.head_dim, self.state_size, self.n_groups
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        z, xBC, dt = self.in_proj(x).float().split([I, self.conv_dim, Hm], dim=-1)
        xBC, conv_state = short_conv(
            xBC,
            self.conv_weight,
            self.conv_bias,
            initial_state=state["conv_state"],
            output_final_state=True,
            mode="auto",
        )
        xs, Bm, Cm = xBC.split([I, G * N, G * N], dim=-1)
        xs = xs.reshape(B, T, Hm, P)
        dt = F.softplus(dt + self.dt_bias.float())  # [B, T, Hm]
        g = -torch.exp(self.A_log.float()) * dt  # log-space gate dt * A
        # [B, T, G, N] -> [B, T, Hm, N]: group g serves Hm / G consecutive heads
        k = Bm.reshape(B, T, G, N).repeat_interleave(Hm // G, dim=2)
        q = Cm.reshape(B, T, G, N).repeat_interleave(Hm // G, dim=2)
        v = xs * dt.unsqueeze(-1)
        S0 = state["recurrent_state"]
        y, S = gated_linear_attention(
            q,
            k,
            v,
            g,
            scale=1.0,
            initial_state=S0,
            output_final_state=True,
            mode="auto",
            chunk_size=self.cfg.chunk_size,
        )
        y = y + self.D.float().view(Hm, 1) * xs  # [B, T, Hm, P]
        # Gated RMSNorm in G groups: RMSNorm(y * silu(z)) * weight
        y = (y.reshape(B, T, I) * F.silu(z)).view(B, T, G, I // G)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).reshape(B, T, I)
        y = self.o_proj((y * self.norm_weight).to(x.dtype))
        return y, {"conv_state": conv_state, "recurrent_state": S}
