"""Causal softmax attention, the baseline: full (growing KV cache) or sliding window with sinks.

    o_t = sum_{i in A(t)} softmax_i(scale * q_t . k_i) v_i
    A(t) = {i <= t}  or, with window W and sinks S,  {t - W < i <= t} | {i < S, i <= t}

Four forms (naive loop, recurrent loop of the exported step, blockwise chunk, dense parallel) and
``mode="auto"`` (the layers' call: the step for one token, the chunk form otherwise, chosen in
``edgeattn.ops.backend``); the formulas and the state layouts are in README.md.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form
from edgeattn.ops.softmax.chunk import chunk_softmax, chunk_window, parallel_softmax, parallel_window
from edgeattn.ops.softmax.naive import naive_softmax_attention
from edgeattn.ops.softmax.step import KVCache, WindowCache, softmax_step, window_step
from edgeattn.ops.utils import MODES, check_dims, check_mode, check_rank, tracing

torch = require("torch")
Tensor = torch.Tensor

__all__ = ["softmax_attention", "softmax_step", "window_step", "KVCache", "WindowCache"]


def _check_window(window, sink) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None (full attention) or an int >= 1, got {window!r}")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"sink must be an int >= 0, got {sink!r}")
    if window is None and sink:
        raise ValueError(f"sink={sink} needs a window: full attention already attends to every token")


def _check_initial_state(state, B, H, K, V, window, sink):
    """The initial state as a KVCache / WindowCache (checked, not converted), or None."""
    if state is None:
        return None
    W, S = window, sink
    if window is None:
        kind, fields = "a KV cache (key [B, H, L, K], value [B, H, L, V])", KVCache._fields
    else:
        kind = (
            "a window cache (key [B, H, W, K], value [B, H, W, V], sink_key [B, H, S, K], "
            "sink_value [B, H, S, V], position [B])"
        )
        fields = WindowCache._fields
    if not isinstance(state, tuple | list) or len(state) != len(fields):
        got = f"{len(state)} tensors" if isinstance(state, tuple | list) else type(state).__name__
        raise ValueError(f"initial_state must be {kind} when window={window!r}, got {got}")
    if window is None:
        key, value = state
        check_dims("initial_state.key", key, (B, H, None, K), "[B, H, L, K]")
        check_dims("initial_state.value", value, (B, H, key.shape[2], V), "[B, H, L, V] (L as key)")
        return KVCache(key, value)
    key, value, sink_key, sink_value, position = state
    check_dims("initial_state.key", key, (B, H, W, K), "[B, H, W, K]")
    check_dims("initial_state.value", value, (B, H, W, V), "[B, H, W, V]")
    check_dims("initial_state.sink_key", sink_key, (B, H, S, K), "[B, H, S, K]")
    check_dims("initial_state.sink_value", sink_value, (B, H, S, V), "[B, H, S, V]")
    check_dims("initial_state.position", position, (B,), "[B]")
    return WindowCache(*state)


def _check_position(state, window) -> None:
    """A window cache's position holds token counts (skipped while tracing: no value checks)."""
    if window is None or tracing():
        return
    position = state.position
    if not torch.isfinite(position).all() or (position < 0).any() or (position != position.round()).any():
        raise ValueError(
            f"initial_state.position must hold token counts (integers >= 0), got {position.tolist()}"
        )


def _zero_state(B, H, K, V, window, sink, dtype, device):
    """The start of a sequence: an empty KV cache, or a window cache of zeros."""
    if window is None:
        shapes = ((B, H, 0, K), (B, H, 0, V))
    else:
        shapes = ((B, H, window, K), (B, H, window, V), (B, H, sink, K), (B, H, sink, V), (B,))
    zeros = (torch.zeros(s, dtype=dtype, device=device) for s in shapes)
    return KVCache(*zeros) if window is None else WindowCache(*zeros)


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sink: int = 0,
    initial_state: KVCache | WindowCache | tuple | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
):
    """Causal softmax attention over ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``.

    ``scale`` defaults to ``K ** -0.5``. Without ``window`` every token attends to all tokens so far and
    the state is a ``KVCache(key [B, H, L, K], value [B, H, L, V])`` that grows by T. With ``window=W``
    token t attends to the tokens ``t - W < i <= t`` and to the first ``sink`` tokens, and the state is a
    fixed-size ``WindowCache(key [B, H, W, K], value [B, H, W, V], sink_key [B, H, S, K],
    sink_value [B, H, S, V], position [B])``. Any tuple of the same tensors is accepted as
    ``initial_state``; None starts the sequence. States are float32 (float64 for float64 inputs).

    Returns ``(o [B, T, H, V] in q's dtype, final_state or None)``. ``mode``: "naive", "recurrent" (a
    loop of ``softmax_step`` / ``window_step``), "chunk", "parallel" or "auto": the step for T == 1,
    "chunk" otherwise (``edgeattn.ops.backend.choose_form``; the step checks the state's shapes, not its
    position's values).
    """
    check_mode(mode, ("auto", *MODES))
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_rank("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    V = v.shape[-1]
    _check_window(window, sink)
    # Compute in float32 (float64 inputs stay float64, for references).
    acc = torch.promote_types(q.dtype, torch.float32)
    state0 = _check_initial_state(initial_state, B, H, K, V, window, sink)
    mode = choose_form(mode, T, "softmax_attention")
    if mode == "step":
        # Before any conversion below: the step traces exactly the ops of the exported step graph, its
        # default scale a number (int(K): while tracing K is a traced size, whose power adds a Pow node).
        state = state0 if state0 is not None else _zero_state(B, H, K, V, window, sink, acc, q.device)
        step = softmax_step if window is None else window_step
        o, *state = step(q[:, 0], k[:, 0], v[:, 0], *state, scale=int(K) ** -0.5 if scale is None else scale)
        o = o.unsqueeze(1)
        return (o if o.dtype == q.dtype else o.to(q.dtype)), _final(state, window, output_final_state)
    if state0 is not None:
        _check_position(state0, window)
        state0 = type(state0)(*(x.to(acc) for x in state0))
    if scale is None:
        scale = K**-0.5
    out_dtype = q.dtype
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    if window is not None and state0 is None:
        state0 = _zero_state(B, H, K, V, window, sink, acc, q.device)

    if T == 0:
        mode = "recurrent"  # no tokens: the state passes through unchanged
    if mode == "naive":
        o, state = naive_softmax_attention(
            q, k, v, scale=scale, window=window, sink=sink, initial_state=state0
        )
    elif mode == "recurrent":
        state = state0 if state0 is not None else _zero_state(B, H, K, V, window, sink, acc, q.device)
        step = softmax_step if window is None else window_step
        outs = []
        for t in range(T):
            o_t, *state = step(q[:, t], k[:, t], v[:, t], *state, scale=scale)
            outs.append(o_t)
        o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    elif window is None:
        full = chunk_softmax if mode == "chunk" else parallel_softmax
        o, *state = full(q, k, v, *(state0 if state0 is not None else (None, None)), scale=scale)
    else:
        windowed = chunk_window if mode == "chunk" else parallel_window
        o, state = windowed(q, k, v, *state0, scale=scale, window=window, sink=sink)

    return o.to(out_dtype), _final(state, window, output_final_state)


def _final(state, window, output_final_state: bool):
    if not output_final_state:
        return None
    return KVCache(*state) if window is None else WindowCache(*state)
