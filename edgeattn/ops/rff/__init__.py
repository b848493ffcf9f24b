"""Random Fourier features (Rahimi & Recht 2007) for the Gaussian kernel, and attention built on them.

    phi(x) = [cos(x W^T), sin(x W^T)] / sqrt(m),  W: [m, K] with i.i.d. N(0, 1) rows
    E[phi(x) . phi(y)] = E[cos(w . (x - y))] = exp(-|x - y|^2 / 2)        (the Gaussian kernel)

Softmax attention's kernel is a Gaussian kernel times norms: with x = K^(-1/4) q, y = K^(-1/4) k,

    exp(q . k / sqrt(K)) = exp(|x|^2 / 2) exp(|y|^2 / 2) exp(-|x - y|^2 / 2)

The query factor cancels between numerator and denominator, so ``rff_attention`` uses
``phi_q = phi(x)`` and ``phi_k = exp(|y|^2 / 2) phi(y)`` (exponent clamped at 30, as FAVOR+ does) in the
normalized recurrence ``o_t = phi_q S_t / den_t``, ``den_t = phi_q . z_t``.

The safe normalizer: unlike FAVOR+'s positive features, RFF similarity estimates can be negative,
so ``den_t`` can be <= 0 although the exact sum is positive. The op divides by ``max(den_t, eps)``:
the output stays finite (at most ``|num| / eps``) and never flips sign through a negative
denominator; ``den_t`` is clamped, never replaced by ``|den_t|``. With enough features the estimate
of the self term alone (exact: phi(y) . phi(y) = 1) keeps ``den_t`` positive in practice.
"""

from __future__ import annotations

import math

from edgeattn._deps import require
from edgeattn.ops.common import gated_linear_attention
from edgeattn.ops.utils import check_dims, check_rank

torch = require("torch")
Tensor = torch.Tensor

# exp(30) is far from float32 overflow, even summed over long streams (as in FAVOR+).
_MAX_EXPONENT = 30.0


def gaussian_projection(m: int, d: int, generator=None, dtype=torch.float32) -> Tensor:
    """[m, d] i.i.d. standard normal rows (the RFF frequencies of the unit-bandwidth Gaussian kernel)."""
    return torch.randn(m, d, generator=generator, dtype=torch.float64).to(dtype)


def rff_features(x: Tensor, projection: Tensor) -> Tensor:
    """Random Fourier features of x: [..., K] with projection [m, K] -> [..., 2m] = [cos, sin] / sqrt(m)."""
    check_rank("projection", projection, 2, "[m, K]")
    if x.shape[-1] != projection.shape[1]:
        raise ValueError(
            f"projection must have shape [m, K] with K = {x.shape[-1]} (x's last dim), got {tuple(projection.shape)}"
        )
    wx = x @ projection.T.to(x.dtype)  # [..., m]
    return torch.cat([torch.cos(wx), torch.sin(wx)], dim=-1) / math.sqrt(projection.shape[0])


def rff_softmax_features(q: Tensor, k: Tensor, projection: Tensor) -> tuple[Tensor, Tensor]:
    """Features whose dot product estimates exp(q . k / sqrt(K)) up to the query factor (see module doc)."""
    s = q.shape[-1] ** -0.25
    x, y = q * s, k * s
    mag = (0.5 * (y * y).sum(-1, keepdim=True)).clamp(max=_MAX_EXPONENT)
    return rff_features(x, projection), torch.exp(mag) * rff_features(y, projection)


def safe_divide(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """num / max(den, eps): the RFF normalizer (den may be <= 0 for an estimate of a positive sum)."""
    return num / den.clamp_min(eps)


def rff_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    causal: bool = True,
    eps: float = 1e-6,
    initial_state: tuple[Tensor, Tensor] | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
):
    """Softmax attention estimated with random Fourier features, on raw ``q, k: [B, T, H, K]``.

    ``projection: [m, K]`` (``gaussian_projection``) is shared by all heads; the state is
    ``(S [B, H, 2m, V], z [B, H, 2m])`` as for the other normalized families. ``causal=False`` sums over
    the whole sequence (no state). The denominator is clamped at ``eps`` (module docstring).
    """
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    check_dims("projection", projection, (None, K), "[m, K]")
    V = v.shape[-1]
    fq, fk = rff_softmax_features(q, k, projection)
    if not causal:
        if initial_state is not None or output_final_state:
            raise ValueError(
                "causal=False has no recurrent state: initial_state/output_final_state need causal"
            )
        acc = torch.promote_types(q.dtype, torch.float32)
        fq, fk, vf = fq.to(acc), fk.to(acc), v.to(acc)
        kv = torch.einsum("bthm,bthv->bhmv", fk, vf)  # [B, H, 2m, V]
        num = torch.einsum("bthm,bhmv->bthv", fq, kv)
        den = torch.einsum("bthm,bhm->bth", fq, fk.sum(1)).unsqueeze(-1)
        return safe_divide(num, den, eps).to(q.dtype), None
    # The normalizer is the state of a value column of ones; the division happens here, clamped.
    S0 = None
    if initial_state is not None:
        if not (isinstance(initial_state, tuple | list) and len(initial_state) == 2):
            raise ValueError("initial_state must be a pair (S [B, H, 2m, V], z [B, H, 2m])")
        M = fq.shape[-1]
        check_dims("initial_state[0]", initial_state[0], (B, H, M, V), "[B, H, 2m, V]")
        check_dims("initial_state[1]", initial_state[1], (B, H, M), "[B, H, 2m]")
        S0 = torch.cat([initial_state[0], initial_state[1].unsqueeze(-1)], dim=-1)
    v_ext = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)  # [B, T, H, V + 1]
    o, S = gated_linear_attention(
        fq,
        fk,
        v_ext,
        None,
        scale=1.0,
        initial_state=S0,
        output_final_state=True,
        mode=mode,
        chunk_size=chunk_size,
    )
    o = safe_divide(o[..., :V], o[..., V:], eps)
    return o, ((S[..., :V], S[..., V]) if output_final_state else None)


__all__ = ["gaussian_projection", "rff_attention", "rff_features", "rff_softmax_features", "safe_divide"]
