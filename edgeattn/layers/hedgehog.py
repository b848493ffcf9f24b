"""Linearized attention (``edgeattn linearize``): Hedgehog feature maps, alone or with a sliding softmax window.

Both mixers keep a pretrained softmax layer's q/k/v/o projections (grouped KV heads, rotary embeddings over
the whole head, as the imported ``softmax`` layer has them) and replace the attention itself:

``hedgehog`` (Zhang et al., 2024): a learned feature map per head, ``phi(x) = [softmax(x W + b),
softmax(-(x W + b))]`` over ``F = cfg.feature_dim`` columns (2F features), on the rotated q and k;
``o_t = sum_{i<=t} phi(q_t) . phi(k_i) v_i / sum_{i<=t} phi(q_t) . phi(k_i)``.

``hedgehog_window`` (LoLCATs, Zhang et al., 2024): the last ``W = cfg.window`` tokens (the current one
included) by softmax, everything older by the feature map, in one normalisation:

    a_ti = f_h exp(q_t . k_i / sqrt(Dh) - m_t)      for t - W < i <= t   (m_t: the max over that window)
    a_ti = phi(q_t) . phi(k_i)                      for i <= t - W
    o_t  = sum_i a_ti v_i / sum_i a_ti

with ``f_h = sigmoid(window_factor_h)`` learned per head (LoLCATs' linear_window_attention).

State (fixed size): ``recurrent_state`` [B, H, 2F, Dh] and ``normalizer`` [B, H, 2F] (the sums over the tokens
that have left the window), ``key``/``value`` [B, Hkv, W, Dh] (the last W rotated keys and values, oldest
first; ``hedgehog_window`` only) and ``position`` [B] (tokens seen). One forward form serves every T: the
queries of the call against the window buffer plus the call's own keys (O(T (W + T))), the recurrent sums
for the rest; the exported step is that form at T = 1.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.layers.gated import rotary

torch = require("torch")
nn = torch.nn


def hedgehog_features(x, weight, bias):
    """x [B, H, T, Dh], weight [H, Dh, F], bias [H, F] -> [B, H, T, 2F]: softmax of x W + b and of its negation."""
    z = torch.einsum("bhtd,hdf->bhtf", x.float(), weight.float()) + bias.float()[None, :, None, :]
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


@register_mixer("hedgehog")
class Hedgehog(Mixer):
    with_window: bool = False
    has_steps = True
    eps = 1e-6

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        H, Hkv, Dh, F = self.n_heads, self.n_kv_heads, self.head_dim, cfg.feature_dim
        self.window = cfg.window if self.with_window else 0
        if self.with_window and self.window < 1:
            raise ValueError(f"hedgehog_window needs window >= 1, got {cfg.window}")
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=False)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        # Feature maps start as the identity's first F columns (Hedgehog's init), biases at zero.
        eye = torch.eye(Dh, F).expand(H, Dh, F).clone()
        self.q_map = nn.Parameter(eye.clone())
        self.k_map = nn.Parameter(eye)
        self.q_map_bias = nn.Parameter(torch.zeros(H, F))
        self.k_map_bias = nn.Parameter(torch.zeros(H, F))
        if self.with_window:
            self.window_factor = nn.Parameter(torch.zeros(H))  # sigmoid(0) = 0.5: LoLCATs' init

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B, H, Hkv, Dh, F2 = batch_size, self.n_heads, self.n_kv_heads, self.head_dim, 2 * self.cfg.feature_dim
        specs = [StateSpec("recurrent_state", (B, H, F2, Dh)), StateSpec("normalizer", (B, H, F2))]
        if self.window:
            specs += [
                StateSpec("key", (B, Hkv, self.window, Dh)),
                StateSpec("value", (B, Hkv, self.window, Dh)),
            ]
        return [*specs, StateSpec("position", (B,))]

    def forward(self, x, state=None):
        B, T, _ = x.shape
        H, Hkv, Dh, W = self.n_heads, self.n_kv_heads, self.head_dim, self.window
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        q = self.q_proj(x).view(B, T, H, Dh).float()
        k = self.k_proj(x).view(B, T, Hkv, Dh).float()
        v = self.v_proj(x).view(B, T, Hkv, Dh).float()
        position = state["position"]
        steps = torch.ones_like(q[0, :, 0, 0]).cumsum(0) - 1  # [T], dynamic T in exported graphs
        q_pos = position[:, None] + steps[None, :]  # [B, T]
        if self.cfg.rope_theta:
            rd = self.cfg.rotary_dim or Dh
            q, k = rotary(q, q_pos, rd, self.cfg.rope_theta), rotary(k, q_pos, rd, self.cfg.rope_theta)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H or Hkv, T, Dh]
        if W:
            k = torch.cat([state["key"], k], dim=2)  # [B, Hkv, W + T, Dh], the window buffer first
            v = torch.cat([state["value"], v], dim=2)
        # Key positions: the buffer holds position - W .. position - 1 (negative: not yet filled).
        k_steps = torch.ones_like(k[0, 0, :, 0]).cumsum(0) - 1 - W  # [W + T]
        k_pos = position[:, None] + k_steps[None, :]  # [B, W + T]
        rep = H // Hkv
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k  # [B, H, W + T, Dh]
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        valid = k_pos >= 0  # [B, W + T]
        qp, kp = q_pos[:, :, None], k_pos[:, None, :]  # [B, T, 1], [B, 1, W + T]
        in_linear = (valid[:, None, :] & (kp <= qp - W))[:, None]  # [B, 1, T, W + T]
        fq = hedgehog_features(q, self.q_map, self.q_map_bias)  # [B, H, T, 2F]
        fk = hedgehog_features(kr, self.k_map, self.k_map_bias)  # [B, H, W + T, 2F]
        a = (fq @ fk.transpose(-1, -2)) * in_linear.float()  # [B, H, T, W + T]
        S, z = state["recurrent_state"], state["normalizer"]
        num = a @ vr + fq @ S  # [B, H, T, Dh]
        den = a.sum(-1) + (fq * z[:, :, None, :]).sum(-1)  # [B, H, T]
        if W:
            in_window = (valid[:, None, :] & (kp <= qp) & (kp > qp - W))[:, None]  # [B, 1, T, W + T]
            s = (q @ kr.transpose(-1, -2)) * Dh**-0.5
            s = s.masked_fill(~in_window, float("-inf"))
            m = s.amax(-1, keepdim=True)  # finite: every query sees itself
            f = torch.sigmoid(self.window_factor.float())[None, :, None, None]
            p = f * torch.exp(s - m)  # masked entries: exp(-inf) = 0
            num = num + p @ vr
            den = den + p.sum(-1)
        o = num / (den[..., None] + self.eps)  # [B, H, T, Dh]
        # Keys that leave the window in this call (position < position + T - W) join the sums.
        leave = (valid & (k_pos < position[:, None] + T - W)).float()[:, None, :, None]  # [B, 1, W + T, 1]
        fk_out = fk * leave
        new_state = {
            "recurrent_state": S + fk_out.transpose(-1, -2) @ vr,
            "normalizer": z + fk_out.sum(2),
        }
        if W:
            new_state["key"], new_state["value"] = k[:, :, -W:], v[:, :, -W:]
        new_state["position"] = position + T
        if self.emit_steps:  # the state after each token t: the keys of indices <= t have left the window
            t = torch.ones_like(k_steps[:T]).cumsum(0)  # [T]: 1 .. T
            joined = (fk * valid.float()[:, None, :, None])[:, :, :T]  # [B, H, T, 2F]: index t leaves at t
            kv = joined[..., :, None] * vr[:, :, :T, None, :]  # [B, H, T, 2F, Dh]
            self.last_steps = {
                "recurrent_state": S[:, None] + torch.cumsum(kv, dim=2).transpose(1, 2),
                "normalizer": z[:, None] + torch.cumsum(joined, dim=2).transpose(1, 2),
            }
            if W:  # the window after token t: indices t + 1 .. t + W of [buffer, call]
                idx = (t[:, None] + torch.ones_like(k_steps[:W]).cumsum(0)[None, :] - 1).long()  # [T, W]
                for name, buf in (("key", k), ("value", v)):
                    self.last_steps[name] = buf[:, :, idx].transpose(1, 2)  # [B, T, Hkv, W, Dh]
            self.last_steps["position"] = position[:, None] + t[None, :]
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, H * Dh).to(x.dtype))
        return y, new_state


@register_mixer("hedgehog_window")
class HedgehogWindow(Hedgehog):
    with_window = True
