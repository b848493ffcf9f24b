"""The gated linear recurrence that Linear Transformer, Performer, RetNet and GLA reduce to.

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t

One core, four forms (naive loop, recurrent loop of the exported step, chunkwise, fully parallel),
and on CUDA the Triton kernels of ``edgeattn.kernels``; ``mode="auto"`` (the layers' call) runs the
single step for one token, the chunk form otherwise, and ONNX Runtime's contrib op while an export for
the onnxruntime target traces (all chosen in ``edgeattn.ops.backend``).
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form, contrib_op, resolve_backend
from edgeattn.ops.common.chunk import chunk_gated_recurrence, parallel_gated_recurrence
from edgeattn.ops.common.naive import naive_gated_recurrence
from edgeattn.ops.common.step import gated_recurrence_step
from edgeattn.ops.utils import check_chunk_size, check_dims, check_log_gate, check_mode, check_rank, tracing

torch = require("torch")
Tensor = torch.Tensor

# The chunk and parallel forms (and the Triton kernels) take differences of cumulative log-gates, and
# -inf - (-inf) is NaN. Gates are clamped here first: exp(-1000) is 0 in float32 and float64 alike, so a
# gate of -inf (a hard reset) or anything below -1000 still empties the state exactly.
LOG_GATE_FLOOR = -1000.0

__all__ = ["gated_linear_attention", "gated_recurrence_step", "expand_gate", "gated_state_steps"]


def _check_gate(g: Tensor, B: int, T: int, H: int, K: int) -> None:
    if g.dim() == 1:
        check_dims("g", g, (H,), "[H]")
    elif g.dim() == 3:
        check_dims("g", g, (B, T, H), "[B, T, H]")
    elif g.dim() == 4:
        check_dims("g", g, (B, T, H, K), "[B, T, H, K]")
    else:
        raise ValueError(f"g must have shape [H], [B, T, H] or [B, T, H, K], got {tuple(g.shape)}")


def expand_gate(g: Tensor | None, B: int, T: int, H: int, K: int) -> Tensor | None:
    """Any accepted gate layout -> [B, T, H, G], G = 1 (whole head) or K (per key row)."""
    if g is None:
        return None
    _check_gate(g, B, T, H, K)
    if g.dim() == 1:
        return g.view(1, 1, H, 1).expand(B, T, H, 1)
    if g.dim() == 3:
        return g.unsqueeze(-1)
    return g


def gated_state_steps(k: Tensor, v: Tensor, g: Tensor | None, S0: Tensor, z0: Tensor | None = None):
    """The state after each token of a call, as ``gated_linear_attention`` leaves it after a call on the first
    t + 1 tokens: ``S_t = exp(g_t) * S_{t-1} + k_t^T v_t`` (and ``z_t = exp(g_t) * z_{t-1} + k_t``) in closed
    form, ``S_t = exp(L_t) S0 + sum_{i <= t} exp(L_t - L_i) k_i^T v_i`` with ``L`` the cumulative log gate.

    ``k [B, T, H, K]`` (feature-mapped, as the recurrence takes it), ``v [B, T, H, V]``, ``g`` None, ``[H]``,
    ``[B, T, H]`` or ``[B, T, H, K]``, ``S0 [B, H, K, V]``, ``z0 [B, H, K]`` or None. Returns ``(S [B, T, H, K,
    V], z [B, T, H, K] or None)`` in float32. O(T^2 H K V): meant for a speculative verify call's few tokens
    (the export option ``verify_states``), where the runtime takes the state after the last kept draft
    instead of re-advancing. Traces with a dynamic T (no Python int of T is read)."""
    acc = torch.promote_types(k.dtype, torch.float32)
    k, v, S0 = k.to(acc), v.to(acc), S0.to(acc)
    kv = k[..., :, None] * v[..., None, :]  # [B, T, H, K, V]
    if g is None:
        S = S0[:, None] + torch.cumsum(kv, dim=1)
        return S, (None if z0 is None else z0.to(acc)[:, None] + torch.cumsum(k, dim=1))
    g = g.to(acc)
    if g.dim() == 1:  # [H]: broadcast against k's batch and tokens (no expand to Python ints of T)
        g = g.view(1, 1, -1, 1) + torch.zeros_like(k[..., :1])
    elif g.dim() == 3:
        g = g.unsqueeze(-1)
    L = torch.cumsum(g.clamp_min(LOG_GATE_FLOOR), dim=1)  # [B, T, H, G], G = 1 or K
    t = torch.ones_like(k[0, :, 0, 0]).cumsum(0)  # [T]
    later = t[None, :] > t[:, None]  # [Tt, Ti]: i after t, not yet in the state
    diff = (L[:, :, None] - L[:, None, :]).masked_fill(later[None, :, :, None, None], float("-inf"))
    w = torch.exp(diff)  # [B, Tt, Ti, H, G]: the decay from i to t
    decay = torch.exp(L)  # [B, T, H, G]
    S = decay[..., None] * S0[:, None] + (w[..., None] * kv[:, None]).sum(2)
    z = None
    if z0 is not None:
        z = decay * z0.to(acc)[:, None] + (w * k[:, None]).sum(2)
    return S, z


def _initial_state(initial_state, normalize: bool, B: int, H: int, K: int, V: int):
    """(S0 [B, H, K, V] or None, z0 [B, H, K] or None) as given: checked, not converted."""
    if initial_state is None:
        return None, None
    if not normalize:
        check_dims("initial_state", initial_state, (B, H, K, V), "[B, H, K, V]")
        return initial_state, None
    if not (isinstance(initial_state, tuple | list) and len(initial_state) == 2):
        raise ValueError("initial_state must be a pair (S [B, H, K, V], z [B, H, K]) when normalize=True")
    check_dims("initial_state[0]", initial_state[0], (B, H, K, V), "[B, H, K, V]")
    check_dims("initial_state[1]", initial_state[1], (B, H, K), "[B, H, K]")
    return initial_state[0], initial_state[1]


def _step(q, k, v, g, S0, z0, *, scale: float, normalize: bool, eps: float):
    """One token (T == 1): the exported step function. The gate becomes [B, H, G]; a per-token [B, T, H]
    gate is sliced after q, k and v, the others before (the exported graphs' node order)."""
    per_token = g is not None and g.dim() == 3
    if g is not None and not per_token:
        B, _, H, _ = q.shape
        g = g.view(1, H, 1).expand(B, H, 1) if g.dim() == 1 else g[:, 0]
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    if per_token:
        g = g[:, 0].unsqueeze(-1)
    o, S, z = gated_recurrence_step(q, k, v, g, S0, z0, scale=scale, eps=eps)
    return o.unsqueeze(1), S, z


def _fused(q, k, v, g, S0, z0, *, scale: float, normalize: bool, eps: float):
    """ONNX Runtime's LinearAttention (installed by the export). The normalizer is the same recurrence run
    on a value of ones: a second op with a [K, 1] state."""
    fused = contrib_op("linear_attention")
    B, T, H, _ = q.shape
    if g is not None:
        g = g.view(1, 1, H, 1).expand(B, T, H, 1) if g.dim() == 1 else g.unsqueeze(-1) if g.dim() == 3 else g
    o, S = fused(q, k, v, g, S0, scale=1.0 if normalize else scale)
    if not normalize:
        return o, S, None
    den, z = fused(q, k, v.new_ones(B, T, H, 1), g, z0.unsqueeze(-1), scale=1.0)
    return o / (den + eps), S, z.squeeze(-1)


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    *,
    scale: float | None = None,
    normalize: bool = False,
    eps: float = 1e-6,
    initial_state: Tensor | tuple[Tensor, Tensor] | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    backend: str | None = None,
):
    """Gated linear attention over ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``.

    ``g`` is a log-space gate (<= 0): ``[H]`` (constant per head, RetNet), ``[B, T, H]`` (per head and
    token) or ``[B, T, H, K]`` (per key dimension, GLA); None means no decay. ``-inf`` is a hard reset
    (the state is emptied) in every mode. ``scale`` defaults to
    ``K ** -0.5``. With ``normalize=True`` the output is ``(q S) / (q . z + eps)`` and no scale applies;
    the state is then a pair ``(S [B, H, K, V], z [B, H, K])``, otherwise ``S``. States are float32.

    Returns ``(o [B, T, H, V] in q's dtype, final_state or None)``. ``backend`` ("auto", "torch",
    "triton") picks the chunk implementation; see ``edgeattn.ops.backend``. ``mode="auto"`` runs
    ``gated_recurrence_step`` for T == 1, "chunk" otherwise, and ONNX Runtime's ``LinearAttention`` while
    an export for the onnxruntime target traces (``edgeattn.ops.backend.choose_form``); the step and the
    contrib op check shapes but not the gate's values (no device sync per token).
    """
    check_mode(mode, ("auto", "naive", "parallel", "chunk", "recurrent"))
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_rank("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    V = v.shape[-1]
    check_chunk_size(chunk_size)
    # Accumulate in float32 (float64 inputs stay float64, for references).
    acc = torch.promote_types(q.dtype, torch.float32)
    mode = choose_form(mode, T, "linear_attention")
    if mode in ("fused", "step"):
        # Before any conversion below: these forms trace exactly the ops of the exported graphs. The gate's
        # shape is not read while tracing (a buffer's sizes read first would move it up the exported graph).
        if g is not None and not tracing():
            _check_gate(g, B, T, H, K)
        S0, z0 = _initial_state(initial_state, normalize, B, H, K, V)
        S0 = q.new_zeros(B, H, K, V, dtype=acc) if S0 is None else S0
        z0 = q.new_zeros(B, H, K, dtype=acc) if normalize and z0 is None else z0
        run = _fused if mode == "fused" else _step
        o, S, z = run(
            q, k, v, g, S0, z0, scale=K**-0.5 if scale is None else scale, normalize=normalize, eps=eps
        )
        o = o if o.dtype == q.dtype else o.to(q.dtype)
        return o, (((S, z) if normalize else S) if output_final_state else None)
    gate = expand_gate(g, B, T, H, K)
    if gate is not None:
        check_log_gate("g", gate)
    if scale is None:
        scale = K**-0.5
    S0, z0 = _initial_state(initial_state, normalize, B, H, K, V)
    S0 = None if S0 is None else S0.to(acc)
    z0 = None if z0 is None else z0.to(acc)

    out_dtype = q.dtype
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    gate = None if gate is None else gate.to(acc)

    if mode == "naive":
        state0 = (S0, z0) if normalize else S0
        o, state = naive_gated_recurrence(
            qf, kf, vf, gate, scale=scale, normalize=normalize, eps=eps, initial_state=state0
        )
        return o.to(out_dtype), (state if output_final_state else None)

    if mode == "recurrent":
        S = S0 if S0 is not None else qf.new_zeros(B, H, K, V)
        z = (z0 if z0 is not None else qf.new_zeros(B, H, K)) if normalize else None
        outs = []
        for t in range(T):
            o_t, S, z = gated_recurrence_step(
                qf[:, t], kf[:, t], vf[:, t], None if gate is None else gate[:, t], S, z, scale=scale, eps=eps
            )
            outs.append(o_t)
        o = torch.stack(outs, dim=1) if outs else vf.new_zeros(B, 0, H, V)
        state = (S, z) if normalize else S
        return o.to(out_dtype), (state if output_final_state else None)

    if gate is not None:
        gate = gate.clamp_min(LOG_GATE_FLOOR)  # exact: see LOG_GATE_FLOOR
    # chunk / parallel: the normalizer z is the state of v extended by a column of ones.
    if normalize:
        vf = torch.cat([vf, vf.new_ones(B, T, H, 1)], dim=-1)
        if S0 is not None or z0 is not None:
            S0 = S0 if S0 is not None else vf.new_zeros(B, H, K, V)
            z0 = z0 if z0 is not None else vf.new_zeros(B, H, K)
            S0 = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)
    if mode == "parallel":
        o, S = parallel_gated_recurrence(qf, kf, vf, gate, initial_state=S0)
    elif resolve_backend(q.device.type, backend) == "triton":
        from edgeattn.kernels import chunk_gated_recurrence_triton

        # The kernels take bf16/fp16 as they are (float32 accumulation): no float32 copies.
        low = q.dtype in (torch.bfloat16, torch.float16)
        args = (q, k, vf.to(q.dtype)) if low else (qf, kf, vf)
        o, S = chunk_gated_recurrence_triton(*args, gate, initial_state=S0, chunk_size=chunk_size)
        o = o.to(acc)
    else:
        o, S = chunk_gated_recurrence(qf, kf, vf, gate, initial_state=S0, chunk_size=chunk_size)
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
        state = (S[..., :V], S[..., V])
    else:
        o = o * scale
        state = S
    return o.to(out_dtype), (state if output_final_state else None)
