"""One nn.Module per family, registered by mixer name (``MIXER_REGISTRY``)."""

from edgeattn.layers import gated  # noqa: F401  (registers linear, performer, retnet, gla)
from edgeattn.layers.base import MIXER_REGISTRY, Mixer, StateSpec, register_mixer

for _mod in ("aft", "flash", "softmax"):
    try:
        __import__(f"edgeattn.layers.{_mod}")
    except ModuleNotFoundError as _e:  # the family is not written yet
        if _e.name != f"edgeattn.layers.{_mod}":
            raise


def build_mixer(name: str, cfg, layer_idx: int = 0) -> Mixer:
    if name not in MIXER_REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; expected one of {', '.join(sorted(MIXER_REGISTRY))}")
    return MIXER_REGISTRY[name](cfg, layer_idx)


__all__ = ["MIXER_REGISTRY", "Mixer", "StateSpec", "build_mixer", "register_mixer"]
