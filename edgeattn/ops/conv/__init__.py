"""Short causal depthwise convolution (the "short conv" in front of q, k, v in DeltaNet, Gated DeltaNet,
KDA and Mamba2):

    y_t = act(bias + sum_{j=0}^{W-1} weight[:, j] * x_{t-(W-1)+j})

with state ``[B, D, W-1]``: the last W-1 inputs, channels first, oldest first (ONNX Runtime's
``com.microsoft.CausalConvWithState`` layout, state name ``conv_state``). Three forms (naive loop,
recurrent loop of the exported step, one ``conv1d``) and ``mode="auto"`` (the layers' call: the step for
one token, ``conv1d`` otherwise, ONNX Runtime's contrib op while an export for the onnxruntime target
traces; chosen in ``edgeattn.ops.backend``); see README.md.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form, contrib_op
from edgeattn.ops.conv.chunk import chunk_short_conv
from edgeattn.ops.conv.naive import naive_short_conv
from edgeattn.ops.conv.step import short_conv_step
from edgeattn.ops.utils import check_dims, check_mode, check_rank

torch = require("torch")
Tensor = torch.Tensor

ACTIVATIONS = ("silu", None)

__all__ = ["ACTIVATIONS", "short_conv", "short_conv_step"]


def short_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = "silu",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
):
    """Causal depthwise convolution over ``x: [B, T, D]`` with ``weight: [D, W]`` (``weight[:, -1]``
    multiplies the current token, as ``nn.Conv1d(D, D, W, groups=D, padding=W-1)``'s ``weight[:, 0]``
    cut to the first T outputs), optional ``bias: [D]``, then ``activation`` ("silu" or None).

    ``initial_state: [B, D, W-1]`` holds the W-1 inputs before ``x`` (oldest first); None means zeros.
    Computes in float32 (float64 inputs stay float64). Returns ``(y [B, T, D] in x's dtype,
    final_state [B, D, W-1] float32 or None)``; the final state continues the sequence exactly.

    ``mode``: "naive", "recurrent" (a loop of ``short_conv_step``), "chunk" (``conv1d``) or "auto":
    ``short_conv_step`` for T == 1, "chunk" otherwise, ONNX Runtime's ``CausalConvWithState`` while an
    export for the onnxruntime target traces (``edgeattn.ops.backend.choose_form``). "auto" returns y in
    float32 (float64 stays float64) in every form, as the step and the contrib op compute.
    """
    check_mode(mode, ("auto", "naive", "chunk", "recurrent"))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_rank("x", x, 3, "[B, T, D]")
    B, T, D = x.shape
    check_rank("weight", weight, 2, "[D, W]")
    check_dims("weight", weight, (D, None), "[D, W] (D as x)")
    W = weight.shape[1]
    if W < 1:
        raise ValueError(f"weight must have shape [D, W] with W >= 1, got {tuple(weight.shape)}")
    if bias is not None:
        check_dims("bias", bias, (D,), "[D]")
    acc = torch.promote_types(x.dtype, torch.float32)
    if initial_state is not None:
        check_dims("initial_state", initial_state, (B, D, W - 1), f"[B, D, W-1] with W-1 = {W - 1}")
    form = choose_form(mode, T, "short_conv")
    if form in ("fused", "step"):
        # Before any conversion below: these forms trace exactly the ops of the exported graphs.
        state = initial_state if initial_state is not None else x.new_zeros(B, D, W - 1, dtype=acc)
        if form == "fused":
            y, state = contrib_op("short_conv")(x, weight, bias, state, activation=activation)
        else:
            y, state = short_conv_step(x[:, 0], state, weight, bias, activation)
            y = y.unsqueeze(1)
        return y, (state if output_final_state else None)
    if mode == "auto":
        x, mode = x.to(acc), form  # "auto" returns float32 in every form
    state = None if initial_state is None else initial_state.to(acc)

    xf, wf = x.to(acc), weight.to(acc)
    bf = None if bias is None else bias.to(acc)
    if mode == "naive":
        y, state = naive_short_conv(xf, wf, bf, activation=activation, initial_state=state)
    elif mode == "chunk":
        y, state = chunk_short_conv(xf, wf, bf, activation=activation, initial_state=state)
    else:
        state = xf.new_zeros(B, D, W - 1) if state is None else state
        ys = []
        for t in range(T):
            y_t, state = short_conv_step(xf[:, t], state, wf, bf, activation)
            ys.append(y_t)
        y = torch.stack(ys, dim=1) if ys else xf.new_zeros(B, 0, D)
    return y.to(x.dtype), (state if output_final_state else None)
