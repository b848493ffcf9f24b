"""The Attention-Free Transformer family: AFT-simple with a learned decay, AFT-local, AFT-full.

    y = W_o (sigmoid(q_t) * sum_{i<=t} exp(k_i + w_{t,i}) v_i / sum_{i<=t} exp(k_i + w_{t,i}))

q, k, v are linear projections of x; AFT mixes channel by channel, so n_heads plays no part. ``aft`` and
``aft_local`` call ``aft(mode="auto")``: the chunk form for T > 1, the exported single step for T == 1
(see ``edgeattn.ops.aft``); ``aft_full`` has no fixed-size state and is for training only.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.aft import aft, aft_full, aft_state_names

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


def _initial_log_decays(D: int) -> torch.Tensor:
    """Per-channel log decays log(1 - 2^-s), s from 3 to 9: memories of about 8 to 512 tokens."""
    s = torch.linspace(3.0, 9.0, D, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -s))


class _Projections(Mixer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)

    def qkv(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def chunk_dividing(T: int, chunk_size: int) -> int:
    """The largest chunk <= chunk_size that divides T: no padded last chunk, whose shapes the ONNX exporter
    cannot follow (a prefill graph of T tokens, T < chunk_size or not a multiple of it)."""
    return next(c for c in range(min(chunk_size, T), 0, -1) if T % c == 0)


@register_mixer("aft")
class AFT(_Projections):
    """AFT-simple with a learned per-channel decay: w_{t,i} = (t - i) * decay, decay = -softplus(p) <= 0."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        # softplus(p) = -log_decay, so p = log(expm1(-log_decay)).
        self.decay_param = nn.Parameter(torch.log(torch.expm1(-_initial_log_decays(cfg.d_model))).float())

    @property
    def window(self) -> int:
        return 0

    def decay(self):
        return -F.softplus(self.decay_param)

    def window_bias(self):
        return None

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B, W, D = batch_size, self.window, self.cfg.d_model
        shapes = {"key": (B, W, D), "value": (B, W, D), "position": (B,)}
        return [StateSpec(name, shapes.get(name, (B, D))) for name in aft_state_names(W)]

    def forward(self, x, state=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        names = aft_state_names(self.window)
        state = tuple(state[n] for n in names)
        o, state = aft(
            q,
            k,
            v,
            decay=self.decay(),
            window_bias=self.window_bias(),
            initial_state=state,
            output_final_state=True,
            mode="auto",
            chunk_size=chunk_dividing(int(T), self.cfg.chunk_size),
        )
        return self.o_proj(o.to(x.dtype)), dict(zip(names, state))


@register_mixer("aft_local")
class AFTLocal(AFT):
    """AFT-local: a learned bias per distance and channel over the last ``cfg.window`` tokens ([W, D]),
    the learned decay beyond. The bias starts at distance * decay, continuous with the decay."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        if cfg.window < 1:
            raise ValueError(f"aft_local needs window >= 1, got {cfg.window}")
        dist = torch.arange(cfg.window, dtype=torch.float64).unsqueeze(1)
        self.window_bias_param = nn.Parameter((dist * _initial_log_decays(cfg.d_model)).float())

    @property
    def window(self) -> int:
        return self.cfg.window

    def window_bias(self):
        return self.window_bias_param


_NO_STATE = (
    "mixer 'aft_full' has learned pairwise biases over max_seq_len tokens and no fixed-size state, so it "
    "neither continues a sequence from a state nor exports as a recurrent graph; use mixer 'aft' "
    "(learned decay) or 'aft_local' (decay plus a window bias) for that"
)


@register_mixer("aft_full")
class AFTFull(_Projections):
    """AFT-full: a learned bias w[t, i] per pair of positions up to ``cfg.max_seq_len``. Training only."""

    fixed_size_state = False

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        # Zeros: every token starts as a plain exp(k)-weighted average of its past.
        self.pos_bias = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.max_seq_len))

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        raise ValueError(_NO_STATE)

    def init_state(self, batch_size: int, device=None):
        raise ValueError(_NO_STATE)

    def check_state(self, state, batch_size: int) -> None:
        raise ValueError(_NO_STATE)

    def forward(self, x, state=None):
        """Returns (y, {}): an empty state, which this layer refuses to be given back."""
        if state is not None:
            raise ValueError(_NO_STATE)
        q, k, v = self.qkv(x)
        o, _ = aft_full(q, k, v, self.pos_bias)
        return self.o_proj(o.to(x.dtype)), {}


__all__ = ["AFT", "AFTFull", "AFTLocal"]
