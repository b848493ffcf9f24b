"""One token of the short convolution: the function the exported step graph is made of.

Pure tensor code: no in-place updates, no branches on tensor values, shapes fixed by the inputs.
The state is ONNX Runtime's ``CausalConvWithState`` layout: the last W-1 inputs, channels first, oldest first.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
F = torch.nn.functional
Tensor = torch.Tensor


def short_conv_step(
    x: Tensor,
    state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """x: [B, D] one token, state: [B, D, W-1], weight: [D, W], bias: [D] or None.

    Returns (y [B, D] in the state's compute dtype, new state [B, D, W-1]); the state is not modified."""
    dt = torch.promote_types(state.dtype, torch.float32)
    window = torch.cat([state.to(dt), x.to(dt).unsqueeze(-1)], dim=-1)  # [B, D, W], oldest first
    y = (window * weight.to(dt)).sum(-1)  # [B, D]
    if bias is not None:
        y = y + bias.to(dt)
    if activation == "silu":
        y = F.silu(y)
    return y, window[:, :, 1:]
