"""Mamba2 (transformers ``mamba2``): blocks of RMSNorm -> Mamba2 mixer -> residual, no MLP.

transformers' Mamba2Mixer maps one to one onto edgeattn's ``mamba2`` mixer (in_proj, conv1d, dt_bias,
A_log, D, the grouped gated RMSNorm, out_proj); blocks have no MLP (``intermediate_size = -1``).
"""

from __future__ import annotations

import math

from edgeattn.convert.hf import Weights, refuse

MODEL_TYPES = ("mamba2",)


def _float(v) -> float:
    """A float of config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", config.get("hidden_act"), "only silu is supported")
    if config.get("use_bias"):
        raise refuse("use_bias", config["use_bias"], "biased in_proj/out_proj")
    limit = [_float(v) for v in (config.get("time_step_limit") or (0.0, math.inf))]
    if limit[0] > 0 or limit[1] != math.inf:
        raise refuse("time_step_limit", list(limit), "a clamped time step")
    D, L, V = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"])
    expand = config.get("expand", 2)
    if int(expand) != expand:
        raise refuse("expand", expand, "a whole number")
    I = int(expand) * D  # noqa: E741
    Hm, P = int(config["num_heads"]), int(config["head_dim"])
    if Hm * P != I:
        raise refuse("num_heads", Hm, f"num_heads * head_dim must be expand * hidden_size = {I}")
    N, G, W = int(config["state_size"]), int(config.get("n_groups", 1)), int(config.get("conv_kernel", 4))
    tie = bool(config.get("tie_word_embeddings", False))
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=1,
        mixer="mamba2",
        tie_embeddings=tie,
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        intermediate_size=-1,
        conv_size=W,
        ssm_state_size=N,
        mamba_head_dim=P,
        mamba_expand=int(expand),
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
        if config.get("use_conv_bias", True):
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
