"""Tiny checkpoints and artifacts for the export, runtime and CLI tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgeattn import MIXERS

EXPORTABLE = [m for m in MIXERS if m != "aft_full"]
HYBRID = "gla,softmax,retnet,swa,flash,aft_local"
PREFILL = 16


def tiny_config(mixer: str, **kw):
    from edgeattn.models import EdgeConfig

    n_layers = len(mixer.split(",")) if "," in mixer else 2
    base = dict(
        d_model=32,
        n_layers=n_layers,
        n_heads=2,
        mixer=mixer,
        chunk_size=16,
        feature_dim=16,
        window=8,
        n_sinks=2,
        flash_chunk=8,
        flash_qk_dim=16,
        max_seq_len=512,
    )
    base.update(kw)
    return EdgeConfig(**base)


def make_checkpoint(path: Path, mixer: str, seed: int = 0, **kw) -> Path:
    import torch

    from edgeattn.models import EdgeLM

    torch.manual_seed(seed)
    model = EdgeLM(tiny_config(mixer, **kw))
    with torch.no_grad():  # larger than the init scale so that every layer changes the logits
        for p in model.parameters():
            p.mul_(3.0)
    return model.save(path)


def text_ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, n), dtype=np.int64)
