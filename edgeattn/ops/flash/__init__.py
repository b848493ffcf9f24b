"""FLASH mixed-chunk attention (Hua et al. 2022, "Transformer Quality in Linear Time").

Quadratic relu^2 attention inside fixed chunks of C tokens, linear attention across chunks:

    o_t = sum_{j in c, j <= t} relu(quad_scale * q_quad_t . k_quad_j + b_{t-j})^2 v_j
          + lin_scale * q_lin_t (sum_{i in chunks < c} k_lin_i^T v_i)

Four forms (naive loop, recurrent loop of the exported step, chunkwise, fully parallel) and ``mode="auto"``
(the layers' call: the step for one token, the chunk form otherwise, chosen in ``edgeattn.ops.backend``);
see README.md.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form, resolve_backend, use_kernel
from edgeattn.ops.flash.chunk import chunk_mixed_attention, parallel_mixed_attention
from edgeattn.ops.flash.naive import naive_mixed_chunk_attention
from edgeattn.ops.flash.step import FlashState, mixed_chunk_step, zero_state
from edgeattn.ops.utils import check_chunk_size, check_dims, check_mode, check_rank, tracing

torch = require("torch")
Tensor = torch.Tensor

__all__ = ["FlashState", "mixed_chunk_attention", "mixed_chunk_step"]

STATE_LAYOUT = (
    "(linear_state [B, S, E], chunk_state [B, S, E], key_quad [B, chunk_size, S], "
    "value [B, chunk_size, E], position [B])"
)


def _check_state(initial_state, B: int, S: int, E: int, C: int) -> FlashState:
    """The state as given, its shapes checked (not its values, not converted)."""
    if not (isinstance(initial_state, tuple | list) and len(initial_state) == len(FlashState._fields)):
        raise ValueError(f"initial_state must be a tuple {STATE_LAYOUT}, got {type(initial_state).__name__}")
    shapes = {
        "linear_state": ((B, S, E), "[B, S, E]"),
        "chunk_state": ((B, S, E), "[B, S, E]"),
        "key_quad": ((B, C, S), "[B, chunk_size, S]"),
        "value": ((B, C, E), "[B, chunk_size, E]"),
        "position": ((B,), "[B]"),
    }
    for i, (name, x) in enumerate(zip(FlashState._fields, initial_state)):
        shape, layout = shapes[name]
        check_dims(f"initial_state[{i}] ({name})", x, shape, layout)
    return FlashState(*initial_state)


def _check_position(pos: Tensor, C: int) -> None:
    if not tracing() and ((pos < 0) | (pos >= C) | (pos != torch.floor(pos))).any():
        raise ValueError(
            f"initial_state[4] (position) must hold integers in [0, chunk_size={C}), got {pos.tolist()}"
        )


def mixed_chunk_attention(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    *,
    chunk_size: int,
    quad_scale: float | None = None,
    lin_scale: float | None = None,
    rel_bias: Tensor | None = None,
    initial_state: FlashState | tuple | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    backend: str | None = None,
):
    """Mixed-chunk attention over ``q_*, k_*: [B, T, S]``, ``v: [B, T, E]``.

    Chunks are fixed groups of ``chunk_size`` tokens counted from the start of the sequence (position 0
    of the initial state). ``quad_scale`` and ``lin_scale`` default to ``1 / chunk_size``; ``rel_bias``
    (``[chunk_size]``, by offset t - j) to 0. The state is a ``FlashState`` (a tuple) of float32 tensors
    ``(linear_state, chunk_state, key_quad, value, position)``: the ``k_lin^T v`` sum of the finished
    chunks, the running sum of the current chunk, the current chunk's ``k_quad`` and ``v`` and the
    number of its tokens; any ``final_state`` continues the sequence when passed back as
    ``initial_state``, mid-chunk included.

    Returns ``(o [B, T, E] in q_quad's dtype, final FlashState or None)``. Computes in float32 (float64
    for float64 inputs). ``mode``: "naive", "recurrent" (a loop of ``mixed_chunk_step``), "chunk",
    "parallel" or "auto": ``mixed_chunk_step`` for T == 1, "chunk" otherwise
    (``edgeattn.ops.backend.choose_form``; the step checks the state's shapes, not its position's
    values). ``backend`` ("auto", "torch", "triton") picks the chunk implementation
    (``edgeattn.ops.backend``); the Triton kernels cover no initial state, no final state, chunk_size
    * S <= 64 * 128 and float32/bfloat16/float16 inputs.
    """
    check_mode(mode, ("auto", "naive", "parallel", "chunk", "recurrent"))
    check_rank("q_quad", q_quad, 3, "[B, T, S]")
    B, T, S = q_quad.shape
    for name, x in (("k_quad", k_quad), ("q_lin", q_lin), ("k_lin", k_lin)):
        check_dims(name, x, (B, T, S), "[B, T, S] (as q_quad)")
    check_dims("v", v, (B, T, None), "[B, T, E] (B, T as q_quad)")
    E = v.shape[-1]
    check_chunk_size(chunk_size)
    C = chunk_size
    if rel_bias is not None:
        check_dims("rel_bias", rel_bias, (C,), "[chunk_size]")
    # Accumulate in float32 (float64 inputs stay float64, for references).
    acc = torch.promote_types(q_quad.dtype, torch.float32)
    state = None if initial_state is None else _check_state(initial_state, B, S, E, C)
    quad_scale = 1.0 / C if quad_scale is None else quad_scale
    lin_scale = 1.0 / C if lin_scale is None else lin_scale
    mode = choose_form(mode, T, "mixed_chunk_attention")
    if mode == "step":
        # Before any conversion below: the step traces exactly the ops of the exported step graph (and
        # checks the state's shapes, not its position's values: no device sync per token).
        state = _or_zeros(state, B, S, E, C, acc, q_quad.device)
        xs = (x[:, 0] for x in (q_quad, k_quad, q_lin, k_lin, v))
        o, final = mixed_chunk_step(*xs, state, quad_scale=quad_scale, lin_scale=lin_scale, rel_bias=rel_bias)
        o = o.unsqueeze(1)
        return (o if o.dtype == q_quad.dtype else o.to(q_quad.dtype)), (final if output_final_state else None)
    if state is not None:
        state = FlashState(*(x.to(acc) for x in state))
        _check_position(state.position, C)

    out_dtype = q_quad.dtype
    xs = tuple(x.to(acc) for x in (q_quad, k_quad, q_lin, k_lin, v))
    bias = None if rel_bias is None else rel_bias.to(acc)
    kw = dict(chunk_size=C, quad_scale=quad_scale, lin_scale=lin_scale)

    if mode == "naive":
        bias = q_quad.new_zeros(C, dtype=acc) if bias is None else bias
        o, final = naive_mixed_chunk_attention(
            *xs, rel_bias=bias, initial_state=_or_zeros(state, B, S, E, C, acc, q_quad.device), **kw
        )
    elif mode == "recurrent":
        final = _or_zeros(state, B, S, E, C, acc, q_quad.device)
        outs = []
        for t in range(T):
            o_t, final = mixed_chunk_step(
                *(x[:, t] for x in xs), final, quad_scale=quad_scale, lin_scale=lin_scale, rel_bias=bias
            )
            outs.append(o_t)
        o = torch.stack(outs, dim=1) if outs else xs[-1].new_zeros(B, 0, E)
    elif mode == "parallel":
        o, final = parallel_mixed_attention(*xs, rel_bias=bias, initial_state=state, **kw)
    elif _use_kernel(q_quad, C, initial_state, output_final_state, backend):
        from edgeattn.kernels import mixed_chunk_attention_triton

        ins = tuple(x.to(q_quad.dtype) for x in (q_quad, k_quad, q_lin, k_lin, v))
        o = mixed_chunk_attention_triton(*ins, rel_bias=bias, **kw)
        return o, None
    else:
        o, final = chunk_mixed_attention(*xs, rel_bias=bias, initial_state=state, **kw)
    return o.to(out_dtype), (final if output_final_state else None)


def _use_kernel(q, C, initial_state, output_final_state, backend) -> bool:
    if resolve_backend(q.device.type, backend) != "triton":
        return False  # before the import below: edgeattn.kernels needs triton
    from edgeattn.kernels.flash import covers

    S = q.shape[-1]
    uncovered = {
        "an initial state": initial_state is not None,
        "output_final_state=True": output_final_state,
        f"{q.dtype} inputs": q.dtype not in (torch.float32, torch.bfloat16, torch.float16),
        f"chunk_size = {C} with S = {S} (tiles too large)": not covers(C, S),
    }
    return use_kernel(q.device.type, backend, uncovered, "FLASH kernels")


def _or_zeros(state, B, S, E, C, dtype, device) -> FlashState:
    return zero_state(B, S, E, C, dtype, device) if state is None else state
