"""Reformer LSH attention mixer (Kitaev et al. 2020): shared-QK causal attention within LSH buckets.

One projection gives the shared ``qk``; keys are ``qk / |qk|``; token ``t`` attends to the earlier
tokens that hash to its bucket (``cfg.lsh_buckets`` angular buckets, ``cfg.lsh_rounds`` rounds averaged
by their log-sum-exp), never to itself unless alone. The random rotations are a saved buffer.

The mixer uses the whole-bucket pattern (``lsh_attention(..., bucket_size=None)``), not the paper's
sort-and-chunk form: which tokens share a chunk depends on how later tokens sort, so the chunked
pattern of a prefix changes as the sequence grows and could not continue from a cache. The state is
a KV cache like ``softmax``'s (``key`` [B, H, L, Dh], the normalized keys, and ``value``); one decoded
token hashes the new query and every cached key and scores the keys of its buckets, so its cost is
O(R L (K n_buckets / 2 + K + V)) per head for L cached tokens and R rounds: linear in the context,
like the softmax baseline (the bucket restriction is a mask, it saves no work at decode time).
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.layers.base import Mixer, StateSpec, register_mixer
from edgeattn.ops.lsh import lsh_attention, lsh_rotations

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


@register_mixer("reformer")
class ReformerAttention(Mixer):
    """Shared-QK LSH attention; the state is a growing KV cache (names ``key``, ``value``)."""

    fixed_size_state = False

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        D = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qk_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        gen = torch.Generator().manual_seed(4321 + layer_idx)
        self.register_buffer("rotations", lsh_rotations(self.head_dim, cfg.lsh_buckets, cfg.lsh_rounds, gen))

    def state_spec(self, batch_size: int) -> list[StateSpec]:
        H, Dh = self.n_heads, self.head_dim
        return [
            StateSpec("key", (batch_size, H, "past_length", Dh)),
            StateSpec("value", (batch_size, H, "past_length", Dh)),
        ]

    def forward(self, x, state=None):
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        q = self.qk_proj(x).view(B, T, H, Dh)  # [B, T, H, Dh], the shared qk
        k = F.normalize(q, dim=-1)
        v = self.v_proj(x).view(B, T, H, Dh)
        if state is not None:
            self.check_state(state, B)
        o, (key, value) = lsh_attention(
            q,
            k,
            v,
            rotations=self.rotations,
            bucket_size=None,
            exclude_self=True,
            scale=Dh**-0.5,
            initial_state=None if state is None else (state["key"], state["value"]),
            output_final_state=True,
            mode="auto",
        )
        y = self.o_proj(o.to(x.dtype).reshape(B, T, -1))
        return y, {"key": key, "value": value}
