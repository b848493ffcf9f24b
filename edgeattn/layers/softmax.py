"""Causal softmax attention mixers: the full baseline ("softmax") and sliding window + sinks ("swa").

Multi-head attention with q/k/v/o projections and no positional encoding (NoPE: causal masking alone
tells the model about order). ``softmax_attention(mode="auto")`` runs the chunk form for T > 1, the
single-token step for T == 1, so the exported step graph is the pure step function. The KV buffer of
``kv_buffer`` (ONNX Runtime's GroupQueryAttention) is an export option of the layer, not a form: a
different state (a preallocated buffer and a position), chosen by the model before tracing.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.softmax import softmax_attention
from edgeattn.ops.softmax.kv_buffer import buffer_attention, gqa_rotary_ok, rope_tables

torch = require("torch")
nn = torch.nn


class _Attention(Mixer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        # Per head [q | gate] when the output is gated (Qwen3.5's q_proj layout).
        self.q_proj = nn.Linear(D, H * Dh * (2 if cfg.attn_output_gate else 1), bias=False)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=False)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(Dh))
            self.k_norm = nn.Parameter(torch.ones(Dh))

    def _qkv(self, x):
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        return (p(x).view(B, T, H, Dh) for p in (self.q_proj, self.k_proj, self.v_proj))  # [B, T, H, Dh]

    def _output(self, o, x):
        return self.o_proj(o.to(x.dtype).reshape(*x.shape[:2], -1))


def _rms(x, weight, eps: float):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rotate(x, pos, rotary_dim: int, theta: float):
    """Rotary embedding (rotate-half convention) on the first ``rotary_dim`` dims of x [B, T, H, Dh];
    pos [T] float positions (every row's), or [B, T] (each row's own)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=x.device) / rotary_dim)
    )
    freqs = pos[..., None] * inv_freq  # [T or B, T, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T or B, T, rotary_dim]
    emb = emb[None, :, None, :] if pos.dim() == 1 else emb[:, :, None, :]  # [1 or B, T, 1, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


_TABLES: dict = {}


def _tables(length: int, rotary_dim: int, theta: float, device):
    """``rope_tables``, one pair per (length, dims, theta, device) for all layers of a model (the last
    few kept: a 262144-token table pair is 64 MiB)."""
    key = (length, rotary_dim, theta, str(device))
    if key not in _TABLES:
        while len(_TABLES) >= 4:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = rope_tables(length, rotary_dim, theta, device)
    return _TABLES[key]


