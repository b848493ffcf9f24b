"""Argument checks shared by the ops: each failure is a ValueError naming the argument and its expected shape."""

from __future__ import annotations

from collections.abc import Sequence

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor

MODES = ("naive", "parallel", "chunk", "recurrent")


def check_mode(mode: str, allowed: Sequence[str]) -> None:
    if mode not in allowed:
        raise ValueError(f"mode must be one of {tuple(allowed)}, got {mode!r}")


def check_rank(name: str, x: Tensor, rank: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")


def check_dims(name: str, x: Tensor, expected: Sequence[int | None], layout: str) -> None:
    """``expected`` holds a size per dimension, None for 'any'."""
    check_rank(name, x, len(expected), layout)
    for got, want in zip(x.shape, expected):
        if want is not None and got != want:
            want_txt = layout + " = " + str(tuple("*" if w is None else w for w in expected))
            raise ValueError(f"{name} must have shape {want_txt}, got {tuple(x.shape)}")


def tracing() -> bool:
    """True while torch.export / torch.compile / the ONNX exporter traces: value checks are skipped then."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def check_log_gate(name: str, g: Tensor) -> None:
    """Log-space gates must be <= 0 (a decay in [0, 1], -inf a hard reset); NaN is refused. Skipped while tracing."""
    if tracing():
        return
    if torch.isnan(g).any():
        raise ValueError(f"{name} holds NaN; log-gates must be finite and <= 0")
    if (g > 0).any():
        raise ValueError(
            f"{name} is a log-space gate and must be <= 0, got a maximum of {g.max().item():.4g}"
        )


def check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def pad_time(x: Tensor, multiple: int, value: float = 0.0) -> Tensor:
    """Pad dim 1 (time) of ``x`` up to a multiple of ``multiple``."""
    T = x.shape[1]
    pad = (-T) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[1] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=1)
