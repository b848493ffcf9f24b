"""Reformer LSH attention (Kitaev et al. 2020): softmax restricted to the keys that hash to the query's bucket.

Angular LSH with ``n_buckets`` buckets (even, or 1): per round ``r`` a random rotation ``R_r: [K, n_buckets/2]``
and ``h_r(x) = argmax([x R_r, -x R_r])``. For round ``r`` the query at position ``i`` attends to

    P_r(i) = {j : h_r(q_i) = h_r(k_j),  j <= i (causal),  j != i (exclude_self),  chunk rule}
    chunk rule (bucket_size = C): tokens sorted by (bucket, position); with s_i the rank of query i and
        s'_j of key j, keep j when floor(s'_j / C) in {floor(s_i / C) - 1, floor(s_i / C)}
        (attention within the chunk and to the previous one); bucket_size = None keeps the whole bucket.

and to itself alone when ``P_r(i)`` is empty. ``o_r,i = softmax_{j in P_r(i)}(scale q_i . k_j) v_j`` with
its log-sum-exp ``l_r,i``; the rounds are averaged with weights ``softmax_r(l_r,i)``, i.e. the softmax
over the union of the rounds' keys (a key found by several rounds counts once per round; the paper's
duplicate correction is not applied).

Shared QK (the paper): ``k=None`` uses ``k_j = q_j / |q_j|`` and the queries' buckets for the keys, and
excludes self (``q_i . k_i`` would dominate). With a separate ``k`` queries and keys are hashed and
sorted separately.

Forms (``mode``), all computing the same pattern:
- ``naive``: a loop over query tokens building each ``P_r(i)`` from the definition.
- ``chunk``: the paper's algorithm, sort by bucket, chunks of C, each attending to itself and the
  previous chunk: O(T C) scores per round. With ``bucket_size=None`` it is the dense form.
- ``parallel``: one dense masked ``[T, L + T]`` score matrix per round.
- ``recurrent``: a loop of ``lsh_step`` (``bucket_size=None`` only): the new query attends to the cached
  keys of its own bucket, O(L (K + V)) per token and round, like a KV cache.
- ``auto`` (the layer's call): ``lsh_step`` for one token, ``chunk`` otherwise (chosen in
  ``edgeattn.ops.backend``).

The chunk rule depends on where later tokens sort, so the chunked pattern has no recurrent form and
no ``initial_state``; the whole-bucket pattern (``bucket_size=None``) continues exactly from a KV cache.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.backend import choose_form
from edgeattn.ops.softmax.step import KVCache
from edgeattn.ops.utils import MODES, check_dims, check_mode, check_rank

torch = require("torch")
F = torch.nn.functional
Tensor = torch.Tensor

__all__ = ["lsh_attention", "lsh_buckets", "lsh_rotations", "lsh_step"]


def lsh_rotations(K: int, n_buckets: int, n_rounds: int, generator=None, dtype=torch.float32) -> Tensor:
    """[n_rounds, K, n_buckets // 2] Gaussian random rotations (an empty last dim for one bucket)."""
    _check_buckets(n_buckets, n_rounds)
    r = torch.randn(n_rounds, K, n_buckets // 2, generator=generator, dtype=torch.float64)
    return r.to(dtype)


def _check_buckets(n_buckets, n_rounds) -> None:
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, int) or n_buckets < 1:
        raise ValueError(f"n_buckets must be an int >= 1, got {n_buckets!r}")
    if n_buckets > 1 and n_buckets % 2:
        raise ValueError(f"n_buckets must be 1 or even (angular LSH hashes to +-rotations), got {n_buckets}")
    if isinstance(n_rounds, bool) or not isinstance(n_rounds, int) or n_rounds < 1:
        raise ValueError(f"n_rounds must be an int >= 1, got {n_rounds!r}")


def lsh_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """Bucket of every vector per round: x [..., K], rotations [R, K, n_buckets / 2] -> int64 [..., R].

    Each vector is hashed on its own, so permuting the tokens permutes their buckets.
    """
    R, _, half = rotations.shape
    if half == 0:
        return torch.zeros(*x.shape[:-1], R, dtype=torch.long, device=x.device)
    rot = torch.einsum("...k,rkb->...rb", x, rotations.to(x.dtype))  # [..., R, n_buckets / 2]
    return torch.cat([rot, -rot], dim=-1).argmax(-1)


def _combine(o: Tensor, lse: Tensor) -> Tensor:
    """Rounds on dim 2: o [B, H, R, T, V], lse [B, H, R, T] -> [B, H, T, V] weighted by softmax_r(lse)."""
    w = torch.softmax(lse, dim=2).unsqueeze(-1)
    return (w * o).sum(2)


def _ranks(buckets: Tensor) -> Tensor:
    """Rank of each token when sorted by (bucket, position): buckets [..., T] -> int64 [..., T]."""
    T = buckets.shape[-1]
    key = buckets * T + torch.arange(T, device=buckets.device)
    return key.argsort(-1).argsort(-1)


def _pattern(bq, bk, qpos, kpos, *, causal, exclude_self, chunk_q=None, chunk_k=None):
    """bool [B, H, R, Tq, Lk]: the keys each query may attend to, self added where the set is empty.

    bq: [B, H, R, Tq], bk: [B, H, R, Lk] buckets; qpos [Tq], kpos [Lk] positions; chunk_*: chunk index
    in sorted order (or None for the whole bucket)."""
    allowed = bq.unsqueeze(-1) == bk.unsqueeze(-2)
    if causal:
        allowed = allowed & (kpos[None, :] <= qpos[:, None])
    if chunk_q is not None:
        d = chunk_q.unsqueeze(-1) - chunk_k.unsqueeze(-2)
        allowed = allowed & ((d == 0) | (d == 1))
    is_self = kpos[None, :] == qpos[:, None]
    if exclude_self:
        allowed = allowed & ~is_self
    alone = ~allowed.any(-1, keepdim=True)
    return allowed | (is_self & alone)


def _dense(q, k, v, bq, bk, qpos, kpos, *, scale, causal, exclude_self, chunk_q=None, chunk_k=None):
    """q [B, H, T, K], k [B, H, L, K], v [B, H, L, V] -> o [B, H, T, V], one masked matrix per round."""
    mask = _pattern(
        bq, bk, qpos, kpos, causal=causal, exclude_self=exclude_self, chunk_q=chunk_q, chunk_k=chunk_k
    )
    scores = (scale * q @ k.transpose(-1, -2)).unsqueeze(2)  # [B, H, 1, T, L]
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, H, R, T, L]
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, R, T]
    o = torch.exp(scores - lse.unsqueeze(-1)) @ v.unsqueeze(2)  # [B, H, R, T, V]
    return _combine(o, lse)


