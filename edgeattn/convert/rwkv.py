"""RWKV-4 (transformers ``rwkv``): LayerNorm blocks of time mixing (token shift + WKV) and channel mixing.

The WKV is edgeattn's ``aft`` with decay -exp(time_decay) and a one-token window bias (see
``edgeattn.layers.rwkv``); block 0's ``pre_ln`` becomes the norm after the embedding. transformers
divides hidden states by 2 every ``rescale_every`` layers at inference and scales the weights to
match: the same function up to the LayerNorms' epsilon, so the weights are imported unscaled.
"""

from __future__ import annotations

from edgeattn.convert.hf import Weights, refuse
from edgeattn.convert.validate import HFConfig

MODEL_TYPES = ("rwkv",)


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    c = HFConfig(config)  # absent fields take RwkvConfig's defaults
    D, L, V = c.int("hidden_size", 4096), c.int("num_hidden_layers", 32), c.int("vocab_size", 50277)
    A = c.int("attention_hidden_size", D, nullable=True)
    if A != D:
        raise refuse("attention_hidden_size", A, f"must equal hidden_size ({D})")
    hidden = c.int("intermediate_size", 4 * D, nullable=True)
    rescale_every = c.int("rescale_every", 6, min=0)
    tie = c.bool("tie_word_embeddings", False)
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=1,
        mixer="rwkv",
        tie_embeddings=tie,
        norm_eps=c.float("layer_norm_epsilon", 1e-5, positive=True),
        intermediate_size=hidden,
        norm="layer",
        embed_norm=True,
        max_seq_len=c.int("context_length", 1024),
    )

    def ln(src, dst):
        sd[dst + ".weight"] = weights.take(src + ".weight", (D,), "hidden_size")
        sd[dst + ".bias"] = weights.take(src + ".bias", (D,), "hidden_size")

    sd = {"embed.weight": weights.take("rwkv.embeddings.weight", (V, D), "vocab_size, hidden_size")}
    ln("rwkv.blocks.0.pre_ln", "embed_norm")
    for i in range(L):
        src, m = f"rwkv.blocks.{i}.", f"blocks.{i}.mixer."
        ln(src + "ln1", f"blocks.{i}.norm1")
        ln(src + "ln2", f"blocks.{i}.norm2")
        a, f = src + "attention.", src + "feed_forward."
        sd[m + "time_decay"] = weights.take(a + "time_decay", (D,), "hidden_size")
        sd[m + "time_first"] = weights.take(a + "time_first", (D,), "hidden_size")
        for x in ("k", "v", "r"):
            name = {"k": "key", "v": "value", "r": "receptance"}[x]
            sd[f"{m}mix_{x}"] = weights.take(f"{a}time_mix_{name}", (1, 1, D), "hidden_size").reshape(D)
            sd[f"{m}{x}_proj.weight"] = weights.take(f"{a}{name}.weight", (D, D), "hidden_size")
        sd[m + "o_proj.weight"] = weights.take(a + "output.weight", (D, D), "hidden_size")
        sd[m + "ffn_mix_k"] = weights.take(f + "time_mix_key", (1, 1, D), "hidden_size").reshape(D)
        sd[m + "ffn_mix_r"] = weights.take(f + "time_mix_receptance", (1, 1, D), "hidden_size").reshape(D)
        sd[m + "ffn_key.weight"] = weights.take(f + "key.weight", (hidden, D), "intermediate_size")
        sd[m + "ffn_receptance.weight"] = weights.take(f + "receptance.weight", (D, D), "hidden_size")
        sd[m + "ffn_value.weight"] = weights.take(f + "value.weight", (D, hidden), "intermediate_size")
    ln("rwkv.ln_out", "norm")
    if not tie:
        sd["lm_head.weight"] = weights.take("head.weight", (V, D), "vocab_size, hidden_size")
    elif "head.weight" in weights:
        weights.take("head.weight", (V, D), "vocab_size, hidden_size")
    leftover = weights.unused()
    if leftover:
        raise ValueError(
            f"cannot import: the checkpoint has weights this mapping does not use, e.g. {leftover[0]}"
        )
    notes = []
    if rescale_every > 0 and L >= rescale_every:
        notes.append("rescale_every is an inference-time rescaling in transformers: imported unscaled")
    return cfg, sd, notes
