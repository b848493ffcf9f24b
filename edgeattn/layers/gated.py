"""The four families built on the gated linear recurrence: Linear Transformer, Performer, RetNet, GLA.

They share one mixer: project to heads, map features and gates (the only per-family part), run the
recurrence (``gated_linear_attention(mode="auto")``: the chunk form for T > 1, the exported single step
for T == 1, ONNX Runtime's contrib op when exporting for onnxruntime), then an output block.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.common import gated_linear_attention, gated_state_steps
from edgeattn.ops.linear import elu1
from edgeattn.ops.performer import favor_features, orthogonal_random_features
from edgeattn.ops.retnet import retnet_log_gammas
from edgeattn.ops.rff import gaussian_projection, rff_recurrence, rff_softmax_features

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


def rotary(x, pos, rotary_dim: int, theta: float):
    """Rotary embedding (rotate-half convention, fla's and GPT-NeoX's) on the first ``rotary_dim`` dims of
    x [B, T, H, K] at float positions pos [B, T]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=x.device) / rotary_dim)
    )
    freqs = pos[..., None] * inv_freq  # [B, T, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [B, T, 1, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    xr, xp = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([(xr * cos + rotated * sin).to(x.dtype), xp], dim=-1)


# Elementwise feature maps on q and k (retnet: fla's ``feature_map``, a transformers activation name;
# linear: fla's linear_attn maps besides its learned one).
ELEMENTWISE_MAPS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "elu1": elu1,
    "elu": F.elu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}