def _naive(q, key, value, bq, bk, *, scale, causal, exclude_self, C):
    """Per query token: build P_r(i) from the definition, softmax over it, then combine the rounds.
    q [B, H, T, K]; key, value [B, H, L + T, D] (a cache of L tokens first); query i is token L + i."""
    T, N = q.shape[2], key.shape[2]
    L = N - T
    R = bq.shape[2]
    rq = _ranks(bq) if C is not None else None  # [B, H, R, T] (C is None whenever L > 0)
    rk = _ranks(bk) if C is not None else None
    outs = []
    for i in range(T):
        o_r, l_r = [], []
        for r in range(R):
            allowed = bk[:, :, r] == bq[:, :, r, i : i + 1]  # [B, H, L + T]
            if causal:
                allowed = allowed & (torch.arange(N, device=q.device) <= L + i)
            if C is not None:
                cq = rq[:, :, r, i : i + 1] // C
                ck = rk[:, :, r] // C
                allowed = allowed & ((ck == cq) | (ck == cq - 1))
            if exclude_self:
                allowed[:, :, L + i] = False
            alone = ~allowed.any(-1)  # [B, H]
            allowed[:, :, L + i] = allowed[:, :, L + i] | alone
            s = (scale * (key * q[:, :, i : i + 1]).sum(-1)).masked_fill(
                ~allowed, float("-inf")
            )  # [B, H, L + T]
            lse = torch.logsumexp(s, -1)
            o_r.append((torch.exp(s - lse[..., None]).unsqueeze(-1) * value).sum(2))  # [B, H, V]
            l_r.append(lse)
        w = torch.softmax(torch.stack(l_r, 0), 0).unsqueeze(-1)  # [R, B, H, 1]
        outs.append((w * torch.stack(o_r, 0)).sum(0))
    return (
        torch.stack(outs, dim=2) if outs else value.new_zeros(*q.shape[:3], value.shape[-1])
    )  # [B, H, T, V]


