"""Causal softmax attention mixers: the full baseline ("softmax") and sliding window + sinks ("swa").

Multi-head attention with q/k/v/o projections and no positional encoding (NoPE: causal masking alone
tells the model about order). The chunk form runs for T > 1, the single-token step for T == 1, so
the exported step graph is the pure step function.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.softmax import softmax_attention, softmax_step, window_step
from edgeattn.ops.softmax.kv_buffer import buffer_attention

torch = require("torch")
nn = torch.nn


class _Attention(Mixer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)

    def _qkv(self, x):
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        return (p(x).view(B, T, H, Dh) for p in (self.q_proj, self.k_proj, self.v_proj))  # [B, T, H, Dh]

    def _output(self, o, x):
        return self.o_proj(o.to(x.dtype).reshape(*x.shape[:2], -1))


@register_mixer("softmax")
class SoftmaxAttention(_Attention):
    """Full causal attention; the state is a KV cache that grows by one entry per token.

    With ``kv_buffer = L`` (set by the exporter for the onnxruntime target) the cache is instead a
    preallocated buffer: ``key``/``value`` [B, H, L, Dh] plus ``position`` [B], updated in place by ONNX
    Runtime's GroupQueryAttention (``edgeattn.ops.softmax.kv_buffer``).
    """

    fixed_size_state = False
    kv_buffer: int | None = None

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        H, Dh = self.n_heads, self.head_dim
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

    def forward(self, x, state=None):
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        if state is not None:
            self.check_state(state, B)
        if self.kv_buffer:
            state = state if state is not None else self.init_state(B, x.device)
            o, key, value, position = buffer_attention(
                q, k, v, state["key"], state["value"], state["position"], scale=self.head_dim**-0.5
            )
            return self._output(o, x), {"key": key, "value": value, "position": position}
        if T == 1:
            if state is None:
                state = self.init_state(B, x.device)
            o, key, value = softmax_step(
                q[:, 0], k[:, 0], v[:, 0], state["key"], state["value"], scale=self.head_dim**-0.5
            )
            o = o.unsqueeze(1)
        else:
            init = None if state is None else (state["key"], state["value"])
            o, (key, value) = softmax_attention(q, k, v, initial_state=init, output_final_state=True)
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
        B, T, _ = x.shape
        Dh, S = self.head_dim, self.n_sinks
        q, k, v = self._qkv(x)
        if state is not None:
            self.check_state(state, B)
        if T == 1:
            cache = self._cache(state if state is not None else self.init_state(B, x.device))
            o, *cache = window_step(q[:, 0], k[:, 0], v[:, 0], *cache, scale=Dh**-0.5)
            o = o.unsqueeze(1)
        else:
            o, cache = softmax_attention(
                q,
                k,
                v,
                window=self.window,
                sink=S,
                initial_state=None if state is None else self._cache(state),
                output_final_state=True,
            )
        new_state = {"key": cache[0], "value": cache[1]}
        if S > 0:
            new_state.update(sink_key=cache[2], sink_value=cache[3])
        new_state["position"] = cache[4]
        return self._output(o, x), new_state
