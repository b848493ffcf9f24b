"""The mixer protocol every family implements, and the registry that maps names to classes.

A mixer maps ``x: [B, T, D]`` and an optional state to ``(y: [B, T, D], new_state)``. The state is a
dict of named tensors (names become ``past_key_values.{layer}.{name}`` in exported graphs) that is
never updated in place. ``state_spec`` describes it for export; ``init_state`` builds the zeros.
All state tensors are float32 (positions and counters too), in every precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeattn._deps import require

torch = require("torch")
nn = torch.nn
Tensor = torch.Tensor

MIXER_REGISTRY: dict[str, type[Mixer]] = {}


def register_mixer(name: str):
    def deco(cls):
        cls.mixer_name = name
        MIXER_REGISTRY[name] = cls
        return cls

    return deco


@dataclass(frozen=True)
class StateSpec:
    """One state tensor. ``shape`` includes the batch; a str entry is a dynamic size (a growing KV cache)."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "float32"


class Mixer(nn.Module):
    mixer_name: str = ""
    # False for mixers whose state grows with the sequence (softmax) or that have none (aft_full).
    fixed_size_state: bool = True
    # Mixers that can give the state after each token of a call (``last_steps``, for the export option
    # ``verify_states``): with ``emit_steps`` set, ``forward`` leaves ``self.last_steps`` = {state name:
    # [B, T, ...] (the state after token t at index t)} for every entry of its state.
    has_steps: bool = False
    emit_steps: bool = False
    last_steps: dict | None = None

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        raise NotImplementedError

    def init_state(self, batch_size: int, device=None) -> dict[str, Tensor]:
        """The all-zeros initial state (dynamic sizes start at 0)."""
        out = {}
        for s in self.state_spec(batch_size):
            shape = [0 if isinstance(d, str) else d for d in s.shape]
            out[s.name] = torch.zeros(shape, dtype=getattr(torch, s.dtype), device=device)
        return out

    def check_state(self, state: dict[str, Tensor], batch_size: int) -> None:
        """ValueError when ``state`` is not a state of this layer (wrong names or shapes)."""
        specs = self.state_spec(batch_size)
        if not isinstance(state, dict) or set(state) != {s.name for s in specs}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"state of layer {self.layer_idx} ({self.mixer_name}) must hold "
                f"{[s.name for s in specs]}, got {got}: a state of another layer or model?"
            )
        for s in specs:
            t = state[s.name]
            want = tuple(s.shape)
            if t.dim() != len(want) or any(not isinstance(w, str) and w != g for w, g in zip(want, t.shape)):
                raise ValueError(
                    f"state[{s.name!r}] of layer {self.layer_idx} ({self.mixer_name}) must have shape "
                    f"{want}, got {tuple(t.shape)}"
                )

    def forward(self, x: Tensor, state: dict[str, Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError
