"""Parallel forms of causal softmax attention, for training and prefill.

- ``chunk_*``: the fast forms. Full attention is one ``F.scaled_dot_product_attention`` call over the
  cache and the new tokens (``is_causal`` when there is no cache, else an explicit mask). The window
  form is blockwise: queries in blocks of ``BLOCK`` tokens, each attending to the sinks and to the
  ``W + BLOCK`` buffered or new keys that can fall in its windows, so the cost is ``T * (W + BLOCK)``
  instead of ``T * T``.
- ``parallel_*``: one dense ``[T, L]`` masked score matrix written out in full; a reference for short
  sequences that shares no attention code with the chunk forms.

All take ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]`` in the compute dtype and return
``(o [B, T, H, V], new state tensors)``. Window positions are float tensors, so these forms export to
prefill graphs with no int64 arithmetic and no data-dependent shapes.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.softmax.step import attend, window_mask, write_sinks
from edgeattn.ops.utils import pad_time

torch = require("torch")
F = torch.nn.functional

BLOCK = 64  # query block of the windowed chunk form


def _causal_after(T: int, L: int, device):
    """bool [T, L + T]: new token t (position L + t) sees every cached token and new tokens <= t."""
    t = torch.arange(T, device=device) + L
    return torch.arange(L + T, device=device)[None, :] <= t[:, None]


def chunk_softmax(q, k, v, key, value, *, scale):
    """Full causal attention after an optional cache ``key: [B, H, L, K]``, ``value: [B, H, L, V]``
    (None: no cache). Returns (o, key [B, H, L + T, K], value [B, H, L + T, V])."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    if key is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o.transpose(1, 2), k, v
    L = key.shape[2]
    key, value = torch.cat([key, k], dim=2), torch.cat([value, v], dim=2)
    mask = _causal_after(q.shape[2], L, q.device)
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return o.transpose(1, 2), key, value


def parallel_softmax(q, k, v, key, value, *, scale):
    """Same as ``chunk_softmax``, as one dense masked score matrix."""
    B, T, H, K = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    if key is None:
        key, value = k.new_zeros(B, H, 0, K), v.new_zeros(B, H, 0, v.shape[-1])
    L = key.shape[2]
    key, value = torch.cat([key, k], dim=2), torch.cat([value, v], dim=2)
    o = attend(q, key, value, _causal_after(T, L, q.device), scale)
    return o.transpose(1, 2), key, value


def _window_context(k, v, key, value, sink_key, sink_value, position):
    """The new state, and the keys every form attends to: ``[window buffer (W), new tokens (T)]``
    (entry m is token ``p - W + m``) and the updated sinks."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
    sink_key, sink_value = write_sinks(sink_key, sink_value, kt, vt, position)
    k_all = torch.cat([key, kt], dim=2)  # [B, H, W + T, K]
    v_all = torch.cat([value, vt], dim=2)
    T = k.shape[1]
    state = (k_all[:, :, T:], v_all[:, :, T:], sink_key, sink_value, position + T)
    return k_all, v_all, state


def chunk_window(q, k, v, key, value, sink_key, sink_value, position, *, scale, window, sink):
    """Sliding-window attention with sinks, blockwise. State tensors as in ``WindowCache``.
    Returns (o, (key, value, sink_key, sink_value, position))."""
    B, T, H, K = q.shape
    V, W, S = v.shape[-1], window, sink
    k_all, v_all, state = _window_context(k, v, key, value, sink_key, sink_value, position)
    sink_key, sink_value = state[2], state[3]
    C = min(BLOCK, T)
    N = -(-T // C)
    # Padded queries and keys sit after every real token: causality hides them from real queries.
    q = pad_time(q, C).reshape(B, N, C, H, K).transpose(2, 3)  # [B, N, H, C, K]
    if N * C > T:
        k_all, v_all = (F.pad(x, (0, 0, 0, N * C - T)) for x in (k_all, v_all))  # [B, H, W + N*C, D]
    if N == 1:
        k_blk, v_blk = k_all.unsqueeze(1), v_all.unsqueeze(1)  # [B, 1, H, W + C, D]
    else:
        # Block n (tokens nC .. nC+C-1) needs the keys at positions nC - W .. nC + C - 1: a window of
        # W + C over [buffer, new], advancing by C.
        k_blk = k_all.unfold(2, W + C, C).permute(0, 2, 1, 4, 3)  # [B, N, H, W + C, K]
        v_blk = v_all.unfold(2, W + C, C).permute(0, 2, 1, 4, 3)
    if S > 0:
        k_blk = torch.cat([sink_key.unsqueeze(1).expand(B, N, H, S, K), k_blk], dim=3)
        v_blk = torch.cat([sink_value.unsqueeze(1).expand(B, N, H, S, V), v_blk], dim=3)
    dt, dev = position.dtype, position.device
    start = position[:, None, None] + C * torch.arange(N, dtype=dt, device=dev)[None, :, None]  # [B, N, 1]
    q_pos = start + torch.arange(C, dtype=dt, device=dev)  # [B, N, C]
    k_pos = start - W + torch.arange(W + C, dtype=dt, device=dev)  # [B, N, W + C]
    mask = window_mask(q_pos, k_pos, window=W, sink=S).unsqueeze(2)  # [B, N, 1, C, S + W + C]
    L = k_blk.shape[3]
    o = F.scaled_dot_product_attention(
        q.reshape(B * N, H, C, K),
        k_blk.reshape(B * N, H, L, K),
        v_blk.reshape(B * N, H, L, V),
        attn_mask=mask.reshape(B * N, 1, C, L),
        scale=scale,
    )
    o = o.reshape(B, N, H, C, V).transpose(2, 3).reshape(B, N * C, H, V)[:, :T]
    return o, state


def parallel_window(q, k, v, key, value, sink_key, sink_value, position, *, scale, window, sink):
    """Same as ``chunk_window``, as one dense ``[T, S + W + T]`` masked score matrix."""
    T = q.shape[1]
    W = key.shape[2]
    k_all, v_all, state = _window_context(k, v, key, value, sink_key, sink_value, position)
    keys = torch.cat([state[2], k_all], dim=2)  # [B, H, S + W + T, K]
    values = torch.cat([state[3], v_all], dim=2)
    dt, dev = position.dtype, position.device
    q_pos = position[:, None] + torch.arange(T, dtype=dt, device=dev)  # [B, T]
    k_pos = position[:, None] - W + torch.arange(W + T, dtype=dt, device=dev)  # [B, W + T]
    mask = window_mask(q_pos, k_pos, window=window, sink=sink).unsqueeze(1)  # [B, 1, T, S + W + T]
    o = attend(q.transpose(1, 2), keys, values, mask, scale)
    return o.transpose(1, 2), state
