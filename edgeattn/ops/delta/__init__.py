"""The delta rule: DeltaNet (no gate), Gated DeltaNet (a scalar gate per head and token) and Kimi Delta
Attention (a gate per key dimension) are one op:

    S_t = exp(g_t) * S_{t-1},   S_t = S_t + beta_t k_t^T (v_t - k_t S_t),   o_t = scale * q_t S_t

Three forms (naive loop, recurrent loop of the exported step, chunkwise WY / UT transform), and on
CUDA a Triton kernel; ``mode="auto"`` (the layers' call) runs the single step for one token, the chunk
form otherwise, and ONNX Runtime's contrib op while an export for the onnxruntime target traces (all
chosen in ``edgeattn.ops.backend``); the math is in README.md. ``delta_beta`` and ``gated_delta_gates``
are the layers' gates.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form, contrib_op, use_kernel
from edgeattn.ops.delta.chunk import chunk_delta_rule
from edgeattn.ops.delta.naive import naive_delta_rule
from edgeattn.ops.delta.step import delta_rule_step
from edgeattn.ops.utils import check_chunk_size, check_dims, check_log_gate, check_mode, check_rank, tracing

torch = require("torch")
Tensor = torch.Tensor

__all__ = ["delta_beta", "delta_rule", "delta_rule_step", "gated_delta_gates"]

MODES = ("auto", "naive", "recurrent", "chunk")
F = torch.nn.functional


def delta_beta(b: Tensor, allow_neg_eigval: bool = False) -> Tensor:
    """The write strength beta = sigmoid(b) [B, T, HV] float32, doubled into [0, 2] with
    ``allow_neg_eigval`` (the update's eigenvalue may then reach -1)."""
    beta = torch.sigmoid(b.float())
    return beta * 2 if allow_neg_eigval else beta


def gated_delta_gates(
    a: Tensor,
    b: Tensor,
    dt_bias: Tensor,
    decay_scale: Tensor,
    *,
    allow_neg_eigval: bool = False,
    mode: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's gates from its projections a, b [B, T, HV] and dt_bias, decay_scale [HV]
    (decay_scale = -exp(A_log)): (beta = ``delta_beta(b)``, log-space g = decay_scale * softplus(a + dt_bias)),
    both [B, T, HV] float32.

    ``mode``: "plain" (these PyTorch ops) or "auto": while an export installs the contrib op
    (``edgeattn.ops.backend``), one ``LinearAttentionGate`` node (not with ``allow_neg_eigval``: the
    node's beta is sigmoid(b)); plain otherwise."""
    check_mode(mode, ("auto", "plain"))
    fused = contrib_op("gated_delta_gates") if mode == "auto" and not allow_neg_eigval else None
    if fused is not None:
        g, beta = fused(a, dt_bias, decay_scale, b)
        return beta, g
    beta = delta_beta(b, allow_neg_eigval)
    return beta, decay_scale * F.softplus(a.float() + dt_bias.float())


def _check_beta(beta: Tensor) -> None:
    """beta in [0, 2]: the update I - beta k^T k (unit k) is then a contraction. Skipped while tracing."""
    if tracing():
        return
    if torch.isnan(beta).any() or (beta < 0).any() or (beta > 2).any():
        lo, hi = beta.min().item(), beta.max().item()
        raise ValueError(f"beta must lie in [0, 2] (no NaN), got values in [{lo:.4g}, {hi:.4g}]")


def _use_kernel(q, k, v, backend) -> bool:
    """Whether this chunk-form call runs the Triton kernel (``edgeattn.ops.backend.use_kernel``)."""
    uncovered = {
        f"{q.dtype} inputs": q.dtype not in (torch.float32, torch.bfloat16, torch.float16),
        "q, k, v of different dtypes": not (q.dtype == k.dtype == v.dtype),
        f"head size K = {q.shape[-1]} > 128": q.shape[-1] > 128,
    }
    return use_kernel(q.device.type, backend, uncovered, "delta-rule kernels")


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    backend: str | None = None,
):
    """The (gated) delta rule over ``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]`` with HV a multiple of H
    (key head h serves value heads ``h*HV/H .. (h+1)*HV/H - 1``, i.e. ``repeat_interleave`` on the head
    axis, as fla's KDA), ``beta: [B, T, HV]`` in [0, 2].

    ``g`` is a log-space gate (<= 0): None (DeltaNet), ``[B, T, HV]`` (Gated DeltaNet) or
    ``[B, T, HV, K]`` (KDA, one decay per key row of S). ``scale`` defaults to ``K ** -0.5`` and
    multiplies the output (fla's references scale q, the same thing). Keys are used as given: DeltaNet
    layers L2-normalise them, and the recurrence is only stable for unit keys.

    ``initial_state: [B, HV, K, V]``; states are float32 (float64 inputs stay float64, for references).
    Returns ``(o [B, T, HV, V] in q's dtype, final_state [B, HV, K, V] or None)``.

    ``mode``: "naive" (the loop), "recurrent" (a loop of ``delta_rule_step``, the exported step),
    "chunk" (chunkwise WY form) or "auto": ``delta_rule_step`` for T == 1, "chunk" otherwise, and ONNX
    Runtime's ``LinearAttention`` while an export for the onnxruntime target traces
    (``edgeattn.ops.backend.choose_form``; these two check shapes but not beta's or g's values).
    ``backend`` ("auto", "torch", "triton"; see ``edgeattn.ops.backend``) picks the chunk implementation. With "triton" it calls

        edgeattn.kernels.chunk_delta_rule_triton(q, k, v, beta, g, *, scale, initial_state, chunk_size)
            -> (o [B, T, HV, V] in q's dtype, final_state [B, HV, K, V] float32)

    with q, k [B, T, H, K] (not expanded to HV heads), v [B, T, HV, V] and beta [B, T, HV] as given
    (bf16/fp16 unconverted), g None or the float32 log-gate [B, T, HV, G] with G = 1 (scalar gate) or
    G = K, initial_state None or float32 [B, HV, K, V]; differentiable in every input. float64 inputs,
    mixed dtypes of q, k, v and K > 128 run the PyTorch form (a ValueError with backend="triton").
    """
    check_mode(mode, MODES)
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_rank("v", v, 4, "[B, T, HV, V]")
    check_dims("v", v, (B, T, None, None), "[B, T, HV, V] (B, T as q)")
    HV, V = v.shape[2:]
    if HV < H or HV % H:
        raise ValueError(
            f"v must have shape [B, T, HV, V] with HV a multiple of H = {H} (q's heads), got {tuple(v.shape)}"
        )
    check_dims("beta", beta, (B, T, HV), "[B, T, HV]")
    check_chunk_size(chunk_size)
    if g is not None:
        if not isinstance(g, torch.Tensor) or g.dim() not in (3, 4):
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"g must have shape [B, T, HV] or [B, T, HV, K], got {got}")
        if g.dim() == 3:
            check_dims("g", g, (B, T, HV), "[B, T, HV]")
        else:
            check_dims("g", g, (B, T, HV, K), "[B, T, HV, K]")
    if initial_state is not None:
        check_dims("initial_state", initial_state, (B, HV, K, V), "[B, HV, K, V]")
    mode = choose_form(mode, T, "delta_rule")
    if mode in ("fused", "step"):
        # Before any conversion below: these forms trace exactly the ops of the exported graphs.
        S0 = (
            initial_state
            if initial_state is not None
            else q.new_zeros(B, HV, K, V, dtype=torch.promote_types(q.dtype, torch.float32))
        )
        scale = K**-0.5 if scale is None else scale
        if mode == "fused":
            o, S = contrib_op("delta_rule")(q, k, v, beta, g, S0, scale=scale)
        else:
            o, S = delta_rule_step(
                q[:, 0], k[:, 0], v[:, 0], beta[:, 0], None if g is None else g[:, 0], S0, scale=scale
            )
            o = o.unsqueeze(1)
        o = o if o.dtype == q.dtype else o.to(q.dtype)
        return o, (S if output_final_state else None)
    _check_beta(beta)
    gate = None
    if g is not None:
        gate = g.unsqueeze(-1) if g.dim() == 3 else g  # [B, T, HV, G]
        check_log_gate("g", g)
    if scale is None:
        scale = K**-0.5
    # Accumulate in float32 (float64 inputs stay float64, for references).
    acc = torch.promote_types(q.dtype, torch.float32)
    S0 = None if initial_state is None else initial_state.to(acc)

    out_dtype = q.dtype
    qf, kf, vf, bf = q.to(acc), k.to(acc), v.to(acc), beta.to(acc)
    gate = None if gate is None else gate.to(acc)

    if mode == "naive":
        o, S = naive_delta_rule(qf, kf, vf, bf, gate, scale=scale, initial_state=S0)
    elif mode == "recurrent":
        S = S0 if S0 is not None else qf.new_zeros(B, HV, K, V)
        g_t = None if g is None else g.to(acc)
        outs = []
        for t in range(T):
            o_t, S = delta_rule_step(
                qf[:, t], kf[:, t], vf[:, t], bf[:, t], None if g_t is None else g_t[:, t], S, scale=scale
            )
            outs.append(o_t)
        o = torch.stack(outs, dim=1) if outs else vf.new_zeros(B, 0, HV, V)
    elif _use_kernel(q, k, v, backend):
        try:
            from edgeattn.kernels import chunk_delta_rule_triton
        except ImportError as e:
            raise ValueError(
                "the Triton delta-rule kernel is not available (edgeattn.kernels.chunk_delta_rule_triton); "
                "use backend='torch'"
            ) from e
        # The kernels take bf16/fp16 as they are (float32 accumulation): no float32 copies.
        o, S = chunk_delta_rule_triton(
            q, k, v, beta, gate, scale=scale, initial_state=S0, chunk_size=chunk_size
        )
    else:
        o, S = chunk_delta_rule(qf, kf, vf, bf, gate, initial_state=S0, chunk_size=chunk_size)
        o = o * scale
    return o.to(out_dtype), (S if output_final_state else None)