@register_mixer("softmax")
class SoftmaxAttention(_Attention):
    """Full causal attention; the state is a KV cache that grows by one entry per token.

    With the options of imported models (``n_kv_heads``, ``head_size``, ``qk_norm``, ``rope_theta`` /
    ``rotary_dim``, ``attn_output_gate``) the cache holds the ``n_kv_heads`` grouped heads (rotated
    keys) and the position of each token is its index in the cache.

    With ``kv_buffer = L`` (``EdgeLM.set_kv_buffers``: the onnxruntime target) the cache is instead a
    preallocated buffer: ``key``/``value`` [B, Hkv, L, Dh] plus ``position`` [B], updated in place by ONNX
    Runtime's GroupQueryAttention (``edgeattn.ops.softmax.kv_buffer``); in imported layers the q/k norms,
    the rotary embedding (positions ``position + 0 .. T-1``) and the output gate run around that op.
    """

    fixed_size_state = False
    kv_buffer: int | None = None

    @property
    def _extended(self) -> bool:
        c = self.cfg
        return bool(c.n_kv_heads or c.head_size or c.qk_norm or c.rope_theta or c.attn_output_gate)

    supports_kv_buffer = True  # plain and imported layers alike (grouped heads, rotary, norms, gates)

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        H, Dh = self.n_kv_heads, self.head_dim
        if self.kv_buffer:
            L = self.kv_buffer
            return [
                StateSpec("key", (batch_size, H, L, Dh)),
                StateSpec("value", (batch_size, H, L, Dh)),
                StateSpec("position", (batch_size,)),
            ]
        return [
            StateSpec("key", (batch_size, H, "past_length", Dh)),
            StateSpec("value", (batch_size, H, "past_length", Dh)),
        ]

    def _forward_extended(self, x, state):
        B, T, _ = x.shape
        c, H, Hkv, Dh = self.cfg, self.n_heads, self.n_kv_heads, self.head_dim
        if state is None:
            state = self.init_state(B, x.device)
        else:
            self.check_state(state, B)
        q = self.q_proj(x)
        gate = None
        if c.attn_output_gate:
            q, gate = q.view(B, T, H, 2 * Dh).split([Dh, Dh], dim=-1)  # [B, T, H, Dh] each (a static Split)
        q = q.reshape(B, T, H, Dh).float()
        k = self.k_proj(x).view(B, T, Hkv, Dh).float()
        v = self.v_proj(x).view(B, T, Hkv, Dh).float()
        if c.qk_norm:
            q, k = _rms(q, self.q_norm, c.norm_eps), _rms(k, self.k_norm, c.norm_eps)
        if self.kv_buffer:
            rotary = None
            if c.rope_theta:
                rd = c.rotary_dim or Dh
                if gqa_rotary_ok(rd, Dh):  # GroupQueryAttention rotates q and k from cos/sin tables
                    rotary = _tables(self.kv_buffer, rd, c.rope_theta, x.device)
                else:
                    # each row from its own position (rows of a batch sit at different ones: Streams)
                    steps = torch.ones_like(q[0, :, 0, 0]).cumsum(0) - 1  # [T]
                    pos = state["position"][:, None] + steps[None, :]  # [B, T]
                    q, k = _rotate(q, pos, rd, c.rope_theta), _rotate(k, pos, rd, c.rope_theta)
            o, key, value, position = buffer_attention(
                q, k, v, state["key"], state["value"], state["position"], scale=Dh**-0.5, rotary=rotary
            )
            if gate is not None:
                o = o * torch.sigmoid(gate.float())
            return self._output(o, x), {"key": key, "value": value, "position": position}
        key = torch.cat([state["key"], k.transpose(1, 2)], dim=2)  # [B, Hkv, L + T, Dh]
        value = torch.cat([state["value"], v.transpose(1, 2)], dim=2)
        # Positions from the cache length, with tensor ops only (exported graphs keep L dynamic).
        pos = torch.ones_like(key[0, 0, :, 0]).cumsum(0) - 1  # [L + T]
        q_pos = pos[-T:]
        if c.rope_theta:
            rd = c.rotary_dim or Dh
            q = _rotate(q, q_pos, rd, c.rope_theta)
            k = _rotate(k, q_pos, rd, c.rope_theta)
            key = torch.cat([state["key"], k.transpose(1, 2)], dim=2)
        rep = H // Hkv
        kr = key.repeat_interleave(rep, dim=1) if rep > 1 else key  # [B, H, L + T, Dh]
        vr = value.repeat_interleave(rep, dim=1) if rep > 1 else value
        scores = (q.transpose(1, 2) @ kr.transpose(-1, -2)) * Dh**-0.5  # [B, H, T, L + T]
        mask = pos[None, :] <= q_pos[:, None]  # [T, L + T]
        scores = scores.masked_fill(~mask, float("-inf"))
        o = (torch.softmax(scores, dim=-1) @ vr).transpose(1, 2)  # [B, T, H, Dh]
        if gate is not None:
            o = o * torch.sigmoid(gate.float())
        return self._output(o, x), {"key": key, "value": value}

    def forward(self, x, state=None):
        if self._extended:
            return self._forward_extended(x, state)
        B = x.shape[0]
        q, k, v = self._qkv(x)
        if state is not None:
            self.check_state(state, B)
        if self.kv_buffer:
            state = state if state is not None else self.init_state(B, x.device)
            o, key, value, position = buffer_attention(
                q, k, v, state["key"], state["value"], state["position"], scale=self.head_dim**-0.5
            )
            return self._output(o, x), {"key": key, "value": value, "position": position}
        init = None if state is None else (state["key"], state["value"])
        o, (key, value) = softmax_attention(q, k, v, initial_state=init, output_final_state=True, mode="auto")
        return self._output(o, x), {"key": key, "value": value}


@register_mixer("swa")
class SlidingWindowAttention(_Attention):
    """Sliding window of ``cfg.window`` tokens plus the first ``cfg.n_sinks`` tokens (attention sinks).

    State: ``key``/``value`` [B, H, W, Dh] (the last W tokens, oldest first), ``sink_key``/``sink_value``
    [B, H, S, Dh] (the first S tokens; left out when S = 0, since empty tensors trouble some runtimes)
    and ``position`` [B] (tokens seen, float32). Fixed size however long the sequence.
    """

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.window, self.n_sinks = cfg.window, cfg.n_sinks

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        B, H, W, S, Dh = batch_size, self.n_heads, self.window, self.n_sinks, self.head_dim
        specs = [StateSpec("key", (B, H, W, Dh)), StateSpec("value", (B, H, W, Dh))]
        if S > 0:
            specs += [StateSpec("sink_key", (B, H, S, Dh)), StateSpec("sink_value", (B, H, S, Dh))]
        return [*specs, StateSpec("position", (B,))]

    def _cache(self, state):
        """The state dict as the op's (key, value, sink_key, sink_value, position)."""
        if self.n_sinks > 0:
            sink_key, sink_value = state["sink_key"], state["sink_value"]
        else:
            sink_key = sink_value = state["key"].new_zeros(*state["key"].shape[:2], 0, self.head_dim)
        return (state["key"], state["value"], sink_key, sink_value, state["position"])

    def forward(self, x, state=None):
        B, S = x.shape[0], self.n_sinks
        q, k, v = self._qkv(x)
        if state is not None:
            self.check_state(state, B)
        o, cache = softmax_attention(
            q,
            k,
            v,
            window=self.window,
            sink=S,
            initial_state=None if state is None else self._cache(state),
            output_final_state=True,
            mode="auto",
        )
        new_state = {"key": cache[0], "value": cache[1]}
        if S > 0:
            new_state.update(sink_key=cache[2], sink_value=cache[3])
        new_state["position"] = cache[4]
        return self._output(o, x), new_state
