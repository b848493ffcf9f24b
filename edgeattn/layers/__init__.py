"""One nn.Module per family, registered by mixer name (``MIXER_REGISTRY``)."""

from edgeattn.layers import (  # noqa: F401  (each registers its mixers)
    aft,
    delta,
    flash,
    gated,
    hedgehog,
    mamba2,
    reformer,
    rwkv,
    softmax,
)
from edgeattn.layers.base import MIXER_REGISTRY, Mixer, StateSpec, register_mixer


def build_mixer(name: str, cfg, layer_idx: int = 0) -> Mixer:
    if name not in MIXER_REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; expected one of {', '.join(sorted(MIXER_REGISTRY))}")
    return MIXER_REGISTRY[name](cfg, layer_idx)


__all__ = ["MIXER_REGISTRY", "Mixer", "StateSpec", "build_mixer", "register_mixer"]
