"""RWKV-4 (transformers ``rwkv``): LayerNorm blocks of time mixing (token shift + WKV) and channel mixing.

The WKV is edgeattn's ``aft`` with decay -exp(time_decay) and a one-token window bias (see
``edgeattn.layers.rwkv``); block 0's ``pre_ln`` becomes the norm after the embedding. transformers
divides hidden states by 2 every ``rescale_every`` layers at inference and scales the weights to
match: the same function up to the LayerNorms' epsilon, so the weights are imported unscaled.
"""

from __future__ import annotations

from edgeattn.convert.hf import Weights, refuse

MODEL_TYPES = ("rwkv",)


def convert(config: dict, weights: Weights):
    from edgeattn.models import EdgeConfig

    D, L, V = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"])
    A = config.get("attention_hidden_size") or D
    if A != D:
        raise refuse("attention_hidden_size", A, f"must equal hidden_size ({D})")
    hidden = int(config.get("intermediate_size") or 4 * D)
    tie = bool(config.get("tie_word_embeddings", False))
    cfg = EdgeConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=1,
        mixer="rwkv",
        tie_embeddings=tie,
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        intermediate_size=hidden,
        norm="layer",
        embed_norm=True,
        max_seq_len=int(config.get("context_length", 1024)),
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
    if int(config.get("rescale_every") or 0) > 0 and L >= int(config["rescale_every"]):
        notes.append("rescale_every is an inference-time rescaling in transformers: imported unscaled")
    return cfg, sd, notes
