"""flash-linear-attention (fla) models: ``gla``, ``delta_net``, ``gated_deltanet``, ``retnet`` and
``linear_attn`` (fla 0.6's config.json and weights).

Every fla model is embeddings -> blocks (attn_norm, attn, mlp_norm, GatedMLP) -> norm -> lm_head, the
blocks' RMSNorms and the GatedMLP (SwiGLU, ``intermediate_size`` or ``hidden_ratio``) as edgeattn's.

- ``gated_deltanet`` -> ``gated_deltanet``: q/k/v projections (``num_heads`` key heads of ``head_dim``,
  ``num_v_heads`` value heads of ``head_dim * expand_v``); the three depthwise short convolutions
  (q_conv1d, k_conv1d, v_conv1d) concatenate into edgeattn's one conv over q|k|v; a_proj, b_proj, A_log,
  dt_bias, g_proj, o_norm (RMSNorm times SiLU of the gate) and o_proj keep their names.
- ``delta_net`` -> ``deltanet``: the same layout without gates (one value head per key head, widths
  ``hidden_size * expand_k / num_heads`` and ``expand_v``); SiLU on q/k (the conv's), L2-normalised.
- ``gla`` -> ``gla``: key width ``hidden_size * expand_k / num_heads`` (EdgeConfig ``head_size``), value
  width ``expand_v`` times it; gk_proj (low rank, biased) -> gk_down / gk_up; the per-head output
  RMSNorm's weight (one head wide, shared by the heads) is tiled over the heads.
- ``retnet`` -> ``retnet``: key/value widths from ``expand_k`` / ``expand_v``, grouped k/v heads
  (``num_kv_heads`` -> ``n_kv_heads``), fla's rotary embeddings on q/k over the whole key head (base
  10000: ``rope_theta``; the state then carries ``position``), an elementwise ``feature_map``, the
  per-head output RMSNorm (tiled as GLA's) times swish of g_proj, or the norm alone without the gate.
- ``linear_attn`` -> ``linear``: fla's feature maps (``elementwise_product`` -> ``hadamard`` with its
  four small linear layers, ``elu`` -> ``elu1``, ``relu``, ``identity``), ``norm_q`` / ``norm_k`` (divide
  by the sum + 1e-4: ``qk_sum_norm``), the normalized form (``norm_feature_map``), grouped k/v heads
  and the per-head output RMSNorm (``output_norm``), no decay.

Refused with one line naming the field: hybrid softmax layers (``attn``), attention residuals,
activations other than swish, GLA's grouped KV heads, short convolutions, feature maps, clamped gates,
gated values or missing output gate, a Gated DeltaNet without its short convolution or output gate, a
DeltaNet with another q/k activation or norm, without beta, short convolution or output norm, or gated;
RetNet / linear attention short convolutions and feature maps other than the listed ones.
"""

from __future__ import annotations

import math

from edgeattn.convert.hf import Weights, refuse
from edgeattn.convert.validate import HFConfig

MODEL_TYPES = ("gla", "delta_net", "gated_deltanet", "retnet", "linear_attn")
MIXER = {
    "gla": "gla",
    "delta_net": "deltanet",
    "gated_deltanet": "gated_deltanet",
    "retnet": "retnet",
    "linear_attn": "linear",
}
# fla's RetNet feature_map (a transformers ACT2FN name) -> edgeattn's elementwise map
RETNET_MAPS = {
    None: "default",
    "relu": "relu",
    "swish": "silu",
    "silu": "silu",
    "sigmoid": "sigmoid",
    "elu": "elu",
}
RETNET_MAPS.update({"linear": "identity", "identity": "identity"})
# fla's linear_attn feature_map -> edgeattn's linear feature_map
LINEAR_MAPS = {"elementwise_product": "hadamard", "elu": "elu1", "relu": "relu", "identity": "identity"}


# fla's config defaults that differ by model: (num_hidden_layers, num_heads, hidden_ratio)
DEFAULTS = {
    "gla": (24, 4, 4),
    "delta_net": (24, 16, 4),
    "gated_deltanet": (21, 6, 4),
    "retnet": (24, 8, 2),
    "linear_attn": (24, 4, 4),
}


