"""One token of AFT: the function the exported step graph is made of.

Pure tensor code: no in-place updates, no branches on tensor values (only on W, a shape), no int64
arithmetic, shapes fixed by the inputs. The state (float32; see README.md):

    numerator, denominator: [B, D]   the tokens at distance >= W ("the old part"), as
                                     sum exp(a_i - m) v_i and sum exp(a_i - m), a_i = k_i + (t - i) * decay
    max, max_age: [B, D]             the key k_j of the heaviest of them and its distance t - j:
                                     m = max + max_age * decay, recomputed each token, never accumulated
    key, value: [B, W, D]            the last W tokens, oldest first (a shift buffer)
    position: [B]                    filled slots of the buffer, min(tokens seen, W)

With W = 0 (no window bias) the state is only the first four. A denominator of 0 means an empty old
part (its max and max_age are then ignored), so the all-zeros state is the start of a sequence.
"""

from __future__ import annotations

from edgeattn._deps import require

torch = require("torch")
Tensor = torch.Tensor

# A log weight for "no token": exp(NEG - m) is 0 for any finite m, and NEG + a finite number is NEG.
NEG = -1e30
# float32 counts exactly up to 2^24: a maximum older than this is rebased (max_age folded into max).
MAX_AGE = float(2**22)


def merge(old, new, decay, steps):
    """The union of two disjoint token sets, each (numerator, denominator, max, max_age) [B, D] as in
    the state: ``new`` at the current token (its parts may broadcast, its max_age may be a number),
    ``old`` ``steps`` tokens behind it (a number). A part with denominator 0 is empty. Returns the union
    at the current token.

    Only the lighter part is rescaled, by exp(-|diff|) <= 1 where diff is the log weight of new's
    heaviest token minus old's: while one token stays the heaviest, the other tokens are added to the
    sums and nothing is multiplied, so no rounding piles up. diff is taken as a difference of keys plus a
    difference of distances times the decay, exact even where the log weights themselves are large.
    """
    num, den, mx, age = old
    num2, den2, mx2, age2 = new
    age = age + steps
    diff = (mx2 - mx) + (age2 - age) * decay
    diff = torch.where(den > 0, diff, -NEG)  # an empty old part: take the new one
    diff = torch.where(den2 > 0, diff, NEG)  # an empty new part: keep the old one
    take = diff > 0  # the new part holds the heaviest token
    e = torch.exp(-torch.abs(diff))
    num = torch.where(take, num * e + num2, num + num2 * e)
    den = torch.where(take, den * e + den2, den + den2 * e)
    mx = torch.where(take, mx2, mx)
    age = torch.where(take, age2, age)
    rebase = age > MAX_AGE
    return num, den, torch.where(rebase, mx + age * decay, mx), torch.where(rebase, 0.0, age)


def old_log_max(state, decay, ahead=0.0):
    """The old part's largest log weight ``ahead`` tokens after the state's last token; NEG if empty."""
    num, den, mx, age = state[:4]
    return torch.where(den > 0, mx + (age + ahead) * decay, NEG)


def canonical(state):
    """An empty old part as zeros, so that equal token sets give equal states."""
    num, den, mx, age = state[:4]
    return (num, den, torch.where(den > 0, mx, 0.0), torch.where(den > 0, age, 0.0), *state[4:])


def aft_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    window_bias: Tensor | None,
    state: tuple[Tensor, ...],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """q, k, v: [B, D], decay: [D] (<= 0), window_bias: [W, D] or None (W = 0), state: the 4-tuple
    (numerator, denominator, max, max_age) for W = 0, else the 7-tuple adding (key, value, position).

    Returns (o [B, D] in the state's precision, new state).
    """
    dt = torch.promote_types(state[0].dtype, torch.float32)
    q, k, v, decay = q.to(dt), k.to(dt), v.to(dt), decay.to(dt)
    old = state[:4]
    if window_bias is None or window_bias.shape[0] == 0:
        # The token itself is at distance 0 >= W: it joins the old part at once, which is all there is.
        num, den, mx, age = merge(old, (v, torch.ones_like(k), k, 0.0), decay, 1)
        return torch.sigmoid(q) * num / den, canonical((num, den, mx, age))

    key, value, pos = state[4:]
    W = key.shape[1]
    keys = torch.cat([key, k.unsqueeze(1)], dim=1)  # [B, W + 1, D], distances W..0
    values = torch.cat([value, v.unsqueeze(1)], dim=1)
    dist = torch.arange(W, -1, -1, dtype=dt, device=k.device)  # [W + 1]
    # Slot j holds a token iff its distance <= position (integers held in floats: compare with a margin).
    valid = dist.unsqueeze(0) < pos.to(dt).unsqueeze(1) + 0.5  # [B, W + 1]

    # The oldest slot reaches distance W: it leaves the window for the old part.
    full = valid[:, :1]  # [B, 1]: the buffer was full
    leaving = (torch.where(full, values[:, 0], 0.0), full.to(dt), keys[:, 0], float(W))
    old = merge(old, leaving, decay, 1)

    # The window (distances W-1..0, newest last) and the old part, under one shared maximum.
    L = keys[:, 1:] + window_bias.to(dt).flip(0)  # [B, W, D]
    L = torch.where(valid[:, 1:, None], L, NEG)
    m_old = old_log_max(old, decay)
    M = torch.maximum(L.amax(1), m_old).detach()  # a shift only: the output does not depend on it
    e = torch.exp(L - M.unsqueeze(1))
    e_old = torch.exp(m_old - M)
    num = (e * values[:, 1:]).sum(1) + e_old * old[0]
    den = e.sum(1) + e_old * old[1]
    o = torch.sigmoid(q) * num / den
    return o, (*canonical(old), keys[:, 1:], values[:, 1:], torch.clamp(pos + 1.0, max=float(W)))
