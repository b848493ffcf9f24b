"""Attention-Free Transformer (Zhai et al. 2021): a weighted average of values per channel.

    o_t = sigmoid(q_t) * sum_{i<=t} exp(k_i + w_{t,i}) v_i / sum_{i<=t} exp(k_i + w_{t,i})

``aft``: w_{t,i} = window_bias[t-i] for t-i < W, else (t-i) * decay (AFT-simple with a learned decay,
and AFT-local when a window bias is given). Four forms (naive loop, recurrent loop of the exported step,
chunkwise, fully parallel), ``mode="auto"`` (the layers' call: the step for one token, the chunk form
otherwise, chosen in ``edgeattn.ops.backend``) and a fixed-size state. ``aft_full``: learned pairwise
w[t, i], parallel only. See README.md for the state and the stabilisation.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.aft.chunk import chunk_aft, parallel_aft, parallel_aft_full
from edgeattn.ops.aft.naive import naive_aft, naive_aft_full
from edgeattn.ops.aft.step import aft_step
from edgeattn.ops.backend import choose_form, use_kernel
from edgeattn.ops.utils import MODES, check_chunk_size, check_dims, check_log_gate, check_mode, check_rank

torch = require("torch")
Tensor = torch.Tensor

__all__ = ["STATE_NAMES", "aft", "aft_full", "aft_state_names", "aft_step"]

# The recurrent state, in tuple order; the last three exist only with a window bias (W > 0).
STATE_NAMES = ("numerator", "denominator", "max", "max_age", "key", "value", "position")


def aft_state_names(window: int) -> tuple[str, ...]:
    """Names of the state tensors for a window of ``window`` tokens (0: no window bias)."""
    return STATE_NAMES if window else STATE_NAMES[:4]


def _state_layouts(B: int, W: int, D: int):
    shapes = [(B, D)] * 4 + [(B, W, D)] * 2 + [(B,)]
    layouts = ["[B, D]"] * 4 + ["[B, W, D]"] * 2 + ["[B]"]
    n = len(aft_state_names(W))
    return shapes[:n], layouts[:n]


def _check_initial_state(initial_state, B: int, W: int, D: int) -> tuple[Tensor, ...]:
    """The state's tensors as given (checked, not converted)."""
    names = aft_state_names(W)
    shapes, layouts = _state_layouts(B, W, D)
    if not isinstance(initial_state, tuple | list) or len(initial_state) != len(names):
        got = len(initial_state) if isinstance(initial_state, tuple | list) else type(initial_state).__name__
        raise ValueError(
            f"initial_state must be a tuple of {len(names)} tensors ({', '.join(names)}) for a window of "
            f"W = {W} tokens, got {got}"
        )
    for i, (s, name, shape, layout) in enumerate(zip(initial_state, names, shapes, layouts)):
        check_dims(f"initial_state[{i}] ({name})", s, shape, layout)
    return tuple(initial_state)


def _zero_state(B: int, W: int, D: int, dtype, device) -> tuple[Tensor, ...]:
    shapes, _ = _state_layouts(B, W, D)
    return tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes)


def _check_qkv(q, k, v):
    check_rank("q", q, 3, "[B, T, D]")
    check_dims("k", k, tuple(q.shape), "[B, T, D] (as q)")
    check_dims("v", v, tuple(q.shape), "[B, T, D] (as q)")


