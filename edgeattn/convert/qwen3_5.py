"""Qwen3.5 (transformers ``qwen3_5`` / ``qwen3_5_text``): Gated DeltaNet layers and gated full attention.

Mapping (transformers' modeling_qwen3_5.py):
- ``linear_attention`` layers -> ``gated_deltanet``: in_proj_qkv splits into q_proj | k_proj | v_proj (the
  conv runs over the same q|k|v channels), in_proj_z -> g_proj, in_proj_a/b -> a_proj/b_proj, A_log,
  dt_bias, norm (plain RMSNorm, gated by SiLU(z)) -> o_norm, out_proj -> o_proj;
- ``full_attention`` layers -> ``softmax`` with grouped KV heads, partial rotary embeddings
  (text positions: the three M-RoPE sections see the same position, so it is plain RoPE), q/k RMSNorm
  and a sigmoid output gate interleaved per head in q_proj;
- every Qwen3_5RMSNorm is zero-centred (``x * (1 + w)``): folded here into ``w + 1``.
A ``qwen3_5`` checkpoint (the vision-language model) keeps its text model under
``model.language_model``; the vision tower (``model.visual``) is skipped with a note.
"""

from __future__ import annotations

from edgeattn.convert.hf import Weights, refuse
from edgeattn.convert.validate import HFConfig

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def text_config(config: dict) -> tuple[HFConfig, str, list[str]]:
    """(text config, weight prefix, notes)."""
    notes = []
    if config.get("model_type") == "qwen3_5":
        tc = HFConfig(config).sub("text_config")
        if tc is None:
            raise refuse("text_config", None, "a qwen3_5 config must hold its text model's config")
        if config.get("vision_config") is not None:
            notes.append("the vision tower (model.visual) is skipped: text input only")
        return tc, "model.language_model.", notes
    return HFConfig(config), "model.", notes


