"""Llama (transformers ``llama``): softmax attention with grouped KV heads, RoPE, RMSNorm, the SiLU-gated MLP.

Mapping (transformers' modeling_llama.py): every layer -> ``softmax`` with ``n_kv_heads`` grouped heads and
rotary embeddings over the whole head (rotate-half, ``rope_theta``; a scaled ``rope_type`` is refused,
``edgeattn.convert.qwen3_5.rope``), input_layernorm / post_attention_layernorm -> norm1 / norm2 (plain
RMSNorm), gate/up/down_proj -> the SwiGLU, lm_head tied to the embedding when ``tie_word_embeddings``.
A GGUF file of architecture ``llama`` arrives here too, as the config and weights
``edgeattn.convert.gguf`` reads from it.
"""

from __future__ import annotations

from edgeattn.convert.hf import Weights, refuse
from edgeattn.convert.qwen3_5 import rope
from edgeattn.convert.validate import HFConfig

MODEL_TYPES = ("llama",)
# Tensors some checkpoints carry that the model recomputes (old transformers saved the RoPE frequencies).
RECOMPUTED = "rotary_emb.inv_freq"


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    c = HFConfig(config)
    notes: list[str] = []
    # Absent fields take LlamaConfig's defaults (what transformers computes with).
    if c.str("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", c.raw("hidden_act"), "only silu is supported")
    if c.bool("attention_bias", False):
        raise refuse("attention_bias", True, "biased attention projections")
    if c.bool("mlp_bias", False):
        raise refuse("mlp_bias", True, "biased MLP projections")
    D, L = c.int("hidden_size", 4096), c.int("num_hidden_layers", 32)
    H = c.int("num_attention_heads", 32)
    Hkv = c.int("num_key_value_heads", H, nullable=True)
    c.multiple("num_attention_heads", H, "num_key_value_heads", Hkv)
    if "head_dim" not in c and D % H:
        raise c.error("hidden_size", f"a multiple of num_attention_heads ({H}) when head_dim is absent", D)
    Dh = c.int("head_dim", D // H, nullable=True)
    theta, rotary_dim = rope(c, Dh, partial_default=1.0)
    V = c.int("vocab_size", 32000)
    tie = c.bool("tie_word_embeddings", False)
    I = c.int("intermediate_size", 11008)  # noqa: E741
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=H,
        mixer="softmax",
        tie_embeddings=tie,
        norm_eps=c.float("rms_norm_eps", 1e-6, positive=True),
        max_seq_len=c.int("max_position_embeddings", 2048),
        head_size=Dh,
        n_kv_heads=Hkv,
        rope_theta=theta,
        rotary_dim=rotary_dim,
        intermediate_size=I,
    )
    sd = {}
    sd["embed.weight"] = weights.take("model.embed_tokens.weight", (V, D), "vocab_size, hidden_size")
    for i in range(L):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        sd[dst + "norm1.weight"] = weights.take(src + "input_layernorm.weight", (D,), "hidden_size")
        sd[dst + "norm2.weight"] = weights.take(src + "post_attention_layernorm.weight", (D,), "hidden_size")
        for a, b in (("gate_proj", "w_gate"), ("up_proj", "w_up")):
            sd[f"{dst}mlp.{b}.weight"] = weights.take(f"{src}mlp.{a}.weight", (I, D), "intermediate_size")
        sd[dst + "mlp.w_down.weight"] = weights.take(
            src + "mlp.down_proj.weight", (D, I), "intermediate_size"
        )
        a, m = src + "self_attn.", dst + "mixer."
        sd[m + "q_proj.weight"] = weights.take(
            a + "q_proj.weight", (H * Dh, D), "num_attention_heads, head_dim"
        )
        for name in ("k_proj", "v_proj"):
            sd[f"{m}{name}.weight"] = weights.take(
                f"{a}{name}.weight", (Hkv * Dh, D), "num_key_value_heads, head_dim"
            )
        sd[m + "o_proj.weight"] = weights.take(
            a + "o_proj.weight", (D, H * Dh), "num_attention_heads, head_dim"
        )
    sd["norm.weight"] = weights.take("model.norm.weight", (D,), "hidden_size")
    if not tie:
        sd["lm_head.weight"] = weights.take("lm_head.weight", (V, D), "vocab_size, hidden_size")
    elif "lm_head.weight" in weights:
        weights.take("lm_head.weight", (V, D), "vocab_size, hidden_size")
        notes.append("lm_head.weight is ignored: tie_word_embeddings is true (transformers ties it too)")
    leftover = [k for k in weights.unused() if not k.endswith(RECOMPUTED)]
    if leftover:
        raise ValueError(
            f"cannot import: the checkpoint has weights this mapping does not use, e.g. {leftover[0]}"
        )
    return cfg, sd, notes