def _mlp_size(c: dict, D: int, default_ratio: float) -> int:
    """fla's GatedMLP: intermediate_size, else 2/3 * hidden_ratio * D rounded up to a multiple of 256
    (hidden_ratio absent: the model config's default; null: GatedMLP's 4)."""
    if c.get("intermediate_size") is not None:
        return int(c["intermediate_size"])
    ratio = c.get("hidden_ratio", default_ratio) or 4
    return 256 * ((int(D * ratio * 2 / 3) + 255) // 256)


def _validate(c: HFConfig, mt: str) -> tuple[int, int, int, int]:
    """Types and ranges of the fields the converters read (one line naming a bad one); (hidden_size,
    num_hidden_layers, num_heads, vocab_size), absent ones at fla's defaults."""
    layers, heads, _ = DEFAULTS[mt]
    D, L = c.int("hidden_size", 2048), c.int("num_hidden_layers", layers)
    H, V = c.int("num_heads", heads), c.int("vocab_size", 32000)
    for key in ("intermediate_size", "num_kv_heads", "num_v_heads"):
        c.int(key, None, nullable=True)
    for key in ("expand_k", "expand_v", "hidden_ratio"):
        c.float(key, None, positive=True, nullable=True)
    c.int("conv_size", 4, min=2)
    c.int("head_dim", 256)
    c.int("max_position_embeddings", 2048)
    c.float("norm_eps", 1e-6, positive=True)
    for key in ("use_short_conv", "use_output_gate", "use_gate", "use_beta", "use_output_norm", "use_gk"):
        c.bool(key, None, nullable=True)
    for key in ("use_gv", "allow_neg_eigval", "norm_q", "norm_k", "norm_feature_map", "tie_word_embeddings"):
        c.bool(key, None, nullable=True)
    return D, L, H, V


def _expect(c: dict, field: str, allowed: tuple, default, why: str):
    v = c.get(field, default)
    if v not in allowed:
        raise refuse(field, v, why)
    return v


def _common(c: dict) -> None:
    if c.get("attn") is not None:
        raise refuse("attn", c["attn"], "hybrid stacks with fla's softmax attention layers are not supported")
    if c.get("attnres_block_size") is not None:
        raise refuse("attnres_block_size", c["attnres_block_size"], "attention residuals are not supported")
    _expect(c, "hidden_act", ("swish", "silu"), "swish", "only swish (SiLU) MLPs are supported")


def _gla_layer(c: dict, D: int, H: int) -> tuple[int, int, dict]:
    """(key width per head, value width per head, EdgeConfig fields) of a GLA config."""
    if c.get("num_kv_heads") not in (None, H):
        raise refuse("num_kv_heads", c["num_kv_heads"], "grouped key/value heads of GLA are not supported")
    _expect(c, "use_short_conv", (False,), False, "GLA's short convolutions are not supported")
    _expect(c, "feature_map", (None,), None, "GLA's feature maps on q/k are not supported")
    _expect(c, "clamp_min", (None,), None, "clamped gates are not supported")
    _expect(c, "use_gk", (True,), True, "GLA without its key gate is not supported")
    _expect(c, "use_gv", (False,), False, "value gates are not supported")
    _expect(c, "use_output_gate", (True,), True, "GLA without its output gate is not supported")
    _expect(c, "elementwise_affine", (True, None), True, "an output norm without weights is not supported")
    K, V = _widths(c, D, H, 0.5, 1.0)
    return K, V, dict(head_size=K, expand_v=V / K, gate_logit_normalizer=16)


def _widths(c: dict, D: int, H: int, expand_k: float, expand_v: float) -> tuple[int, int]:
    """Key and value widths per head from fla's expand_k / expand_v (refused unless whole per head)."""
    key_dim, value_dim = D * float(c.get("expand_k", expand_k)), D * float(c.get("expand_v", expand_v))
    if not (math.isclose(key_dim, round(key_dim)) and round(key_dim) % H == 0):
        raise refuse("expand_k", c.get("expand_k"), f"hidden_size * expand_k must be a multiple of {H} heads")
    K, V = round(key_dim) // H, round(value_dim) // H
    if not (
        math.isclose(value_dim, round(value_dim)) and round(value_dim) % H == 0 and int(K * (V / K)) == V
    ):
        raise refuse("expand_v", c.get("expand_v"), f"hidden_size * expand_v must be a multiple of {H} heads")
    return K, V


def _kv_heads(c: dict, H: int) -> int:
    Hkv = int(c.get("num_kv_heads") or H)
    if H % Hkv:
        raise refuse("num_kv_heads", Hkv, f"num_heads {H} must be a multiple of it")
    return 0 if Hkv == H else Hkv


def _retnet_layer(c: dict, D: int, H: int) -> tuple[int, int, dict]:
    _expect(c, "use_short_conv", (False,), False, "RetNet's short convolutions are not supported")
    fmap = c.get("feature_map")
    if fmap not in RETNET_MAPS:
        raise refuse("feature_map", fmap, f"supported: None, {', '.join(k for k in RETNET_MAPS if k)}")
    K, V = _widths(c, D, H, 1.0, 2.0)
    if K % 2:
        raise refuse("expand_k", c.get("expand_k"), f"the rotary key head width {K} must be even")
    fields = dict(
        head_size=K,
        expand_v=V / K,
        n_kv_heads=_kv_heads(c, H),
        rope_theta=10000.0,  # fla's MultiScaleRetention: RotaryEmbedding(dim=head_k_dim), its default base
        feature_map=RETNET_MAPS[fmap],
        output_gate=bool(c.get("use_output_gate", True)),
    )
    return K, V, fields


def _linear_layer(c: dict, D: int, H: int) -> tuple[int, int, dict]:
    fmap = c.get("feature_map", "elementwise_product")
    if fmap not in LINEAR_MAPS:
        raise refuse("feature_map", fmap, f"supported: {', '.join(LINEAR_MAPS)}")
    K, V = _widths(c, D, H, 1.0, 1.0)
    norm = ("q" if c.get("norm_q") else "") + ("k" if c.get("norm_k") else "")
    fields = dict(
        head_size=K,
        expand_v=V / K,
        n_kv_heads=_kv_heads(c, H),
        feature_map=LINEAR_MAPS[fmap],
        qk_sum_norm=norm,
        attn_normalize=bool(c.get("norm_feature_map", False)),
        output_norm=True,  # fla's LinearAttention always norms (its block passes no output_norm)
    )
    return K, V, fields


def _gdn_layer(c: dict, D: int, H: int) -> tuple[int, int, dict]:
    _expect(c, "use_short_conv", (True,), True, "edgeattn's Gated DeltaNet always has its short convolution")
    _expect(c, "use_gate", (True,), True, "edgeattn's Gated DeltaNet always has its output gate")
    _expect(c, "output_gate_activation", ("swish", "silu"), "swish", "only a swish output gate is supported")
    K = int(c.get("head_dim", 256))
    HV = int(c.get("num_v_heads") or H)
    if HV % H:
        raise refuse("num_v_heads", HV, f"must be a multiple of num_heads {H}")
    V = K * float(c.get("expand_v", 2.0))
    if not math.isclose(V, round(V)) or int(K * (round(V) / K)) != round(V):
        raise refuse("expand_v", c.get("expand_v"), f"head_dim {K} * expand_v must be an integer")
    fields = dict(
        head_size=K,
        expand_v=round(V) / K,
        num_v_heads=HV,
        conv_size=int(c.get("conv_size", 4)),
        allow_neg_eigval=bool(c.get("allow_neg_eigval", False)),
    )
    return K, round(V), fields


def _deltanet_layer(c: dict, D: int, H: int) -> tuple[int, int, dict]:
    _expect(c, "use_short_conv", (True,), True, "edgeattn's DeltaNet always has its short convolution")
    _expect(c, "use_beta", (True,), True, "edgeattn's DeltaNet always has beta = sigmoid(x W_b)")
    _expect(c, "use_gate", (False,), False, "a gated DeltaNet output is not supported (use gated_deltanet)")
    _expect(c, "use_output_norm", (True,), True, "edgeattn's DeltaNet always has its output norm")
    _expect(c, "qk_activation", ("silu",), "silu", "only SiLU on q/k is supported")
    _expect(c, "qk_norm", ("l2",), "l2", "only L2-normalised q/k are supported")
    K, V = _widths(c, D, H, 1.0, 1.0)
    fields = dict(
        head_size=K,
        expand_v=V / K,
        conv_size=int(c.get("conv_size", 4)),
        allow_neg_eigval=bool(c.get("allow_neg_eigval", False)),
    )
    return K, V, fields


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    mt = config["model_type"]
    c = config
    D, L, H, Vocab = _validate(HFConfig(c), mt)
    _common(c)
    I = _mlp_size(c, D, DEFAULTS[mt][2])  # noqa: E741
    layer = {
        "gla": _gla_layer,
        "delta_net": _deltanet_layer,
        "gated_deltanet": _gdn_layer,
        "retnet": _retnet_layer,
        "linear_attn": _linear_layer,
    }[mt]
    K, V, fields = layer(c, D, H)
    if mt == "gla":  # fla's layer argument gate_low_rank_dim (16) is not in its config: the weights say
        low = weights.tensors.get("model.layers.0.attn.gk_proj.0.weight")
        fields["gate_low_rank"] = int(low.shape[0]) if low is not None and low.dim() == 2 else 16
    tie = bool(c.get("tie_word_embeddings", False))
    cfg = EdgeConfig(
        vocab_size=Vocab,
        d_model=D,
        n_layers=L,
        n_heads=H,
        mixer=MIXER[mt],
        tie_embeddings=tie,
        norm_eps=float(c.get("norm_eps", 1e-6)),
        intermediate_size=I,
        max_seq_len=int(c.get("max_position_embeddings", 2048)),
        **fields,
    )
    sd = {"embed.weight": weights.take("model.embeddings.weight", (Vocab, D), "vocab_size, hidden_size")}
    for i in range(L):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        sd[dst + "norm1.weight"] = weights.take(src + "attn_norm.weight", (D,), "hidden_size")
        sd[dst + "norm2.weight"] = weights.take(src + "mlp_norm.weight", (D,), "hidden_size")
        for a, b in (("gate_proj", "w_gate"), ("up_proj", "w_up")):
            sd[f"{dst}mlp.{b}.weight"] = weights.take(
                f"{src}mlp.{a}.weight", (I, D), "intermediate_size / hidden_ratio"
            )
        sd[dst + "mlp.w_down.weight"] = weights.take(
            src + "mlp.down_proj.weight", (D, I), "intermediate_size / hidden_ratio"
        )
        a, m = src + "attn.", dst + "mixer."
        if mt == "gla":
            sd.update(_gla_weights(weights, a, m, D, H, K, V, fields["gate_low_rank"]))
        elif mt in ("retnet", "linear_attn"):
            sd.update(_retnet_linear_weights(weights, a, m, D, H, K, V, fields))
        else:
            sd.update(_gdn_weights(weights, a, m, D, H, K, V, fields))
    sd["norm.weight"] = weights.take("model.norm.weight", (D,), "hidden_size")
    if not tie:
        sd["lm_head.weight"] = weights.take("lm_head.weight", (Vocab, D), "vocab_size, hidden_size")
    elif "lm_head.weight" in weights:
        weights.take("lm_head.weight", (Vocab, D), "vocab_size, hidden_size")
    leftover = weights.unused()
    if leftover:
        raise ValueError(
            f"cannot import: the checkpoint has weights this mapping does not use, e.g. {leftover[0]}"
        )
    return cfg, sd, []


def _gla_weights(w: Weights, a: str, m: str, D: int, H: int, K: int, V: int, r: int) -> dict:
    sd = {
        m + "q_proj.weight": w.take(a + "q_proj.weight", (H * K, D), "expand_k, num_heads"),
        m + "k_proj.weight": w.take(a + "k_proj.weight", (H * K, D), "expand_k, num_heads"),
        m + "v_proj.weight": w.take(a + "v_proj.weight", (H * V, D), "expand_v, num_heads"),
        m + "o_proj.weight": w.take(a + "o_proj.weight", (D, H * V), "expand_v, num_heads"),
        m + "gk_down.weight": w.take(a + "gk_proj.0.weight", (r, D), "gate_low_rank_dim"),
        m + "gk_up.weight": w.take(a + "gk_proj.1.weight", (H * K, r), "expand_k, num_heads"),
        m + "gk_up.bias": w.take(a + "gk_proj.1.bias", (H * K,), "expand_k, num_heads"),
        m + "norm_gate.g_proj.weight": w.take(a + "g_proj.weight", (H * V, D), "expand_v, num_heads"),
    }
    name = a + ("g_norm_swish_gate.weight" if a + "g_norm_swish_gate.weight" in w else "g_norm.weight")
    sd[m + "norm_gate.weight"] = w.take(name, (V,), "expand_v, num_heads").repeat(H)  # [V] -> [H * V]
    return sd


def _gdn_weights(w: Weights, a: str, m: str, D: int, H: int, K: int, V: int, fields: dict) -> dict:
    HV, W, gated = fields.get("num_v_heads", H), fields["conv_size"], "num_v_heads" in fields
    torch = w.torch
    convs = [
        w.take(a + f"{x}_conv1d.weight", (n, 1, W), "conv_size")[:, 0]
        for x, n in (("q", H * K), ("k", H * K), ("v", HV * V))
    ]
    sd = {
        m + "q_proj.weight": w.take(a + "q_proj.weight", (H * K, D), "num_heads, head_dim"),
        m + "k_proj.weight": w.take(a + "k_proj.weight", (H * K, D), "num_heads, head_dim"),
        m + "v_proj.weight": w.take(a + "v_proj.weight", (HV * V, D), "num_v_heads, head_dim, expand_v"),
        m + "conv_weight": torch.cat(convs),  # [2*H*K + HV*V, W]: the q|k|v channels
        m + "b_proj.weight": w.take(a + "b_proj.weight", (HV, D), "num_v_heads"),
        m + "o_norm.weight": w.take(a + "o_norm.weight", (V,), "head_dim, expand_v"),
        m + "o_proj.weight": w.take(a + "o_proj.weight", (D, HV * V), "num_v_heads, head_dim, expand_v"),
    }
    if gated:
        sd[m + "a_proj.weight"] = w.take(a + "a_proj.weight", (HV, D), "num_v_heads")
        sd[m + "A_log"] = w.take(a + "A_log", (HV,), "num_v_heads")
        sd[m + "dt_bias"] = w.take(a + "dt_bias", (HV,), "num_v_heads")
        sd[m + "g_proj.weight"] = w.take(a + "g_proj.weight", (HV * V, D), "num_v_heads, head_dim, expand_v")
    return sd


def _retnet_linear_weights(w: Weights, a: str, m: str, D: int, H: int, K: int, V: int, fields: dict) -> dict:
    """MultiScaleRetention's or LinearAttention's weights (grouped k/v heads: k_proj / v_proj are
    n_kv_heads wide, each head serving consecutive query heads, as edgeattn's repeat_interleave)."""
    Hkv = fields["n_kv_heads"] or H
    sd = {
        m + "q_proj.weight": w.take(a + "q_proj.weight", (H * K, D), "expand_k, num_heads"),
        m + "k_proj.weight": w.take(a + "k_proj.weight", (Hkv * K, D), "expand_k, num_kv_heads"),
        m + "v_proj.weight": w.take(a + "v_proj.weight", (Hkv * V, D), "expand_v, num_kv_heads"),
        m + "o_proj.weight": w.take(a + "o_proj.weight", (D, H * V), "expand_v, num_heads"),
    }
    norms = [n for n in ("g_norm_swish_gate.weight", "g_norm.weight", "norm.weight") if a + n in w]
    # elementwise_affine = false: fla's norm has no weight, the same as ones
    weight = w.take(a + norms[0], (V,), "expand_v, num_heads") if norms else w.torch.ones(V)
    sd[m + "norm_gate.weight"] = weight.repeat(H)  # [V] -> [H * V]: one weight shared by the heads
    if fields.get("output_gate"):
        sd[m + "norm_gate.g_proj.weight"] = w.take(a + "g_proj.weight", (H * V, D), "expand_v, num_heads")
    if fields.get("feature_map") == "hadamard":  # tie_feature_map_qk: one module, maybe saved under one name
        for x in ("q", "k"):
            for i in (1, 2):
                for p, shape in (("weight", (K, K)), ("bias", (K,))):
                    name = f"{a}feature_map_{x}.layer{i}.{p}"
                    if name not in w:
                        name = f"{a}feature_map_{'k' if x == 'q' else 'q'}.layer{i}.{p}"
                    sd[f"{m}{x}_map{i}.{p}"] = w.take(name, shape, "expand_k, num_heads")
    return sd
