"""RWKV-4 (Peng et al. 2023; transformers' ``rwkv``): time mixing and channel mixing with token shift.

Time mixing: with x' the previous token's (normed) input (the token shift),
k = W_k (mu_k x + (1 - mu_k) x'), v and r alike, and the WKV

    wkv_t = (sum_{i<t} exp(k_i - (t-1-i) e^w) v_i + exp(u + k_t) v_t) / (same without v)

is ``aft`` with decay d = -exp(w) and a one-token window bias u + d (multiplying numerator and
denominator by exp(d) turns the distance t-1-i into t-i); the output is W_o (sigmoid(r) * wkv), the
sigmoid being AFT's own gate on the query. Channel mixing (in the MLP slot of the block, its token
shift kept in this layer's state): sigmoid(W_r x_r) * W_v relu(W_k x_k)^2.

State: ``shift`` and ``ffn_shift`` [B, D] (the previous inputs of the two mixes) and AFT's state with
W = 1 (numerator, denominator, max, max_age, key, value, position).
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.aft import chunk_dividing
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.aft import aft, aft_state_names

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


def _shift(x, prev):
    """x [B, T, D], prev [B, D] -> the previous token's x at every position [B, T, D]."""
    return torch.cat([prev.unsqueeze(1).to(x.dtype), x[:, :-1]], dim=1)


@register_mixer("rwkv")
class RWKV4(Mixer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        hidden = cfg.intermediate_size if cfg.intermediate_size > 0 else 4 * D
        self.time_decay = nn.Parameter(torch.linspace(-5.0, 1.0, D))  # decay -exp(w) per channel
        self.time_first = nn.Parameter(torch.full((D,), 0.5))  # u, the bonus of the current token
        self.mix_k = nn.Parameter(torch.full((D,), 0.5))
        self.mix_v = nn.Parameter(torch.full((D,), 0.5))
        self.mix_r = nn.Parameter(torch.full((D,), 0.5))
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.r_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        # channel mixing
        self.ffn_mix_k = nn.Parameter(torch.full((D,), 0.5))
        self.ffn_mix_r = nn.Parameter(torch.full((D,), 0.5))
        self.ffn_key = nn.Linear(D, hidden, bias=False)
        self.ffn_receptance = nn.Linear(D, D, bias=False)
        self.ffn_value = nn.Linear(hidden, D, bias=False)

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B, D = batch_size, self.cfg.d_model
        shapes = {"key": (B, 1, D), "value": (B, 1, D), "position": (B,)}
        aft_specs = [StateSpec(n, shapes.get(n, (B, D))) for n in aft_state_names(1)]
        return [StateSpec("shift", (B, D)), StateSpec("ffn_shift", (B, D)), *aft_specs]

    def forward(self, x, state=None):
        B, T, _ = x.shape
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        xs = _shift(x, state["shift"])
        k = self.k_proj(x * self.mix_k + xs * (1 - self.mix_k)).float()
        v = self.v_proj(x * self.mix_v + xs * (1 - self.mix_v)).float()
        r = self.r_proj(x * self.mix_r + xs * (1 - self.mix_r)).float()
        decay = -torch.exp(self.time_decay.float())
        bias = (self.time_first.float() + decay).unsqueeze(0)  # [1, D]
        names = aft_state_names(1)
        s = tuple(state[n] for n in names)
        # A chunk dividing T: no padded chunk, whose shapes the ONNX exporter cannot follow.
        o, s = aft(
            r,
            k,
            v,
            decay=decay,
            window_bias=bias,
            initial_state=s,
            output_final_state=True,
            mode="auto",
            chunk_size=chunk_dividing(int(T), self.cfg.chunk_size),
        )
        new = {"shift": x[:, -1].float(), "ffn_shift": state["ffn_shift"], **dict(zip(names, s))}
        return self.o_proj(o.to(x.dtype)), new

    def channel_mix(self, x, state):
        """The block's feed-forward part on its normed input x [B, T, D]; updates ``ffn_shift``."""
        xs = _shift(x, state["ffn_shift"])
        k = torch.square(torch.relu(self.ffn_key(x * self.ffn_mix_k + xs * (1 - self.ffn_mix_k))))
        r = torch.sigmoid(self.ffn_receptance(x * self.ffn_mix_r + xs * (1 - self.ffn_mix_r)))
        return r * self.ffn_value(k), {**state, "ffn_shift": x[:, -1].float()}
