"""Comparison helpers shared by the tests."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: the error relative to the reference's scale."""
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), "non-finite values"
    denom = ref.abs().max().clamp_min(1e-30)
    return ((got - ref).abs().max() / denom).item()


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def grads(outputs, inputs, seed: int = 1):
    """Gradients of a fixed random projection of ``outputs`` w.r.t. ``inputs`` (None for non-leaves)."""
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for o in outputs:
        w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
        loss = loss + (o * w).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)