class GatedRecurrenceMixer(Mixer):
    normalize: bool = False  # Linear Transformer and Performer divide by q . z
    has_steps = True  # gated_state_steps (not the "rff" map, whose recurrence floors its normalizer)

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D, H = cfg.d_model, cfg.n_heads
        # Head widths: q/k cfg.head_dim (d_model // n_heads unless head_size is set), v expand_v times it;
        # edgeattn's own models keep both at d_model // n_heads (fla's GLA has expand_k = 0.5 of d_model).
        # Grouped key/value heads (n_kv_heads, fla's num_kv_heads): each k/v head serves n_heads / n_kv_heads
        # consecutive query heads.
        self.n_heads, self.head_dim = H, cfg.head_dim
        self.n_kv_heads = cfg.n_kv_heads or H
        self.value_dim = int(cfg.head_dim * cfg.expand_v)
        self.q_proj = nn.Linear(D, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv_heads * self.value_dim, bias=False)
        self.o_proj = nn.Linear(H * self.value_dim, D, bias=False)
        self.rotary = self.supports_rotary and bool(cfg.rope_theta)

    supports_rotary: bool = False  # retnet: rotary embeddings on q/k when cfg.rope_theta is set

    def project(self, x):
        """q [B, T, H, K], k [B, T, H, K], v [B, T, H, V], the grouped k/v heads repeated."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, Dh)
        k = self.k_proj(x).view(B, T, Hkv, Dh)
        v = self.v_proj(x).view(B, T, Hkv, self.value_dim)
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=2)  # [B, T, H, K]
            v = v.repeat_interleave(H // Hkv, dim=2)  # [B, T, H, V]
        return q, k, v

    def rotate(self, q, k, position):
        """Rotary embeddings at positions position[b] + t (float32 [B]); returns q, k, position + T."""
        T = q.shape[1]
        t = torch.ones_like(q[0, :, 0, 0], dtype=torch.float32).cumsum(0) - 1  # [T], dynamic T
        pos = position[:, None] + t[None, :]  # [B, T]
        q = rotary(q, pos, self.cfg.rotary_dim or self.head_dim, self.cfg.rope_theta)
        k = rotary(k, pos, self.cfg.rotary_dim or self.head_dim, self.cfg.rope_theta)
        return q, k, position + T

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
        if self.rotary:
            specs.append(StateSpec("position", (batch_size,)))
        return specs

    def forward(self, x, state=None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q, k = self.features(q, k)
        g = self.gate(x)
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        if self.rotary:
            q, k, position = self.rotate(q, k, state["position"])
        scale = None if self.normalize else self.key_dim**-0.5
        init = (state["recurrent_state"], state["normalizer"]) if self.normalize else state["recurrent_state"]
        o, final = gated_linear_attention(
            q,
            k,
            v,
            g,
            scale=scale,
            normalize=self.normalize,
            initial_state=init,
            output_final_state=True,
            mode="auto",
            chunk_size=self.cfg.chunk_size,
        )
        S, z = final if self.normalize else (final, None)
        new_state = {"recurrent_state": S}
        if self.normalize:
            new_state["normalizer"] = z
        if self.rotary:
            new_state["position"] = position
        if self.emit_steps:
            z0 = state["normalizer"] if self.normalize else None
            S_t, z_t = gated_state_steps(k, v, g, state["recurrent_state"], z0)
            self.last_steps = {"recurrent_state": S_t}
            if self.normalize:
                self.last_steps["normalizer"] = z_t
            if self.rotary:
                t = torch.ones_like(S_t[0, :, 0, 0, 0]).cumsum(0)  # [T]: 1 .. T
                self.last_steps["position"] = state["position"][:, None] + t[None, :]
        return self.output(o.to(x.dtype), x), new_state


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
        if name not in FEATURE_MAPS and name not in ELEMENTWISE_MAPS:
            raise ValueError(
                f"feature_map must be 'default' or one of {', '.join([*FEATURE_MAPS, *ELEMENTWISE_MAPS])}, "
                f"got {cfg.feature_map!r}"
            )
        self.feature_map = name
        self.has_steps = name != "rff"
        self.normalize = cfg.attn_normalize
        if name == "rff" and not self.normalize:
            raise ValueError(
                "feature_map 'rff' needs attn_normalize=True (its normalizer is part of the map)"
            )
        if name == "hadamard":  # fla's elementwise_product: (x W1 + b1) * (x W2 + b2) per head, q and k
            K = self.head_dim
            self.q_map1, self.q_map2 = nn.Linear(K, K), nn.Linear(K, K)
            self.k_map1, self.k_map2 = nn.Linear(K, K), nn.Linear(K, K)
        if cfg.output_norm:
            self.norm_gate = _HeadNormGate(
                cfg.d_model, cfg.n_heads * self.value_dim, cfg.n_heads, cfg.norm_eps, gate=False
            )
        gen = torch.Generator().manual_seed(1234 + layer_idx)
        if name == "favor":
            self.register_buffer(
                "projection", orthogonal_random_features(cfg.feature_dim, self.head_dim, gen)
            )
        elif name == "rff":
            self.register_buffer("projection", gaussian_projection(cfg.feature_dim, self.head_dim, gen))

    @property
    def key_dim(self) -> int:
        return {"favor": self.cfg.feature_dim, "rff": 2 * self.cfg.feature_dim + 1}.get(
            self.feature_map, self.head_dim
        )

    def features(self, q, k):
        if self.feature_map in ELEMENTWISE_MAPS:
            f = ELEMENTWISE_MAPS[self.feature_map]
            q, k = f(q), f(k)
        else:
            q, k = FEATURE_MAPS[self.feature_map](self, q, k)
        norm = self.cfg.qk_sum_norm
        if "q" in norm:
            q = q / (q.sum(-1, keepdim=True) + 1e-4)
        if "k" in norm:
            k = k / (k.sum(-1, keepdim=True) + 1e-4)
        return q, k

    def output(self, o, x):
        if self.cfg.output_norm:
            return self.o_proj(self.norm_gate(o, x))
        return super().output(o, x)

    def forward(self, x, state=None):
        if self.feature_map != "rff":
            return super().forward(x, state)
        B = x.shape[0]
        q, k, v = self.project(x)
        q, k = self.features(q, k)
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        init = (state["recurrent_state"], state["normalizer"])
        o, (S, z) = rff_recurrence(q, k, v, init, eps=self.eps, mode="auto", chunk_size=self.cfg.chunk_size)
        return self.output(o.to(x.dtype), x), {"recurrent_state": S, "normalizer": z}


FEATURE_MAPS = {
    "elu1": lambda layer, q, k: (elu1(q), elu1(k)),
    "favor": lambda layer, q, k: (
        favor_features(q, layer.projection, is_query=True),
        favor_features(k, layer.projection),
    ),
    "rff": lambda layer, q, k: rff_softmax_features(q, k, layer.projection),
    "hadamard": lambda layer, q, k: (
        layer.q_map1(q) * layer.q_map2(q),
        layer.k_map1(k) * layer.k_map2(k),
    ),
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
    """Per-head RMS normalization of the recurrence output, times swish(x W_g) (unless ``gate=False``);
    the output projection follows."""

    def __init__(self, d_model: int, width: int, n_heads: int, eps: float, gate: bool = True):
        super().__init__()
        self.n_heads, self.eps = n_heads, eps
        self.weight = nn.Parameter(torch.ones(width))  # width = n_heads * value head width
        self.g_proj = nn.Linear(d_model, width, bias=False) if gate else None

    def forward(self, o, x):  # o: [B, T, H, V]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o.reshape(*o.shape[:2], -1) * self.weight
        return o if self.g_proj is None else o * F.silu(self.g_proj(x))


@register_mixer("retnet")
class RetNet(GatedRecurrenceMixer):
    """Multi-scale retention: gamma_h = 1 - 2^(-5-h), per-head group norm, swish gate.

    Options of imported (fla) models: an elementwise ``feature_map`` on q/k, rotary embeddings on q/k
    (``rope_theta``: the state then holds ``position`` [B], the tokens seen), grouped k/v heads
    (``n_kv_heads``), and no output gate (``output_gate=False``)."""

    supports_rotary = True

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        if cfg.feature_map != "default" and cfg.feature_map not in ELEMENTWISE_MAPS:
            raise ValueError(
                f"retnet feature_map must be 'default' (none) or one of {', '.join(ELEMENTWISE_MAPS)}, "
                f"got {cfg.feature_map!r}"
            )
        self.feature_map = ELEMENTWISE_MAPS.get(cfg.feature_map)
        self.register_buffer("log_gamma", retnet_log_gammas(cfg.n_heads), persistent=False)
        self.norm_gate = _HeadNormGate(
            cfg.d_model, cfg.n_heads * self.value_dim, cfg.n_heads, cfg.norm_eps, gate=cfg.output_gate
        )

    def features(self, q, k):
        return (q, k) if self.feature_map is None else (self.feature_map(q), self.feature_map(k))

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
