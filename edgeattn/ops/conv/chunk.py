"""The short convolution over a whole sequence at once: one depthwise ``conv1d`` over the inputs with
the state prepended (training and prefill)."""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
F = torch.nn.functional


def chunk_short_conv(x, weight, bias, *, activation, initial_state):
    """Same arguments and results as ``naive_short_conv``."""
    B, T, D = x.shape
    W = weight.shape[1]
    past = x.new_zeros(B, D, W - 1) if initial_state is None else initial_state
    xs = torch.cat([past, x.transpose(1, 2)], dim=-1)  # [B, D, W-1+T]
    # conv1d is a cross-correlation: output t sees xs[t .. t+W-1], weight[:, -1] on the newest input.
    y = F.conv1d(xs, weight.unsqueeze(1), bias, groups=D)  # [B, D, T]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2), xs[:, :, xs.shape[-1] - (W - 1) :]
