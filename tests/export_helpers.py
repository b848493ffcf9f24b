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


def make_checkpoint(path: Path, mixer: str, seed: int = 0, grid: bool = False, **kw) -> Path:
    """A tiny random checkpoint. ``grid``: every weight redrawn on a power-of-two grid (``grid_weights``), so
    that its bits depend on the seed alone, not on the CPU that made it."""
    import torch

    from edgeattn.models import EdgeLM

    torch.manual_seed(seed)
    model = EdgeLM(tiny_config(mixer, **kw))
    with torch.no_grad():  # larger than the init scale so that every layer changes the logits
        if grid:
            grid_weights(model, seed)
        else:
            for p in model.parameters():
                p.mul_(3.0)
    return model.save(path)


GRID_STEPS = 256


def grid_weights(module, seed: int) -> None:
    """Redraw every floating-point tensor of ``module``'s state dict uniformly on the grid
    ``a * i / GRID_STEPS``, ``i`` an integer from numpy's generator in [-GRID_STEPS, GRID_STEPS], ``a`` the power
    of two at or above the tensor's largest magnitude (ones stay in scale, a log-decay keeps its sign range).

    torch's initialisers are not bit-reproducible across CPUs: ``normal_`` runs a vectorised Box-Muller
    whose log/cos differ in the last bit between instruction sets (ATEN_CPU_CAPABILITY=default against avx2
    here), and exp/log/expm1 inits (A_log, dt_bias) differ between an Intel Xeon and an AMD EPYC. Integers
    times a power of two are exact in float32 on every CPU, so checkpoints made this way hash the same
    everywhere (tests/test_artifact_identical.py)."""
    import math

    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for _, t in sorted(module.state_dict(keep_vars=True).items()):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            top = float(t.abs().max())
            # the power of two at or above it (an exact power of two, e.g. a norm weight of ones, stays itself)
            a = 2.0 ** math.ceil(math.log2(top)) if top > 0 else 1.0
            draw = rng.integers(-GRID_STEPS, GRID_STEPS + 1, tuple(t.shape)) * (a / GRID_STEPS)
            t.copy_(torch.from_numpy(draw).to(t.dtype))


def text_ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, n), dtype=np.int64)
