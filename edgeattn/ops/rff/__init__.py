"""Random Fourier features (Rahimi & Recht 2007) for the Gaussian kernel, and attention built on them.

    phi(x) = [cos(x W^T), sin(x W^T)] / sqrt(m),  W: [m, K] with i.i.d. N(0, 1) rows
    E[phi(x) . phi(y)] = E[cos(w . (x - y))] = exp(-|x - y|^2 / 2)        (the Gaussian kernel)

Softmax attention's kernel is a Gaussian kernel times norms: with x = K^(-1/4) q, y = K^(-1/4) k,

    exp(q . k / sqrt(K)) = exp(|x|^2 / 2) exp(|y|^2 / 2) exp(-|x - y|^2 / 2)

The query factor cancels between numerator and denominator, so ``rff_attention`` uses
``phi_q = phi(x)`` and ``phi_k = exp(|y|^2 / 2) phi(y)`` (exponent clamped at 30, as FAVOR+ does) in the
normalized recurrence ``o_t = phi_q S_t / den_t``, ``den_t = phi_q . z_t``.

The safe normalizer: unlike FAVOR+'s positive features, RFF similarity estimates are signed, so
``den_t`` can be <= 0 although the exact sum is positive. Each estimate phi_q . phi_k_j lies in
[-w_j, w_j] (|phi(x)| = 1, w_j = exp(|y_j|^2 / 2)), so ``den_t`` is only known up to noise of order
``W_t / sqrt(m)`` with ``W_t = sum_{j<=t} w_j``. The op divides by ``max(den_t, W_t / sqrt(m), eps)``:
denominators below the noise level are floored at it (biasing such outputs towards 0 rather than
amplifying noise), and ``|o_t| <= sqrt(m) max_j |v_j|`` whatever the inputs. ``W_t`` rides in the
recurrence as one extra feature (``w_j`` for keys, 0 for queries), so the state is
``(S [B, H, 2m + 1, V], z [B, H, 2m + 1])`` with ``z[..., 2m] = W``.
"""

from __future__ import annotations

import math

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form
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
    """[..., 2m + 1] features whose dot product estimates exp(q . k / sqrt(K)) up to the query factor,
    the last one carrying the key weight w = exp(|y|^2 / 2) (0 for queries; see the module doc)."""
    s = q.shape[-1] ** -0.25
    x, y = q * s, k * s
    w = torch.exp((0.5 * (y * y).sum(-1, keepdim=True)).clamp(max=_MAX_EXPONENT))
    fq = rff_features(x, projection)
    return torch.cat([fq, torch.zeros_like(fq[..., :1])], -1), torch.cat(
        [w * rff_features(y, projection), w], -1
    )


def safe_divide(num: Tensor, den: Tensor, weight_sum: Tensor, m: int, eps: float) -> Tensor:
    """num / max(den, weight_sum / sqrt(m), eps): the RFF normalizer (den may be <= 0)."""
    floor = (weight_sum / math.sqrt(m)).clamp_min(eps)
    return num / torch.maximum(den, floor)


def rff_recurrence(fq, fk, v, initial_state=None, *, eps=1e-6, mode="chunk", chunk_size=64):
    """The normalized recurrence over ``rff_softmax_features`` (fq, fk [B, T, H, 2m + 1]), dividing
    safely. ``initial_state`` (S [B, H, 2m + 1, V], z [B, H, 2m + 1]) or None. ``mode``: a form of
    ``gated_linear_attention`` or "auto": for T == 1 its recurrent form (one exported step), "chunk"
    otherwise (``edgeattn.ops.backend.choose_form``; never its contrib op, the exported graphs keep plain
    ops). Returns (o [B, T, H, V], (S, z))."""
    B, T, H, M = fq.shape
    mode = choose_form(mode, T, "rff_recurrence")
    mode = "recurrent" if mode == "step" else mode
    V = v.shape[-1]
    S0 = None
    if initial_state is not None:
        S0 = torch.cat([initial_state[0], initial_state[1].unsqueeze(-1)], dim=-1)  # [B, H, 2m + 1, V + 1]
    v_ext = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)  # the normalizer is the state of a ones column
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
    w_sum = fk[..., -1:].to(o.dtype).cumsum(1)  # [B, T, H, 1]
    if initial_state is not None:
        w_sum = w_sum + initial_state[1][..., -1].to(o.dtype)[:, None, :, None]
    o = safe_divide(o[..., :V], o[..., V:], w_sum, (M - 1) // 2, eps)
    return o, (S[..., :V], S[..., V])


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
    ``(S [B, H, 2m + 1, V], z [B, H, 2m + 1])``. ``causal=False`` sums over the whole sequence (no
    state). The denominator is floored at ``max(W_t / sqrt(m), eps)`` (module docstring).
    """
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    check_dims("projection", projection, (None, K), "[m, K]")
    fq, fk = rff_softmax_features(q, k, projection)
    m = projection.shape[0]
    if not causal:
        if initial_state is not None or output_final_state:
            raise ValueError(
                "causal=False has no recurrent state: initial_state/output_final_state need causal"
            )
        acc = torch.promote_types(q.dtype, torch.float32)
        fq, fk, vf = fq.to(acc), fk.to(acc), v.to(acc)
        kv = torch.einsum("bthm,bthv->bhmv", fk, vf)  # [B, H, 2m + 1, V]
        z = fk.sum(1)  # [B, H, 2m + 1]
        num = torch.einsum("bthm,bhmv->bthv", fq, kv)
        den = torch.einsum("bthm,bhm->bth", fq, z).unsqueeze(-1)
        w_sum = z[..., -1][:, None, :, None]
        return safe_divide(num, den, w_sum, m, eps).to(q.dtype), None
    if initial_state is not None:
        if not (isinstance(initial_state, tuple | list) and len(initial_state) == 2):
            raise ValueError("initial_state must be a pair (S [B, H, 2m + 1, V], z [B, H, 2m + 1])")
        M, V = fq.shape[-1], v.shape[-1]
        check_dims("initial_state[0]", initial_state[0], (B, H, M, V), "[B, H, 2m + 1, V]")
        check_dims("initial_state[1]", initial_state[1], (B, H, M), "[B, H, 2m + 1]")
    o, state = rff_recurrence(fq, fk, v, initial_state, eps=eps, mode=mode, chunk_size=chunk_size)
    return o.to(q.dtype), (state if output_final_state else None)


__all__ = [
    "gaussian_projection",
    "rff_attention",
    "rff_features",
    "rff_recurrence",
    "rff_softmax_features",
    "safe_divide",
]