def aft(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    decay: Tensor | None = None,
    window_bias: Tensor | None = None,
    initial_state: tuple[Tensor, ...] | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    backend: str | None = None,
):
    """AFT over ``q, k, v: [B, T, D]``, channel by channel.

    ``decay`` is a log-space decay per channel, ``[D]`` and <= 0 (None means 0: no decay).
    ``window_bias`` (``[W]`` shared by the channels, or ``[W, D]``) replaces ``(t-i) * decay`` for the
    last ``W`` tokens, the token itself included; None means W = 0.

    The state is a tuple of tensors (see ``STATE_NAMES`` and README.md): ``(numerator, denominator,
    max, max_age)`` ``[B, D]`` for the tokens at distance >= W (their weighted sums under the heaviest
    of them, its key and its distance), plus for W > 0 the last W ``key`` and ``value`` ``[B, W, D]``
    (oldest first) and ``position`` ``[B]`` (filled slots, min(tokens seen, W)). All zeros starts a
    sequence. States are float32 (float64 for float64 inputs).

    Returns ``(o [B, T, D] in q's dtype, final_state or None)``. ``mode``: "naive", "recurrent" (a loop
    of ``aft_step``), "chunk", "parallel" or "auto": ``aft_step`` for T == 1, "chunk" otherwise
    (``edgeattn.ops.backend.choose_form``; the step checks the decay's shape but not its values).
    ``backend`` ("auto", "torch", "triton") picks the chunk implementation (``edgeattn.ops.backend``);
    the Triton kernels cover a zero initial state, no final state and float32/bfloat16/float16 inputs.
    """
    check_mode(mode, ("auto", *MODES))
    _check_qkv(q, k, v)
    B, T, D = q.shape
    check_chunk_size(chunk_size)
    # Accumulate in float32 (float64 inputs stay float64, for references).
    acc = torch.promote_types(q.dtype, torch.float32)
    if decay is not None:
        check_dims("decay", decay, (D,), "[D]")
    if window_bias is not None and not (isinstance(window_bias, Tensor) and window_bias.dim() == 1):
        check_dims("window_bias", window_bias, (None, D), "[W] or [W, D]")
    W = 0 if window_bias is None else window_bias.shape[0]
    if initial_state is None:
        state = _zero_state(B, W, D, acc, q.device)
    else:
        state = _check_initial_state(initial_state, B, W, D)
    mode = choose_form(mode, T, "aft")
    if mode == "step":
        # Before any conversion below: the step traces exactly the ops of the exported step graph (and
        # checks the decay's shape, not its values: no device sync per token).
        decay = q.new_zeros(D, dtype=acc) if decay is None else decay
        if window_bias is not None and window_bias.dim() == 1:
            window_bias = window_bias.unsqueeze(1).expand(-1, D)
        o, state = aft_step(q[:, 0], k[:, 0], v[:, 0], decay, window_bias, state)
        o = o.unsqueeze(1)
        return (o if o.dtype == q.dtype else o.to(q.dtype)), (state if output_final_state else None)
    if decay is None:
        decay = q.new_zeros(D, dtype=acc)
    else:
        check_log_gate("decay", decay)
        decay = decay.to(acc)
    if window_bias is None:
        wb = q.new_zeros(0, D, dtype=acc)
    elif window_bias.dim() == 1:
        wb = window_bias.to(acc).unsqueeze(1).expand(-1, D)
    else:
        wb = window_bias.to(acc)
    state = tuple(x.to(acc) for x in state)

    out_dtype = q.dtype
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if T == 0:
        o = qf
    elif mode == "naive":
        if not W:  # the naive loop always takes the buffers, here empty
            empty = q.new_zeros(B, 0, D, dtype=acc)
            state = (*state, empty, empty, q.new_zeros(B, dtype=acc))
        o, state = naive_aft(qf, kf, vf, decay, wb, state)
        state = state[: len(aft_state_names(W))]
    elif mode == "recurrent":
        outs = []
        for t in range(T):
            o_t, state = aft_step(qf[:, t], kf[:, t], vf[:, t], decay, wb if W else None, state)
            outs.append(o_t)
        o = torch.stack(outs, dim=1)
    elif mode == "parallel":
        o, state = parallel_aft(qf, kf, vf, decay, wb, state)
    elif _use_kernel(q, initial_state, output_final_state, backend):
        from edgeattn.kernels import aft_triton

        return aft_triton(q, k.to(q.dtype), v.to(q.dtype), decay.float(), window_bias=wb if W else None), None
    else:
        o, state = chunk_aft(qf, kf, vf, decay, wb, state, chunk_size=chunk_size)
    return o.to(out_dtype), (state if output_final_state else None)


def _use_kernel(q, initial_state, output_final_state, backend) -> bool:
    uncovered = {
        "an initial state": initial_state is not None,
        "output_final_state=True": output_final_state,
        f"{q.dtype} inputs": q.dtype not in (torch.float32, torch.bfloat16, torch.float16),
    }
    return use_kernel(q.device.type, backend, uncovered, "AFT kernel")


def aft_full(q: Tensor, k: Tensor, v: Tensor, w: Tensor, *, mode: str = "parallel"):
    """AFT-full over ``q, k, v: [B, T, D]`` with learned pairwise biases ``w: [T_max, T_max]``
    (T <= T_max): ``o_t = sigmoid(q_t) * sum_{i<=t} exp(k_i + w[t, i]) v_i / sum_{i<=t} exp(k_i + w[t, i])``.

    Only the parallel form (and the naive loop, as a reference): the bias of a pair depends on both
    positions, so there is no fixed-size state; use ``aft`` (a decay, optionally with a window bias) for
    recurrent inference. Returns ``(o in q's dtype, None)``.
    """
    check_mode(mode, ("naive", "parallel"))
    _check_qkv(q, k, v)
    T = q.shape[1]
    check_rank("w", w, 2, "[T_max, T_max]")
    if w.shape[0] != w.shape[1] or w.shape[0] < T:
        raise ValueError(
            f"w must have shape [T_max, T_max] with T_max >= T = {T}, got {tuple(w.shape)}; "
            "aft_full covers at most T_max tokens"
        )
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, wf = q.to(acc), k.to(acc), v.to(acc), w.to(acc)
    form = naive_aft_full if mode == "naive" else parallel_aft_full
    return form(qf, kf, vf, wf).to(q.dtype), None
