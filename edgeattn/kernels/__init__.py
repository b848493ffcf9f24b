"""Triton kernels for training (forward + backward), called by ``edgeattn.ops`` on CUDA.

    chunk_gated_recurrence_triton(q, k, v, g, *, initial_state, chunk_size) -> (o, final_state)

has the contract of ``edgeattn.ops.common.chunk.chunk_gated_recurrence`` (q, k [B, T, H, K],
v [B, T, H, V], g None or [B, T, H, 1 or K] log-gates, initial_state None or [B, H, K, V]; returns the
unscaled output in q's dtype and the float32 final state) and is differentiable in every input.
It runs the fused recurrent kernel for T <= 64 on CUDA and the chunk kernels otherwise. Both are
also public, for tests and benchmarks.

    aft_triton(q, k, v, decay, window_bias=None) -> o     AFT with a decay (and window bias), zero state
    mixed_chunk_attention_triton(q_quad, k_quad, q_lin, k_lin, v, *, chunk_size, quad_scale, lin_scale,
                                 rel_bias) -> o           FLASH mixed-chunk attention, no initial state

    chunk_delta_rule_triton(q, k, v, beta, g=None, *, scale, initial_state=None, chunk_size=64)
        -> (o, final_state)                               the delta rule: DeltaNet, Gated DeltaNet, KDA

back ``edgeattn.ops.aft.aft``, ``edgeattn.ops.flash.mixed_chunk_attention`` and
``edgeattn.ops.delta_rule`` (mode="chunk") in those cases (``aft.py``, ``flash.py``, ``delta_chunk.py``).
Without a GPU they run under ``TRITON_INTERPRET=1`` (slowly).
"""

from __future__ import annotations

from edgeattn.kernels.aft import aft_triton
from edgeattn.kernels.delta_chunk import chunk_delta_rule_triton
from edgeattn.kernels.flash import mixed_chunk_attention_triton
from edgeattn.kernels.fused_recurrent import fused_recurrent_gated_recurrence
from edgeattn.kernels.gated_chunk import chunk_gated_recurrence_kernel

FUSED_MAX_T = 64  # up to this many tokens the fused recurrent kernel beats the chunk kernels' launches


def chunk_gated_recurrence_triton(q, k, v, g, *, initial_state, chunk_size: int = 64):
    """Triton gated linear recurrence; see the module docstring."""
    if q.is_cuda and q.shape[1] <= FUSED_MAX_T:
        return fused_recurrent_gated_recurrence(q, k, v, g, initial_state=initial_state)
    return chunk_gated_recurrence_kernel(q, k, v, g, initial_state=initial_state, chunk_size=chunk_size)


__all__ = [
    "FUSED_MAX_T",
    "aft_triton",
    "chunk_delta_rule_triton",
    "chunk_gated_recurrence_kernel",
    "chunk_gated_recurrence_triton",
    "fused_recurrent_gated_recurrence",
    "mixed_chunk_attention_triton",
]
