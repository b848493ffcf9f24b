"""RetNet retention (Sun et al. 2023): a fixed decay gamma_h per head.

S_t = gamma_h S_{t-1} + k_t^T v_t,  o_t = K^(-1/2) q_t S_t,  gamma_h = 1 - 2^(-5-h)
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.common import gated_linear_attention

torch = require("torch")


def retnet_log_gammas(n_heads: int):
    """log gamma_h for the multi-scale heads, as a [H] log-space gate."""
    h = torch.arange(n_heads, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -5.0 - h)).float()


def retention(q, k, v, **kwargs):
    """Multi-scale retention on q, k: [B, T, H, K], v: [B, T, H, V]."""
    return gated_linear_attention(q, k, v, retnet_log_gammas(q.shape[2]).to(q.device), **kwargs)


__all__ = ["retention", "retnet_log_gammas"]
