"""One token of FLASH mixed-chunk attention: the function the exported step graph is made of.

Pure tensor code: no in-place updates, no branches on tensor values, shapes fixed by the inputs, no
integer arithmetic. The token's slot in the chunk buffers is a one-hot mask built from the float
position. The token's ``k_lin^T v`` joins the running sum of its chunk (an ``S x E`` outer product),
and when the chunk fills that sum is folded into the linear state (and the chunk emptied) with a float
flag, so the fold costs ``S E`` per token, not the ``C S E`` of re-summing a buffered chunk.
"""

from __future__ import annotations

from typing import NamedTuple

from edgeattn._deps import require

torch = require("torch")
F = torch.nn.functional
Tensor = torch.Tensor


class FlashState(NamedTuple):
    """The recurrent state of mixed-chunk attention (float32; float64 for float64 references).

    Slot ``j`` of a buffer holds token ``j`` of the current chunk; slots at and after ``position`` are
    ignored on input and zero on output. ``chunk_state`` is taken as given on input (every form returns
    it zero at position 0) and joins ``linear_state`` when the current chunk fills. Every form accepts
    any position, mid-chunk included.
    """

    linear_state: Tensor  # [B, S, E]  sum of k_lin^T v over the finished chunks
    chunk_state: Tensor  # [B, S, E]  sum of k_lin^T v over the current chunk's tokens so far
    key_quad: Tensor  # [B, C, S]  the current chunk's quadratic keys
    value: Tensor  # [B, C, E]  the current chunk's values
    position: Tensor  # [B]  tokens already in the current chunk, an integer in [0, C) stored as float


def offset_bias(rel_bias: Tensor, offsets: Tensor) -> Tensor:
    """``rel_bias[offsets]`` for float ``offsets`` of any shape, as a one-hot product (no integer index).
    Offsets outside ``[0, C)`` get 0; callers mask those pairs anyway."""
    C = rel_bias.shape[0]
    d = torch.arange(C, dtype=offsets.dtype, device=offsets.device)
    return (offsets.unsqueeze(-1) == d).to(rel_bias.dtype) @ rel_bias


def zero_state(B: int, S: int, E: int, C: int, dtype=torch.float32, device=None) -> FlashState:
    """The state at the start of a sequence: nothing seen, position 0."""
    return FlashState(
        torch.zeros(B, S, E, dtype=dtype, device=device),
        torch.zeros(B, S, E, dtype=dtype, device=device),
        torch.zeros(B, C, S, dtype=dtype, device=device),
        torch.zeros(B, C, E, dtype=dtype, device=device),
        torch.zeros(B, dtype=dtype, device=device),
    )


def mixed_chunk_step(
    q_quad: Tensor,
    k_quad: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
    v: Tensor,
    state: FlashState,
    *,
    quad_scale: float,
    lin_scale: float,
    rel_bias: Tensor | None = None,
) -> tuple[Tensor, FlashState]:
    """q_*, k_*: [B, S], v: [B, E], ``state`` a FlashState (or a tuple in its order); C = buffer length.

    Returns (o [B, E] in the state's dtype, new state). The state is never modified in place.
    """
    lin, cur, kq_buf, v_buf, pos = state
    C = kq_buf.shape[1]
    dt = torch.promote_types(lin.dtype, torch.float32)
    q_quad, k_quad, q_lin, k_lin, v = (x.to(dt) for x in (q_quad, k_quad, q_lin, k_lin, v))
    lin, cur, kq_buf, v_buf, pos = (x.to(dt) for x in (lin, cur, kq_buf, v_buf, pos))

    slots = torch.arange(C, dtype=dt, device=lin.device)
    pos_c = pos.unsqueeze(-1)  # [B, 1]
    here = (slots == pos_c).to(dt)  # [B, C] one-hot: this token's slot
    before = (slots < pos_c).to(dt)  # [B, C] slots filled earlier in this chunk

    def write(buf, x):  # keep the earlier slots, put x in this token's slot, zero the rest
        return buf * before.unsqueeze(-1) + here.unsqueeze(-1) * x.unsqueeze(1)

    kq_buf, v_buf = write(kq_buf, k_quad), write(v_buf, v)

    scores = quad_scale * (kq_buf @ q_quad.unsqueeze(-1)).squeeze(-1)  # [B, C]
    if rel_bias is not None:
        scores = scores + offset_bias(rel_bias.to(dt), pos_c - slots)  # b_{t-j} for slot j
    w = F.relu(scores).square() * (before + here)  # causal: slots j <= position
    o = (w.unsqueeze(1) @ v_buf).squeeze(1) + lin_scale * (q_lin.unsqueeze(1) @ lin).squeeze(1)

    # The token joins its chunk's running sum; the last slot filled folds that sum into the linear
    # state and empties the chunk (buffers, sum, position).
    cur = cur + k_lin.unsqueeze(-1) * v.unsqueeze(-2)  # [B, S, E]
    full = (pos == C - 1).to(dt)  # [B]
    lin = lin + full.view(-1, 1, 1) * cur
    keep = (1.0 - full).view(-1, 1, 1)
    new_state = FlashState(lin, cur * keep, kq_buf * keep, v_buf * keep, (pos + 1.0) * (1.0 - full))
    return o, new_state
