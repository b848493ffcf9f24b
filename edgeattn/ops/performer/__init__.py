"""Performer FAVOR+ (Choromanski et al. 2021): positive orthogonal random features, normalized.

    phi(x) = exp(W x - |x|^2 / 2 - c) / sqrt(m),  x = K^(-1/4) q or K^(-1/4) k,  W: [m, K] orthogonal rows
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)  -- the normalized gated recurrence without decay

``c`` is a stabilizer: for queries the per-token maximum (it cancels between numerator and denominator),
for keys 0, since a key stabilizer would have to stay constant along a stream.
"""

from __future__ import annotations

import math

from edgeattn._deps import require
from edgeattn.ops.common import gated_linear_attention

torch = require("torch")

# Exponents are clamped here: exp(30) is far from float32 overflow even summed over long streams.
_MAX_EXPONENT = 30.0


def orthogonal_random_features(m: int, d: int, generator=None, dtype=torch.float32):
    """[m, d] Gaussian random matrix with orthogonal blocks of rows, each row rescaled to a chi(d) norm."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        qmat, _ = torch.linalg.qr(g)
        blocks.append(qmat.T)
    w = torch.cat(blocks, dim=0)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (w * norms).to(dtype)


def favor_features(x, projection, *, is_query: bool = False):
    """Positive random features of x: [..., K] with projection [m, K] -> [..., m]."""
    K = x.shape[-1]
    x = x * K**-0.25
    wx = x @ projection.T.to(x.dtype)  # [..., m]; the projection follows x's dtype, as in rff_features
    sq = 0.5 * (x * x).sum(-1, keepdim=True)
    expo = wx - sq
    if is_query:
        expo = expo - expo.amax(-1, keepdim=True).detach()
    expo = expo.clamp(max=_MAX_EXPONENT)
    return torch.exp(expo) / math.sqrt(projection.shape[0])


def performer_attention(q, k, v, projection, **kwargs):
    """FAVOR+ attention on raw q, k: [B, T, H, K]; projection [m, K] shared by all heads."""
    return gated_linear_attention(
        favor_features(q, projection, is_query=True),
        favor_features(k, projection),
        v,
        None,
        normalize=True,
        **kwargs,
    )


__all__ = ["favor_features", "orthogonal_random_features", "performer_attention"]
