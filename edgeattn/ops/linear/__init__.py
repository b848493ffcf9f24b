"""Linear Transformer (Katharopoulos et al. 2020): elu+1 features, normalized, no decay.

o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps),  S_t = S_{t-1} + phi(k_t)^T v_t,  z_t = z_{t-1} + phi(k_t)
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.common import gated_linear_attention

torch = require("torch")
F = torch.nn.functional


def elu1(x):
    """The Linear Transformer's positive feature map, elu(x) + 1."""
    return F.elu(x) + 1.0


def linear_attention(q, k, v, **kwargs):
    """Linear Transformer attention on raw q, k: [B, T, H, K] (the feature map is applied here)."""
    return gated_linear_attention(elu1(q), elu1(k), v, None, normalize=True, **kwargs)


__all__ = ["elu1", "linear_attention"]
