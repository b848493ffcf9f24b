"""The gated per-head RMSNorm that closes the delta-rule layers (ONNX Runtime's ``GatedRMSNorm``)."""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import contrib_op
from edgeattn.ops.utils import check_mode

torch = require("torch")
F = torch.nn.functional


def gated_rms_norm(x, weight, gate=None, *, eps: float, activation: str = "silu", mode: str = "auto"):
    """RMSNorm of x [..., V] over its last dimension times ``weight`` [V], times silu(gate) or sigmoid(gate)
    (``activation``) when ``gate`` [..., V] is given; float32.

    ``mode``: "plain" (these PyTorch ops) or "auto": with a gate, x and gate [B, T, HV, V], while an export
    installs the contrib op (``edgeattn.ops.backend``) it runs as one ``GatedRMSNorm`` node; plain otherwise."""
    check_mode(mode, ("auto", "plain"))
    if mode == "auto" and gate is not None and (fused := contrib_op("gated_rms_norm")) is not None:
        return fused(x, weight, gate, eps=eps, activation=activation)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight
    if gate is None:
        return y
    gf = gate.float()
    return y * (F.silu(gf) if activation == "silu" else torch.sigmoid(gf))
