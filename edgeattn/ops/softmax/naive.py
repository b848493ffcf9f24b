"""Ground truth: causal softmax attention as an explicit per-token loop, straight from the formula.

    o_t = sum_{i in A(t)} softmax_i(scale * q_t . k_i) v_i
    A(t) = {i : i <= t}                                   (full)
    A(t) = {i : t - W < i <= t} | {i : i < S, i <= t}     (window W, sinks S)

Token indices count from the start of the sequence, including the tokens held by ``initial_state``.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")


def _attend_rows(q, keys, values, rows, scale):
    """Each row t of ``q [T, H, K]`` attends to the history tokens ``rows[t]`` (index into ``keys``)."""
    outs = []
    for q_t, sel in zip(q.unbind(0), rows):
        kk, vv = keys[:, sel], values[:, sel]  # [H, n, K], [H, n, V]
        p = torch.softmax(scale * (q_t.unsqueeze(1) @ kk.transpose(1, 2)), dim=-1)  # [H, 1, n]
        outs.append((p @ vv).squeeze(1))  # [H, V]
    return torch.stack(outs)


def _rows(index, first, T, window, sink):
    """For token ``first + t``: which history entries (global token indices ``index``) it attends to."""
    rows = []
    for t in range(T):
        pos = first + t
        if window is None:
            allowed = index <= pos
        else:
            allowed = (index <= pos) & ((index > pos - window) | (index < sink))
        rows.append(allowed.nonzero().squeeze(-1))
    return rows


def naive_softmax_attention(q, k, v, *, scale, window, sink, initial_state):
    """q, k: [B, T, H, K], v: [B, T, H, V]. ``initial_state`` is None, ``(key, value)`` (full) or
    ``(key, value, sink_key, sink_value, position)`` (window), as in ``step.KVCache`` / ``WindowCache``.
    Returns (o, state as a plain tuple of the same kind)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if window is None:
        L = 0 if initial_state is None else initial_state[0].shape[2]
        key = torch.cat([q.new_zeros(B, H, 0, K) if L == 0 else initial_state[0], k.transpose(1, 2)], 2)
        value = torch.cat([v.new_zeros(B, H, 0, V) if L == 0 else initial_state[1], v.transpose(1, 2)], 2)
        index = torch.arange(L + T)  # the cache holds tokens 0 .. L-1
        rows = _rows(index, L, T, None, 0)
        o = torch.stack([_attend_rows(q[b], key[b], value[b], rows, scale) for b in range(B)])
        return o, (key, value)

    W, S = window, sink
    if initial_state is None:
        initial_state = (
            q.new_zeros(B, H, W, K),
            v.new_zeros(B, H, W, V),
            q.new_zeros(B, H, S, K),
            v.new_zeros(B, H, S, V),
            q.new_zeros(B),
        )
    key0, value0, sink_key0, sink_value0, position0 = initial_state
    outs, keys, values, sink_keys, sink_values = [], [], [], [], []
    for b in range(B):  # sequences may be at different positions
        p0 = int(position0[b])
        p1 = p0 + T
        kt, vt = k[b].transpose(0, 1), v[b].transpose(0, 1)  # [H, T, D]: tokens p0 .. p1-1
        # History the queries may attend to: the sinks seen before p0; the buffered tokens (slot j holds
        # token p0 - W + j) that are not sinks (a sink is attended once, from its sink slot); the new tokens.
        n_sink = min(S, p0)
        j0 = min(max(0, S - (p0 - W)), W)  # first buffer slot whose token is >= S
        index = torch.cat([torch.arange(n_sink), torch.arange(p0 - W + j0, p0), torch.arange(p0, p1)])
        hk = torch.cat([sink_key0[b, :, :n_sink], key0[b, :, j0:], kt], 1)  # [H, n, K]
        hv = torch.cat([sink_value0[b, :, :n_sink], value0[b, :, j0:], vt], 1)
        outs.append(_attend_rows(q[b], hk, hv, _rows(index, p0, T, W, S), scale))

        # New state. Window slot j holds token p1 - W + j: the old slots shifted left by T (unfilled ones
        # move along), then the new tokens. Sink slot s holds token s once written: new tokens p0 .. p1-1
        # land in slots p0 .. min(S, p1)-1, the other slots keep their content.
        keys.append(torch.cat([key0[b], kt], 1)[:, T:])
        values.append(torch.cat([value0[b], vt], 1)[:, T:])
        lo, hi = min(p0, S), min(p1, S)
        sink_keys.append(torch.cat([sink_key0[b, :, :lo], kt[:, : hi - lo], sink_key0[b, :, hi:]], 1))
        sink_values.append(torch.cat([sink_value0[b, :, :lo], vt[:, : hi - lo], sink_value0[b, :, hi:]], 1))
    state = (
        torch.stack(keys),
        torch.stack(values),
        torch.stack(sink_keys),
        torch.stack(sink_values),
        position0 + T,
    )
    return torch.stack(outs), state
