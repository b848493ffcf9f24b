"""Mamba2 (transformers ``mamba2``): blocks of RMSNorm -> Mamba2 mixer -> residual, no MLP.

transformers' Mamba2Mixer maps one to one onto edgeattn's ``mamba2`` mixer (in_proj, conv1d, dt_bias,
A_log, D, the grouped gated RMSNorm, out_proj); blocks have no MLP (``intermediate_size = -1``).
"""

from __future__ import annotations

import math

from edgeattn.convert.hf import Weights, refuse
from edgeattn.convert.validate import HFConfig

MODEL_TYPES = ("mamba2",)


def _float(v) -> float:
    """A float of config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _time_step_limit(c: HFConfig) -> None:
    """Refuse a clamped time step (transformers clamps dt to time_step_limit unless it is (0, inf))."""
    limit = c.raw("time_step_limit", [0.0, math.inf])
    try:
        lo, hi = (_float(v) for v in limit)
    except (TypeError, ValueError, KeyError):
        raise c.error("time_step_limit", "a list of two numbers", limit) from None
    if math.isnan(lo) or math.isnan(hi) or lo > 0 or hi != math.inf:
        raise refuse("time_step_limit", [lo, hi], "a clamped time step")


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    c = HFConfig(config)  # absent fields take Mamba2Config's defaults
    if c.str("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", c.raw("hidden_act"), "only silu is supported")
    if c.bool("use_bias", False):
        raise refuse("use_bias", True, "biased in_proj/out_proj")
    _time_step_limit(c)
    D, L, V = c.int("hidden_size", 4096), c.int("num_hidden_layers", 64), c.int("vocab_size", 32768)
    expand = c.int("expand", 2)
    I = expand * D  # noqa: E741
    Hm, P = c.int("num_heads", 128), c.int("head_dim", 64)
    if Hm * P != I:
        raise refuse("num_heads", Hm, f"num_heads * head_dim must be expand * hidden_size = {I}")
    N, G, W = c.int("state_size", 128), c.int("n_groups", 8), c.int("conv_kernel", 4, min=2)
    c.multiple("num_heads", Hm, "n_groups", G)
    use_conv_bias = c.bool("use_conv_bias", True)
    tie = c.bool("tie_word_embeddings", False)
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=1,
        mixer="mamba2",
        tie_embeddings=tie,
        norm_eps=c.float("layer_norm_epsilon", 1e-5, positive=True),
        intermediate_size=-1,
        conv_size=W,
        ssm_state_size=N,
        mamba_head_dim=P,
        mamba_expand=expand,
        mamba_n_groups=G,
    )
    C = I + 2 * G * N
    sd = {"embed.weight": weights.take("backbone.embeddings.weight", (V, D), "vocab_size, hidden_size")}
    for i in range(L):
        src, m = f"backbone.layers.{i}.", f"blocks.{i}.mixer."
        sd[f"blocks.{i}.norm1.weight"] = weights.take(src + "norm.weight", (D,), "hidden_size")
        a = src + "mixer."
        sd[m + "in_proj.weight"] = weights.take(
            a + "in_proj.weight", (I + C + Hm, D), "expand, state_size, n_groups, num_heads"
        )
        sd[m + "conv_weight"] = weights.take(a + "conv1d.weight", (C, 1, W), "conv_kernel")[:, 0]
        if use_conv_bias:
            sd[m + "conv_bias"] = weights.take(a + "conv1d.bias", (C,), "state_size, n_groups")
        else:
            sd[m + "conv_bias"] = weights.torch.zeros(C)
        for name in ("dt_bias", "A_log", "D"):
            sd[m + name] = weights.take(a + name, (Hm,), "num_heads")
        sd[m + "norm_weight"] = weights.take(a + "norm.weight", (I,), "expand")
        sd[m + "o_proj.weight"] = weights.take(a + "out_proj.weight", (D, I), "expand")
    sd["norm.weight"] = weights.take("backbone.norm_f.weight", (D,), "hidden_size")
    if not tie:
        sd["lm_head.weight"] = weights.take("lm_head.weight", (V, D), "vocab_size, hidden_size")
    elif "lm_head.weight" in weights:
        weights.take("lm_head.weight", (V, D), "vocab_size, hidden_size")
    leftover = weights.unused()
    if leftover:
        raise ValueError(
            f"cannot import: the checkpoint has weights this mapping does not use, e.g. {leftover[0]}"
        )
    return cfg, sd, []
