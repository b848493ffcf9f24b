"""Gated Linear Attention (Yang et al. 2024): a data-dependent decay per key dimension.

S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,  o_t = K^(-1/2) q_t S_t,  g_t = log alpha_t: [B, T, H, K]
"""

from __future__ import annotations

from edgeattn.ops.common import gated_linear_attention


def gla(q, k, v, g, **kwargs):
    """GLA on q, k: [B, T, H, K], v: [B, T, H, V], g: [B, T, H, K] log-gates (<= 0)."""
    return gated_linear_attention(q, k, v, g, **kwargs)


__all__ = ["gla"]
