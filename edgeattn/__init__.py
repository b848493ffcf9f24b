"""edgeattn: linear-attention language models from training to edge devices.

Importing this package never imports torch: the base install (numpy, onnxruntime, typer) runs
exported models. Training, export and kernels need the ``train`` extra and import torch themselves.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Mixer names, in the order of the source notes. `aft_full` has no fixed-size state (training only).
MIXERS: tuple[str, ...] = (
    "linear",  # Linear Transformer, elu+1 feature map, normalized
    "performer",  # FAVOR+ positive orthogonal random features, normalized
    "retnet",  # multi-scale retention, fixed per-head decay
    "gla",  # Gated Linear Attention, data-dependent per-key-dimension decay
    "aft",  # Attention-Free Transformer, learned per-channel decay
    "aft_local",  # AFT with a learned window bias over the last W tokens
    "flash",  # FLASH / GAU with mixed-chunk attention
    "softmax",  # causal softmax with a growing KV cache (the baseline)
    "swa",  # sliding-window softmax with attention sinks (fixed ring buffer)
    "aft_full",  # AFT with learned pairwise biases, training only
    "deltanet",  # DeltaNet: delta rule, short convs, L2-normalised q/k
    "gated_deltanet",  # Gated DeltaNet (Qwen3.5): delta rule with a per-head decay, gated output norm
    "kda",  # Kimi Delta Attention: delta rule with a per-key-dimension decay
    "mamba2",  # Mamba2 SSD: scalar-gated recurrence with B/C as key/query, D skip, gated norm
    "reformer",  # Reformer shared-QK LSH attention, a KV cache like softmax
    "rwkv",  # RWKV-4: token shift + AFT with a decay and a one-token bonus; channel mixing as the MLP
    "hedgehog",  # learned softmax feature maps over a pretrained layer's rotated q/k (edgeattn linearize)
    "hedgehog_window",  # hedgehog plus a sliding softmax window in the same layer (LoLCATs)
)

_LAZY = {
    "EdgeConfig": "edgeattn.models",
    "EdgeLM": "edgeattn.models",
    "open_session": "edgeattn.runtimes",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'edgeattn' has no attribute {name!r}")


__all__ = ["MIXERS", "EdgeConfig", "EdgeLM", "open_session", "__version__"]
