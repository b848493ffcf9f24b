"""The four families built on the gated linear recurrence: Linear Transformer, Performer, RetNet, GLA.

They share one mixer: project to heads, map features and gates (the only per-family part), run the
recurrence (chunk form for T > 1, the exported single step for T == 1), then an output block.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.common import gated_linear_attention, gated_recurrence_step
from edgeattn.ops.common.fused import fused_enabled, fused_linear_attention
from edgeattn.ops.linear import elu1
from edgeattn.ops.performer import favor_features, orthogonal_random_features
from edgeattn.ops.retnet import retnet_log_gammas
from edgeattn.ops.rff import gaussian_projection, rff_recurrence, rff_softmax_features

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


class GatedRecurrenceMixer(Mixer):
    normalize: bool = False  # Linear Transformer and Performer divide by q . z

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D, H = cfg.d_model, cfg.n_heads
        # Head widths: q/k cfg.head_dim (d_model // n_heads unless head_size is set), v expand_v times it;
        # edgeattn's own models keep both at d_model // n_heads (fla's GLA has expand_k = 0.5 of d_model).
        self.n_heads, self.head_dim = H, cfg.head_dim
        self.value_dim = int(cfg.head_dim * cfg.expand_v)
        self.q_proj = nn.Linear(D, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, H * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, H * self.value_dim, bias=False)
        self.o_proj = nn.Linear(H * self.value_dim, D, bias=False)

    @property
    def key_dim(self) -> int:
        """Size of the feature-mapped keys (the K of the state [B, H, K, V])."""
        return self.head_dim

    def features(self, q, k):
        return q, k

    def gate(self, x):
        """Log-space gate: None, [H] or [B, T, H, K]."""
        return None

    def output(self, o, x):
        """o: [B, T, H, V] -> [B, T, D]."""
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        H, K, V = self.n_heads, self.key_dim, self.value_dim
        specs = [StateSpec("recurrent_state", (batch_size, H, K, V))]
        if self.normalize:
            specs.append(StateSpec("normalizer", (batch_size, H, K)))
        return specs

    def forward(self, x, state=None):
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, Dh)
        k = self.k_proj(x).view(B, T, H, Dh)
        v = self.v_proj(x).view(B, T, H, self.value_dim)
        q, k = self.features(q, k)
        g = self.gate(x)
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        scale = None if self.normalize else self.key_dim**-0.5
        if fused_enabled():
            o, S, z = self._fused(q, k, v, g, state)
        elif T == 1:
            if g is not None:
                g = g.view(1, H, 1).expand(B, H, 1) if g.dim() == 1 else g[:, 0]
            o, S, z = gated_recurrence_step(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                g,
                state["recurrent_state"],
                state.get("normalizer"),
                scale=1.0 if scale is None else scale,
            )
            o = o.unsqueeze(1)
        else:
            init = (
                (state["recurrent_state"], state["normalizer"])
                if self.normalize
                else state["recurrent_state"]
            )
            o, final = gated_linear_attention(
                q,
                k,
                v,
                g,
                scale=scale,
                normalize=self.normalize,
                initial_state=init,
                output_final_state=True,
                chunk_size=self.cfg.chunk_size,
            )
            S, z = final if self.normalize else (final, None)
        new_state = {"recurrent_state": S}
        if self.normalize:
            new_state["normalizer"] = z
        return self.output(o.to(x.dtype), x), new_state

    def _fused(self, q, k, v, g, state):
        """The recurrence as ONNX Runtime's fused op (export target `onnxruntime`). The normalizer is
        the same recurrence run on a value of ones: a second, [K, 1]-state op."""
        B, T, H, _ = q.shape
        if g is not None and g.dim() == 1:
            g = g.view(1, 1, H, 1).expand(B, T, H, 1)
        scale = 1.0 if self.normalize else self.key_dim**-0.5
        o, S = fused_linear_attention(q, k, v, g, state["recurrent_state"], scale=scale)
        if not self.normalize:
            return o, S, None
        den, z = fused_linear_attention(
            q, k, v.new_ones(B, T, H, 1), g, state["normalizer"].unsqueeze(-1), scale=1.0
        )
        return o / (den + 1e-6), S, z.squeeze(-1)


class _FeatureMapped(GatedRecurrenceMixer):
    """Linear Transformer and Performer: a normalized recurrence over a feature map of q and k.

    ``cfg.feature_map`` picks the map ("default": the family's own). "rff" (random Fourier features,
    ``edgeattn.ops.rff``) estimates exp(q . k / sqrt(K)) with signed features, so its normalizer can be
    <= 0: the layer runs ``rff_recurrence``, which floors it (same state names; ``recurrent_state``
    [B, H, 2m + 1, V], ``normalizer`` [B, H, 2m + 1], the extra row carrying the key weights).
    """

    normalize = True
    default_map = "elu1"
    eps = 1e-6

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        name = self.default_map if cfg.feature_map == "default" else cfg.feature_map
        if name not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be 'default' or one of {', '.join(FEATURE_MAPS)}, got {cfg.feature_map!r}"
            )
        self.feature_map = name
        gen = torch.Generator().manual_seed(1234 + layer_idx)
        if name == "favor":
            self.register_buffer(
                "projection", orthogonal_random_features(cfg.feature_dim, self.head_dim, gen)
            )
        elif name == "rff":
            self.register_buffer("projection", gaussian_projection(cfg.feature_dim, self.head_dim, gen))

    @property
    def key_dim(self) -> int:
        return {"elu1": self.head_dim, "favor": self.cfg.feature_dim, "rff": 2 * self.cfg.feature_dim + 1}[
            self.feature_map
        ]

    def features(self, q, k):
        return FEATURE_MAPS[self.feature_map](self, q, k)

    def forward(self, x, state=None):
        if self.feature_map != "rff":
            return super().forward(x, state)
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, Dh)
        k = self.k_proj(x).view(B, T, H, Dh)
        v = self.v_proj(x).view(B, T, H, self.value_dim)
        q, k = self.features(q, k)
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        init = (state["recurrent_state"], state["normalizer"])
        # T == 1: one exported step (the recurrent form of a single token), else the chunk form.
        mode = "recurrent" if T == 1 else "chunk"
        o, (S, z) = rff_recurrence(q, k, v, init, eps=self.eps, mode=mode, chunk_size=self.cfg.chunk_size)
        return self.output(o.to(x.dtype), x), {"recurrent_state": S, "normalizer": z}


FEATURE_MAPS = {
    "elu1": lambda layer, q, k: (elu1(q), elu1(k)),
    "favor": lambda layer, q, k: (
        favor_features(q, layer.projection, is_query=True),
        favor_features(k, layer.projection),
    ),
    "rff": lambda layer, q, k: rff_softmax_features(q, k, layer.projection),
}


@register_mixer("linear")
class LinearAttention(_FeatureMapped):
    """Linear Transformer: elu+1 features (by default), normalized, no decay."""

    default_map = "elu1"


@register_mixer("performer")
class Performer(_FeatureMapped):
    """FAVOR+ (by default): positive orthogonal random features, fixed after construction (a buffer, so
    it is saved)."""

    default_map = "favor"


class _HeadNormGate(nn.Module):
    """Per-head normalization of the recurrence output, times swish(x W_g), then the output projection."""

    def __init__(self, d_model: int, width: int, n_heads: int, eps: float):
        super().__init__()
        self.n_heads, self.eps = n_heads, eps
        self.weight = nn.Parameter(torch.ones(width))  # width = n_heads * value head width
        self.g_proj = nn.Linear(d_model, width, bias=False)

    def forward(self, o, x):  # o: [B, T, H, V]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o.reshape(*o.shape[:2], -1) * self.weight
        return o * F.silu(self.g_proj(x))


@register_mixer("retnet")
class RetNet(GatedRecurrenceMixer):
    """Multi-scale retention: gamma_h = 1 - 2^(-5-h), per-head group norm, swish gate."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.register_buffer("log_gamma", retnet_log_gammas(cfg.n_heads), persistent=False)
        self.norm_gate = _HeadNormGate(cfg.d_model, cfg.n_heads * self.value_dim, cfg.n_heads, cfg.norm_eps)

    def gate(self, x):
        return self.log_gamma

    def output(self, o, x):
        return self.o_proj(self.norm_gate(o, x))


@register_mixer("gla")
class GLA(GatedRecurrenceMixer):
    """Gated Linear Attention: alpha_t = sigmoid(x W1 W2 + b)^(1/16) per key dimension, output gate."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.gk_down = nn.Linear(D, cfg.gate_low_rank, bias=False)
        self.gk_up = nn.Linear(cfg.gate_low_rank, cfg.n_heads * self.head_dim, bias=True)
        self.norm_gate = _HeadNormGate(D, cfg.n_heads * self.value_dim, cfg.n_heads, cfg.norm_eps)

    def gate(self, x):
        B, T, _ = x.shape
        logits = self.gk_up(self.gk_down(x))
        # log sigmoid written as -softplus(-x): exports without Log(Sigmoid) underflowing to -inf.
        return (-F.softplus(-logits) / self.cfg.gate_logit_normalizer).view(B, T, self.n_heads, self.head_dim)

    def output(self, o, x):
        return self.o_proj(self.norm_gate(o, x))