def rope(c: HFConfig, head_dim: int, partial_default: float = 0.25) -> tuple[float, int]:
    """(rope_theta, rotary dims) as transformers reads them: the legacy ``rope_scaling`` object replaces
    ``rope_parameters`` when both are given; ``rope_theta`` and ``partial_rotary_factor`` come from that
    object, else from the top level, else transformers' defaults (10000, and ``partial_default``: 0.25 for
    Qwen3.5, 1 for Llama). Only plain RoPE is implemented: any scaled ``rope_type`` (yarn, linear, dynamic,
    longrope, llama3...) is refused."""
    key = "rope_scaling" if c.raw("rope_scaling") else "rope_parameters"
    params = c.sub(key) or HFConfig({}, c.name(key) + ".")
    if any(isinstance(v, dict) for v in params.data.values()):
        raise refuse(c.name(key), params.data, "RoPE parameters per layer type are not supported")
    kind = params.str("rope_type", params.str("type", "default"))
    if kind != "default":
        raise refuse(
            params.name("rope_type"), kind, "only plain RoPE is implemented (transformers would scale it)"
        )

    def source(name: str) -> HFConfig:  # the rope object's value first, then the top level's
        return params if name in params else c

    c.float("rope_theta", None, positive=True, nullable=True)  # a bad value is refused even where unused
    c.float("partial_rotary_factor", None, positive=True, max=1.0, nullable=True)

    theta = source("rope_theta").float("rope_theta", 10000.0, positive=True)
    factor = source("partial_rotary_factor").float(
        "partial_rotary_factor", partial_default, positive=True, max=1.0
    )
    dims = int(head_dim * factor)  # transformers rotates int(head_dim * partial_rotary_factor) dims
    if dims < 2 or dims % 2:
        raise source("partial_rotary_factor").error(
            "partial_rotary_factor", f"such that head_dim {head_dim} * it is an even number >= 2", factor
        )
    return theta, dims


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    c, p, notes = text_config(config)
    # Absent fields take Qwen3_5TextConfig's defaults (what transformers computes with).
    experts = c.raw("num_experts") or c.raw("num_local_experts")
    if experts:
        raise refuse("num_experts", experts, "mixture of experts")
    if c.str("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", c.raw("hidden_act"), "only silu is supported")
    if c.bool("attention_bias", False):
        raise refuse("attention_bias", True, "biased attention projections")
    D, L = c.int("hidden_size", 4096), c.int("num_hidden_layers", 32)
    H, Hkv = c.int("num_attention_heads", 16), c.int("num_key_value_heads", 4)
    c.multiple("num_attention_heads", H, "num_key_value_heads", Hkv)
    Dh = c.int("head_dim", 256)
    theta, rotary_dim = rope(c, Dh)
    if "layer_types" in c:
        kinds = c.list("layer_types")
        if len(kinds) != L:
            raise c.error("layer_types", f"a list of num_hidden_layers ({L}) layer types", kinds)
    else:
        interval = c.int("full_attention_interval", 4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)]
    mixers = []
    for kind in kinds:
        if kind not in ("linear_attention", "full_attention"):
            raise refuse(c.name("layer_types"), kind, "expected linear_attention or full_attention")
        mixers.append("gated_deltanet" if kind == "linear_attention" else "softmax")
    Hk, Hv = c.int("linear_num_key_heads", 16), c.int("linear_num_value_heads", 32)
    c.multiple("linear_num_value_heads", Hv, "linear_num_key_heads", Hk)
    Kd, Vd = c.int("linear_key_head_dim", 128), c.int("linear_value_head_dim", 128)
    V = c.int("vocab_size", 248320)
    top = HFConfig(config)
    tie = c.bool("tie_word_embeddings", top.bool("tie_word_embeddings", False))
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=H,
        mixer=mixers,
        tie_embeddings=tie,
        norm_eps=c.float("rms_norm_eps", 1e-6, positive=True),
        max_seq_len=c.int("max_position_embeddings", 32768),
        head_size=Dh,
        n_kv_heads=Hkv,
        rope_theta=theta,
        rotary_dim=rotary_dim,
        qk_norm=True,
        attn_output_gate=True,
        intermediate_size=c.int("intermediate_size", 12288),
        conv_size=c.int("linear_conv_kernel_dim", 4, min=2),
        linear_n_heads=Hk,
        linear_key_dim=Kd,
        linear_value_dim=Vd,
        num_v_heads=Hv,
    )
    sd = {}

    def zc(name, n):  # zero-centred RMSNorm weight, folded
        return weights.take(name, (n,)) + 1.0

    sd["embed.weight"] = weights.take(p + "embed_tokens.weight", (V, D), "vocab_size, hidden_size")
    I = cfg.intermediate_size  # noqa: E741
    for i, kind in enumerate(kinds):
        src, dst = f"{p}layers.{i}.", f"blocks.{i}."
        sd[dst + "norm1.weight"] = zc(src + "input_layernorm.weight", D)
        sd[dst + "norm2.weight"] = zc(src + "post_attention_layernorm.weight", D)
        for a, b in (("gate_proj", "w_gate"), ("up_proj", "w_up")):
            sd[f"{dst}mlp.{b}.weight"] = weights.take(f"{src}mlp.{a}.weight", (I, D), "intermediate_size")
        sd[dst + "mlp.w_down.weight"] = weights.take(
            src + "mlp.down_proj.weight", (D, I), "intermediate_size"
        )
        m = dst + "mixer."
        if kind == "linear_attention":
            a = src + "linear_attn."
            qkv = weights.take(
                a + "in_proj_qkv.weight",
                (2 * Hk * Kd + Hv * Vd, D),
                "linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim",
            )
            sd[m + "q_proj.weight"], sd[m + "k_proj.weight"], sd[m + "v_proj.weight"] = qkv.split(
                [Hk * Kd, Hk * Kd, Hv * Vd]
            )
            C, W = 2 * Hk * Kd + Hv * Vd, cfg.conv_size
            sd[m + "conv_weight"] = weights.take(a + "conv1d.weight", (C, 1, W), "linear_conv_kernel_dim")[
                :, 0
            ]
            sd[m + "b_proj.weight"] = weights.take(a + "in_proj_b.weight", (Hv, D), "linear_num_value_heads")
            sd[m + "a_proj.weight"] = weights.take(a + "in_proj_a.weight", (Hv, D), "linear_num_value_heads")
            sd[m + "A_log"] = weights.take(a + "A_log", (Hv,), "linear_num_value_heads")
            sd[m + "dt_bias"] = weights.take(a + "dt_bias", (Hv,), "linear_num_value_heads")
            sd[m + "g_proj.weight"] = weights.take(
                a + "in_proj_z.weight", (Hv * Vd, D), "linear_value_head_dim"
            )
            sd[m + "o_norm.weight"] = weights.take(a + "norm.weight", (Vd,), "linear_value_head_dim")
            sd[m + "o_proj.weight"] = weights.take(
                a + "out_proj.weight", (D, Hv * Vd), "linear_value_head_dim"
            )
        else:
            a = src + "self_attn."
            sd[m + "q_proj.weight"] = weights.take(
                a + "q_proj.weight", (2 * H * Dh, D), "num_attention_heads, head_dim"
            )
            sd[m + "k_proj.weight"] = weights.take(
                a + "k_proj.weight", (Hkv * Dh, D), "num_key_value_heads, head_dim"
            )
            sd[m + "v_proj.weight"] = weights.take(
                a + "v_proj.weight", (Hkv * Dh, D), "num_key_value_heads, head_dim"
            )
            sd[m + "o_proj.weight"] = weights.take(
                a + "o_proj.weight", (D, H * Dh), "num_attention_heads, head_dim"
            )
            sd[m + "q_norm"] = zc(a + "q_norm.weight", Dh)
            sd[m + "k_norm"] = zc(a + "k_norm.weight", Dh)
    sd["norm.weight"] = zc(p + "norm.weight", D)
    if not tie:
        sd["lm_head.weight"] = weights.take("lm_head.weight", (V, D), "vocab_size, hidden_size")
    elif "lm_head.weight" in weights:
        weights.take("lm_head.weight", (V, D), "vocab_size, hidden_size")
    skip = ("model.visual.", "mtp.")
    leftover = weights.unused(skip)
    if leftover:
        raise ValueError(
            f"cannot import: the checkpoint has weights this mapping does not use, e.g. {leftover[0]}"
        )
    if any(k.startswith("mtp.") for k in weights.tensors):
        notes.append("the multi-token-prediction head (mtp.*) is skipped")
    return cfg, sd, notes
