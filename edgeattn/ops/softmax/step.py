"""One token of causal softmax attention: the functions the exported step graphs are made of.

- ``softmax_step``: the growing KV cache. It concatenates, so its state length is dynamic by design.
- ``window_step``: sliding window + sinks over fixed-size buffers. Pure tensor code: no in-place
  updates, no branches on tensor values, no data-dependent shapes, no int64 arithmetic. The buffer
  shifts by one slot per token, sinks are written through a one-hot mask of the float position, and
  slots that hold no token yet are masked from the position.

``window_mask`` and ``write_sinks`` are shared with the chunk and parallel forms (``chunk.py``), so
the window rule is written once for every fast form; ``naive.py`` writes it again from the formula.
"""

from __future__ import annotations

from typing import NamedTuple

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor


class KVCache(NamedTuple):
    """State of full causal attention: every token so far, ``L`` of them."""

    key: Tensor  # [B, H, L, K]
    value: Tensor  # [B, H, L, V]


class WindowCache(NamedTuple):
    """State of sliding-window attention with sinks; shapes fixed by ``window`` W and ``sink`` S.

    ``key[:, :, j]`` holds token ``position - W + j`` (oldest first; slots before the first token keep
    their initial zeros), ``sink_key[:, :, s]`` token ``s`` once it has been seen (``s < position``).
    """

    key: Tensor  # [B, H, W, K]
    value: Tensor  # [B, H, W, V]
    sink_key: Tensor  # [B, H, S, K]
    sink_value: Tensor  # [B, H, S, V]
    position: Tensor  # [B] float32: tokens seen so far (exact up to 2 ** 24)


def window_mask(q_pos: Tensor, k_pos: Tensor, *, window: int, sink: int) -> Tensor:
    """Which keys the queries attend to; positions are float token indices.

    q_pos: [..., Tq] query positions, k_pos: [..., Lk] positions of the buffered and new keys.
    Returns bool [..., Tq, S + Lk]: first the S sink slots (sink ``s`` is attended once seen, ``s <= t``),
    then the keys, attended when ``t - W < i <= t``. Keys ``i < S`` are attended from the sink slots,
    never twice: their copies in the window part are masked.
    """
    t = q_pos.unsqueeze(-1)  # [..., Tq, 1]
    i = k_pos.unsqueeze(-2)  # [..., 1, Lk]
    local = (i <= t) & (i > t - window) & (i >= sink)  # i >= sink also masks unfilled slots (i < 0)
    if sink == 0:
        return local
    s = torch.arange(sink, dtype=q_pos.dtype, device=q_pos.device)
    return torch.cat([(s <= t).expand(*local.shape[:-1], sink), local], dim=-1)


def write_sinks(sink_key, sink_value, k, v, position):
    """Write the new tokens that are among the first S into the sink slots.

    sink_key: [B, H, S, K], sink_value: [B, H, S, V], k: [B, H, T, K], v: [B, H, T, V] (tokens
    ``position + t``), position: [B]. Slots that receive no token keep their content. One-hot matrix
    products instead of indexing: no int64 and no data-dependent shapes in exported graphs.
    """
    S, T = sink_key.shape[2], k.shape[2]
    s = torch.arange(S, dtype=position.dtype, device=position.device)
    t = torch.arange(T, dtype=position.dtype, device=position.device)
    hit = ((position[:, None, None] + t[None, None, :]) == s[None, :, None]).to(k.dtype)  # [B, S, T]
    keep = (1.0 - hit.sum(-1))[:, None, :, None]  # [B, 1, S, 1]: 1 where no new token lands
    hit = hit.unsqueeze(1)  # [B, 1, S, T]
    return sink_key * keep + hit @ k, sink_value * keep + hit @ v


def attend(q: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(scale * q key^T, masked) value. q: [..., Tq, K], key: [..., L, K], mask: bool [..., Tq, L]
    (every row keeps at least one key, so -inf never fills a whole row)."""
    scores = (q @ key.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ value


def softmax_step(q: Tensor, k: Tensor, v: Tensor, key: Tensor, value: Tensor, *, scale: float):
    """q, k: [B, H, K], v: [B, H, V]; key: [B, H, L, K], value: [B, H, L, V] (the cache, float32).

    Returns (o [B, H, V], key [B, H, L + 1, K], value [B, H, L + 1, V]).
    """
    dt = torch.promote_types(key.dtype, torch.float32)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    key = torch.cat([key.to(dt), k.unsqueeze(2)], dim=2)
    value = torch.cat([value.to(dt), v.unsqueeze(2)], dim=2)
    o = attend(q.unsqueeze(2), key, value, None, scale)  # [B, H, 1, V]
    return o.squeeze(2), key, value


def window_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key: Tensor,
    value: Tensor,
    sink_key: Tensor,
    sink_value: Tensor,
    position: Tensor,
    *,
    scale: float,
):
    """q, k: [B, H, K], v: [B, H, V]; the state as in ``WindowCache`` (W = key.shape[2],
    S = sink_key.shape[2], both may be read from shapes since they are fixed).

    Returns (o [B, H, V], key, value, sink_key, sink_value, position + 1), the state in float32.
    """
    W, S = key.shape[2], sink_key.shape[2]
    dt = torch.promote_types(key.dtype, torch.float32)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    p = position.to(dt)  # [B], the index of this token
    # Shift the window by one slot: slot j now holds token p - W + 1 + j.
    key = torch.cat([key.to(dt)[:, :, 1:], k.unsqueeze(2)], dim=2)
    value = torch.cat([value.to(dt)[:, :, 1:], v.unsqueeze(2)], dim=2)
    slots = p[:, None] + torch.arange(1 - W, 1, dtype=dt, device=p.device)  # [B, W]
    mask = window_mask(p[:, None], slots, window=W, sink=S)  # [B, 1, S + W]
    keys, values = key, value
    if S > 0:
        sink_key, sink_value = write_sinks(
            sink_key.to(dt), sink_value.to(dt), k[:, :, None], v[:, :, None], p
        )
        keys = torch.cat([sink_key, key], dim=2)
        values = torch.cat([sink_value, value], dim=2)
    o = attend(q.unsqueeze(2), keys, values, mask.unsqueeze(1), scale)  # [B, H, 1, V]
    return o.squeeze(2), key, value, sink_key.to(dt), sink_value.to(dt), p + 1.0
