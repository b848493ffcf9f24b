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

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def text_config(config: dict) -> tuple[dict, str, list[str]]:
    """(text config, weight prefix, notes)."""
    notes = []
    if config.get("model_type") == "qwen3_5":
        tc = config.get("text_config")
        if not isinstance(tc, dict):
            raise refuse("text_config", tc, "a qwen3_5 config must hold its text model's config")
        if config.get("vision_config") is not None:
            notes.append("the vision tower (model.visual) is skipped: text input only")
        return tc, "model.language_model.", notes
    return config, "model.", notes


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    tc, p, notes = text_config(config)
    if tc.get("num_experts") or tc.get("num_local_experts"):
        raise refuse(
            "num_experts", tc.get("num_experts") or tc.get("num_local_experts"), "mixture of experts"
        )
    if tc.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", tc.get("hidden_act"), "only silu is supported")
    if tc.get("attention_bias"):
        raise refuse("attention_bias", tc["attention_bias"], "biased attention projections")
    rope = tc.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise refuse("rope_parameters.rope_type", rope.get("rope_type"), "only default RoPE")
    D, L = int(tc["hidden_size"]), int(tc["num_hidden_layers"])
    H, Hkv = int(tc["num_attention_heads"]), int(tc.get("num_key_value_heads") or tc["num_attention_heads"])
    Dh = int(tc.get("head_dim") or D // H)
    kinds = tc.get("layer_types") or [
        "linear_attention" if (i + 1) % int(tc.get("full_attention_interval", 4)) else "full_attention"
        for i in range(L)
    ]
    mixers = []
    for kind in kinds:
        if kind not in ("linear_attention", "full_attention"):
            raise refuse("layer_types", kind, "expected linear_attention or full_attention")
        mixers.append("gated_deltanet" if kind == "linear_attention" else "softmax")
    Hk, Hv = int(tc["linear_num_key_heads"]), int(tc["linear_num_value_heads"])
    Kd, Vd = int(tc["linear_key_head_dim"]), int(tc["linear_value_head_dim"])
    V = int(tc["vocab_size"])
    tie = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=H,
        mixer=mixers,
        tie_embeddings=tie,
        norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(tc.get("max_position_embeddings", 2048)),
        head_size=Dh,
        n_kv_heads=Hkv,
        rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 10000.0))),
        rotary_dim=int(Dh * float(rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0)))),
        qk_norm=True,
        attn_output_gate=True,
        intermediate_size=int(tc["intermediate_size"]),
        conv_size=int(tc.get("linear_conv_kernel_dim", 4)),
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
