"""Ground truth: the causal depthwise convolution as an explicit per-token loop, straight from the formula.

    y_t[d] = act(bias[d] + sum_{j=0}^{W-1} weight[d, j] * x_{t-(W-1)+j}[d])

where the inputs before the first token are the state's columns (oldest first), zeros by default.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
F = torch.nn.functional


def naive_short_conv(x, weight, bias, *, activation, initial_state):
    """x: [B, T, D], weight: [D, W], bias: [D] or None, initial_state: [B, D, W-1] or None.

    Returns (y [B, T, D], the last W-1 inputs [B, D, W-1])."""
    B, T, D = x.shape
    W = weight.shape[1]
    past = x.new_zeros(B, D, W - 1) if initial_state is None else initial_state.to(x.dtype)
    xs = torch.cat([past, x.transpose(1, 2)], dim=-1)  # [B, D, W-1+T]: every input, oldest first
    ys = []
    for t in range(T):
        y = bias.to(x.dtype).expand(B, D) if bias is not None else x.new_zeros(B, D)
        for j in range(W):
            y = y + weight[:, j].to(x.dtype) * xs[:, :, t + j]  # input x_{t-(W-1)+j}
        ys.append(F.silu(y) if activation == "silu" else y)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(B, 0, D)
    return y, xs[:, :, xs.shape[-1] - (W - 1) :]