def _take(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, H, T, D] gathered per round along T: idx [B, H, R, N] -> [B, H, R, N, D]."""
    return torch.take_along_dim(x.unsqueeze(2), idx.unsqueeze(-1), dim=3)


def _chunked(q, k, v, bq, bk, *, scale, causal, exclude_self, C):
    """The paper's sort-and-chunk form. q, k [B, H, T, K], v [B, H, T, V], buckets [B, H, R, T]."""
    B, H, T, K = q.shape
    V, R = v.shape[-1], bq.shape[2]
    N = -(-T // C)
    P = N * C - T
    pos = torch.arange(T, device=q.device)
    perm_q = (bq * T + pos).argsort(-1)  # [B, H, R, T]: sorted slot -> token
    perm_k = (bk * T + pos).argsort(-1)

    def sort_vec(x, perm):  # [B, H, T, D] -> [B, H, R, N, C, D], padded with zeros
        return F.pad(_take(x, perm), [0, 0, 0, P]).reshape(B, H, R, N, C, x.shape[-1])

    def sort_idx(x, perm, value):  # [B, H, R, T] -> [B, H, R, N, C]
        return F.pad(torch.take_along_dim(x, perm, dim=3), [0, P], value=value).reshape(B, H, R, N, C)

    qs, ks, vs = sort_vec(q, perm_q), sort_vec(k, perm_k), sort_vec(v, perm_k)
    bqs = sort_idx(bq, perm_q, -1)
    bks = sort_idx(bk, perm_k, -2)  # padded keys match no query
    posq = F.pad(perm_q, [0, P], value=T).reshape(B, H, R, N, C)  # padded queries sit after every key
    posk = F.pad(perm_k, [0, P], value=-1).reshape(B, H, R, N, C)

    def with_prev(x, fill):
        """[B, H, R, N, C, ...] -> [B, H, R, N, 2C, ...]: the previous chunk, then the chunk."""
        prev = torch.cat([torch.full_like(x[:, :, :, :1], fill), x[:, :, :, :-1]], dim=3)
        return torch.cat([prev, x], dim=4)

    kb, vb = with_prev(ks, 0.0), with_prev(vs, 0.0)  # [B, H, R, N, 2C, D]
    bkb, pkb = with_prev(bks, -2), with_prev(posk, -1)  # [B, H, R, N, 2C]
    allowed = bqs.unsqueeze(-1) == bkb.unsqueeze(-2)  # [B, H, R, N, C, 2C]
    if causal:
        allowed = allowed & (pkb.unsqueeze(-2) <= posq.unsqueeze(-1))
    if exclude_self:
        allowed = allowed & (pkb.unsqueeze(-2) != posq.unsqueeze(-1))
    alone = ~allowed.any(-1, keepdim=True)  # [B, H, R, N, C, 1]
    # Each query's own key and value as an extra slot, used only when it is alone.
    own = posq.clamp(max=T - 1).reshape(B, H, R, N * C)
    k_own = _take(k, own).reshape(B, H, R, N, C, K)
    v_own = _take(v, own).reshape(B, H, R, N, C, V)
    s = scale * qs @ kb.transpose(-1, -2)  # [B, H, R, N, C, 2C]
    s_own = scale * (qs * k_own).sum(-1, keepdim=True)  # [B, H, R, N, C, 1]
    s = torch.cat([s.masked_fill(~allowed, float("-inf")), s_own.masked_fill(~alone, float("-inf"))], -1)
    lse = torch.logsumexp(s, -1)  # [B, H, R, N, C]
    p = torch.exp(s - lse.unsqueeze(-1))
    o = p[..., :-1] @ vb + p[..., -1:] * v_own  # [B, H, R, N, C, V]
    o = o.reshape(B, H, R, N * C, V)[:, :, :, :T]
    lse = lse.reshape(B, H, R, N * C)[:, :, :, :T]
    inv = perm_q.argsort(-1)  # token -> sorted slot
    o = torch.take_along_dim(o, inv.unsqueeze(-1), dim=3)
    lse = torch.take_along_dim(lse, inv, dim=3)
    return _combine(o, lse)


def lsh_step(q, k, v, key, value, rotations, *, scale: float, exclude_self: bool = True):
    """One token: q, k: [B, H, K], v: [B, H, V]; cache key [B, H, L, K], value [B, H, L, V].

    The new query attends to the cached keys (and its own) that share its bucket in each round, itself
    only when alone; rounds combined by log-sum-exp. Returns (o [B, H, V], key, value) with the token
    appended. No positions or integer arithmetic: the new token is the last cache slot.
    """
    dt = torch.promote_types(key.dtype, torch.float32)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    key = torch.cat([key.to(dt), k.unsqueeze(2)], dim=2)  # [B, H, L + 1, K]
    value = torch.cat([value.to(dt), v.unsqueeze(2)], dim=2)
    bq = lsh_buckets(q, rotations).unsqueeze(-1)  # [B, H, R, 1]
    bk = lsh_buckets(key, rotations).transpose(-1, -2)  # [B, H, R, L + 1]
    allowed = bk == bq
    is_self = F.pad(
        torch.zeros_like(key[:, :, :-1, 0], dtype=torch.bool), (0, 1), value=True
    )  # [B, H, L + 1]
    is_self = is_self.unsqueeze(2)
    if exclude_self:
        allowed = allowed & ~is_self
    allowed = allowed | (is_self & ~allowed.any(-1, keepdim=True))
    s = (
        (scale * (key * q.unsqueeze(2)).sum(-1)).unsqueeze(2).masked_fill(~allowed, float("-inf"))
    )  # [B, H, R, L+1]
    lse = torch.logsumexp(s, -1)  # [B, H, R]
    o = torch.exp(s - lse.unsqueeze(-1)) @ value  # [B, H, R, V]
    w = torch.softmax(lse, dim=-1).unsqueeze(-1)
    return (w * o).sum(2), key, value


def lsh_attention(
    q: Tensor,
    k: Tensor | None,
    v: Tensor,
    *,
    n_buckets: int = 8,
    n_rounds: int = 1,
    bucket_size: int | None = 64,
    causal: bool = True,
    scale: float | None = None,
    exclude_self: bool | None = None,
    rotations: Tensor | None = None,
    seed: int = 0,
    initial_state: KVCache | tuple | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
):
    """LSH attention on ``q: [B, T, H, K]``, ``k: [B, T, H, K]`` or None (shared QK), ``v: [B, T, H, V]``.

    ``rotations`` ``[n_rounds, K, n_buckets // 2]`` (``lsh_rotations``) default to Gaussian ones drawn
    from ``seed``. ``exclude_self`` defaults to True for shared QK, else False. ``bucket_size`` is the
    chunk of the sorted sequence (None: the whole bucket, which also allows ``initial_state`` (a
    ``KVCache`` of keys ``[B, H, L, K]``, values ``[B, H, L, V]``) and ``mode="recurrent"``). ``scale``
    defaults to ``K ** -0.5``. Returns ``(o [B, T, H, V], KVCache or None)``. ``mode="auto"`` runs
    ``lsh_step`` for T == 1 (without a cache a lone token attends to itself under every bucket size and
    causality) and "chunk" otherwise (``edgeattn.ops.backend.choose_form``).
    """
    check_mode(mode, ("auto", *MODES))
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    shared = k is None
    if shared:
        k = F.normalize(q, dim=-1)
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_rank("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    V = v.shape[-1]
    if rotations is None:
        _check_buckets(n_buckets, n_rounds)
        gen = torch.Generator().manual_seed(seed)
        rotations = lsh_rotations(K, n_buckets, n_rounds, gen).to(q.device)
    else:
        check_rank("rotations", rotations, 3, "[n_rounds, K, n_buckets // 2]")
        check_dims("rotations", rotations, (None, K, None), "[n_rounds, K, n_buckets // 2]")
    if bucket_size is not None and (
        isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1
    ):
        raise ValueError(f"bucket_size must be None (whole buckets) or an int >= 1, got {bucket_size!r}")
    chunked = bucket_size is not None
    if chunked and (initial_state is not None or mode == "recurrent"):
        raise ValueError(
            "initial_state and mode='recurrent' need bucket_size=None: the chunked pattern depends on how "
            "later tokens sort, so it cannot continue a sequence"
        )
    if not causal and (initial_state is not None or mode == "recurrent"):
        raise ValueError("causal=False attends to later tokens: it has no recurrent form or initial_state")
    if exclude_self is None:
        exclude_self = shared
    if scale is None:
        scale = K**-0.5
    acc = torch.promote_types(q.dtype, torch.float32)
    L = 0
    if initial_state is not None:
        if not (isinstance(initial_state, tuple | list) and len(initial_state) == 2):
            raise ValueError("initial_state must be a KV cache (key [B, H, L, K], value [B, H, L, V])")
        check_dims("initial_state.key", initial_state[0], (B, H, None, K), "[B, H, L, K]")
        L = initial_state[0].shape[2]
        check_dims("initial_state.value", initial_state[1], (B, H, L, V), "[B, H, L, V] (L as key)")
    mode = choose_form(mode, T, "lsh_attention")
    if mode == "step":
        # Before any conversion below: the step traces exactly the ops of the exported step graph.
        if initial_state is None:
            initial_state = (q.new_zeros(B, H, 0, K, dtype=acc), v.new_zeros(B, H, 0, V, dtype=acc))
        o, key, value = lsh_step(
            q[:, 0], k[:, 0], v[:, 0], *initial_state, rotations, scale=scale, exclude_self=exclude_self
        )
        o = o.unsqueeze(1)
        return (o if o.dtype == q.dtype else o.to(q.dtype)), (
            KVCache(key, value) if output_final_state else None
        )
    out_dtype = q.dtype
    qh, kh, vh = (x.to(acc).transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    rot = rotations.to(acc)
    cache_k = initial_state[0].to(acc) if initial_state is not None else qh.new_zeros(B, H, 0, K)
    cache_v = initial_state[1].to(acc) if initial_state is not None else vh.new_zeros(B, H, 0, V)

    if mode == "recurrent":
        key, value, outs = cache_k, cache_v, []
        for t in range(T):
            o_t, key, value = lsh_step(
                qh[:, :, t], kh[:, :, t], vh[:, :, t], key, value, rot, scale=scale, exclude_self=exclude_self
            )
            outs.append(o_t)
        o = torch.stack(outs, dim=2) if outs else vh.new_zeros(B, H, 0, V)
        state = KVCache(key, value)
    else:
        bq = lsh_buckets(qh, rot).permute(0, 1, 3, 2)  # [B, H, R, T]
        key, value = torch.cat([cache_k, kh], 2), torch.cat([cache_v, vh], 2)  # [B, H, L + T, D]
        bk = bq if shared and L == 0 else lsh_buckets(key, rot).permute(0, 1, 3, 2)  # [B, H, R, L + T]
        C = bucket_size
        if mode == "naive":
            o = _naive(qh, key, value, bq, bk, scale=scale, causal=causal, exclude_self=exclude_self, C=C)
        elif mode == "chunk" and chunked:
            o = _chunked(qh, kh, vh, bq, bk, scale=scale, causal=causal, exclude_self=exclude_self, C=C)
        elif mode in ("chunk", "parallel"):
            qpos = torch.arange(L, L + T, device=q.device)
            kpos = torch.arange(L + T, device=q.device)
            cq = ck = None
            if chunked:
                cq, ck = _ranks(bq) // C, _ranks(bk) // C
            o = _dense(
                qh,
                key,
                value,
                bq,
                bk,
                qpos,
                kpos,
                scale=scale,
                causal=causal,
                exclude_self=exclude_self,
                chunk_q=cq,
                chunk_k=ck,
            )
        state = KVCache(key, value)
    o = o.transpose(1, 2).to(out_dtype)  # [B, T, H, V]
    return o, (state if output_final_state else None)
