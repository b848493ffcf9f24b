"""TEMPORARY stand-ins for edgeattn.ops.delta / edgeattn.ops.conv until the delta-ops branch is merged."""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
F = torch.nn.functional


def short_conv_step(x, state, weight, bias=None, activation="silu"):
    dt = torch.promote_types(state.dtype, torch.float32)
    window = torch.cat([state.to(dt), x.to(dt).unsqueeze(-1)], dim=-1)
    y = (window * weight.to(dt)).sum(-1)
    if bias is not None:
        y = y + bias.to(dt)
    if activation == "silu":
        y = F.silu(y)
    return y, window[:, :, 1:]


def short_conv(
    x, weight, bias=None, *, activation="silu", initial_state=None, output_final_state=False, mode="chunk"
):
    B, T, D = x.shape
    W = weight.shape[1]
    s = x.new_zeros(B, D, W - 1, dtype=torch.float32) if initial_state is None else initial_state.float()
    xx = torch.cat([s, x.float().transpose(1, 2)], -1)  # [B, D, W-1+T]
    y = F.conv1d(xx, weight.float().unsqueeze(1), bias, groups=D).transpose(1, 2)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), (xx[:, :, xx.shape[-1] - (W - 1) :] if output_final_state else None)


def delta_rule_step(q, k, v, beta, g, state, *, scale):
    """q, k: [B, H, K], v: [B, HV, V], beta: [B, HV], g: None, [B, HV] or [B, HV, K]."""
    HV, H = v.shape[1], q.shape[1]
    q, k = (t.float().repeat_interleave(HV // H, 1) for t in (q, k))
    v, beta = v.float(), beta.float()
    if g is not None:
        a = torch.exp(g.float())
        state = state * (a[..., None, None] if a.dim() == 2 else a[..., None])
    pred = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + (beta[..., None] * (v - pred)).unsqueeze(-2) * k.unsqueeze(-1)
    return scale * torch.einsum("bhk,bhkv->bhv", q, state), state


def delta_rule(
    q,
    k,
    v,
    beta,
    g=None,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    mode="chunk",
    chunk_size=64,
):
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, HV, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        o, S = delta_rule_step(
            q[:, t], k[:, t], v[:, t], beta[:, t], None if g is None else g[:, t], S, scale=scale
        )
        outs.append(o)
    return torch.stack(outs, 1).to(q.dtype), (S if output_final_state else None)
