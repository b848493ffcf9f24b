"""FLASH: the gated attention unit (GAU) with mixed-chunk attention (Hua et al. 2022).

    U = silu(x W_u)  [B, T, e]     V = silu(x W_v)  [B, T, e]     Z = silu(x W_z)  [B, T, s]
    q_quad, k_quad, q_lin, k_lin = Z * gamma_i + beta_i           (four per-use scale-and-offset maps)
    y = (U * mixed_chunk_attention(q_quad, k_quad, q_lin, k_lin, V)) W_o

with e = flash_expansion * d_model, s = flash_qk_dim, chunks of flash_chunk tokens and a learned
relative bias per offset inside a chunk. One head: the gate U replaces multi-head attention.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.flash import FlashState, mixed_chunk_attention

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


@register_mixer("flash")
class FLASH(Mixer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.chunk = C = cfg.flash_chunk
        self.hidden = e = int(cfg.flash_expansion * D)
        self.qk_dim = s = cfg.flash_qk_dim
        if C < 1 or e < 1 or s < 1:
            raise ValueError(
                f"flash_chunk, flash_expansion * d_model and flash_qk_dim must be >= 1, got {C}, {e}, {s}"
            )
        self.in_proj = nn.Linear(D, 2 * e + s, bias=False)  # [W_u | W_v | W_z] in one matmul
        self.o_proj = nn.Linear(e, D, bias=False)
        # Scale-and-offset of Z for q_quad, k_quad, q_lin, k_lin; gamma ~ N(0, 0.02) as in the paper.
        self.gamma = nn.Parameter(torch.randn(4, s) * 0.02)
        self.beta = nn.Parameter(torch.zeros(4, s))
        # A positive start (uniform weights within the chunk) lets gradients through relu^2 from step one.
        self.rel_bias = nn.Parameter(torch.full((C,), C**-0.5))

    @property
    def scales(self) -> dict:
        return {"quad_scale": 1.0 / self.chunk, "lin_scale": 1.0 / self.chunk}

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B, C, e, s = batch_size, self.chunk, self.hidden, self.qk_dim
        return [
            StateSpec("linear_state", (B, s, e)),  # sum of k_lin^T v over the finished chunks
            StateSpec("chunk_state", (B, s, e)),  # sum of k_lin^T v over the current chunk so far
            StateSpec("key_quad", (B, C, s)),  # the current chunk's keys and values, slot = position
            StateSpec("value", (B, C, e)),
            StateSpec("position", (B,)),  # tokens already in the current chunk, 0 <= position < C
        ]

    def forward(self, x, state=None):
        B = x.shape[0]
        e, s = self.hidden, self.qk_dim
        u, v, z = F.silu(self.in_proj(x)).split([e, e, s], dim=-1)
        qq, kq, ql, kl = (z.unsqueeze(-2) * self.gamma + self.beta).unbind(-2)  # each [B, T, s]
        init = None  # no state: the faster chunk-aligned path (one token: the step from zeros)
        if state is not None:
            self.check_state(state, B)
            init = FlashState(*(state[name] for name in FlashState._fields))
        o, final = mixed_chunk_attention(
            qq,
            kq,
            ql,
            kl,
            v,
            chunk_size=self.chunk,
            rel_bias=self.rel_bias,
            initial_state=init,
            output_final_state=True,
            mode="auto",
            **self.scales,
        )
        y = self.o_proj(u * o.to(u.dtype))
        return y, dict(final._asdict())
