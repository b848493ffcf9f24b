"""Approximations of softmax attention: random Fourier features, Reformer LSH, Nystrom, and the dispatcher.

Each op is checked against a reference written here from the paper's formula (loops over tokens,
outputs and gradients in float64), against exact softmax where the approximation becomes exact, and
the RFF kernel estimate against the Gaussian kernel with a bound derived from Hoeffding's inequality.
"""

import math

import pytest
import torch

from edgeattn.ops import METHODS, attention, lsh_attention, nystrom_attention, rff_attention, rff_features
from edgeattn.ops.lsh import lsh_buckets, lsh_rotations, lsh_step
from edgeattn.ops.nystrom import iterative_pinv
from edgeattn.ops.rff import gaussian_projection
from tests.helpers import assert_close, grads

F = torch.nn.functional


def qkv(B, T, H, K, V, seed=0, scale=1.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=dtype) for D in (K, K, V))
    return (q * scale).requires_grad_(), (k * scale).requires_grad_(), v.requires_grad_()


def exact_softmax(q, k, v, mask=None, scale=None):
    """softmax(scale q k^T + mask) v over [B, T, H, D] with a bool mask [T, T] (True = attend)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bihk,bjhk->bhij", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhij,bjhv->bihv", torch.softmax(s, -1), v)


# ---------------------------------------------------------------- random Fourier features


def test_rff_features_formula():
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    w = torch.randn(7, 6, dtype=torch.float64)
    phi = rff_features(x, w)
    ref = torch.empty(3, 5, 14, dtype=torch.float64)
    for i in range(7):  # [cos(w_i . x) ..., sin(w_i . x) ...] / sqrt(m)
        ref[..., i] = torch.cos((x * w[i]).sum(-1)) / math.sqrt(7)
        ref[..., 7 + i] = torch.sin((x * w[i]).sum(-1)) / math.sqrt(7)
    assert_close("rff_features", phi, ref, 1e-12)
    with pytest.raises(ValueError, match="projection"):
        rff_features(x, torch.randn(7, 5))


def test_rff_kernel_estimate_converges_to_gaussian_kernel():
    """phi(x) . phi(y) = (1/m) sum_i cos(w_i . (x - y)) with w_i ~ N(0, I) i.i.d.: each term lies in
    [-1, 1] and has mean exp(-|x - y|^2 / 2). Hoeffding: P(|estimate - kernel| >= eps) <= 2 exp(-m eps^2 / 2).
    With a union bound over the N pairs and the len(ms) feature counts, every error stays below
    eps_m = sqrt(2 ln(2 N len(ms) / delta) / m) with probability >= 1 - delta (delta = 1e-6). The seed is
    fixed, so the test is deterministic; the bound comes from the variance bound, not from a tuning run."""
    N, K, delta, ms = 40, 8, 1e-6, (64, 1024, 16384)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, K, generator=gen, dtype=torch.float64) * 0.5
    y = torch.randn(N, K, generator=gen, dtype=torch.float64) * 0.5
    kernel = torch.exp(-0.5 * ((x - y) ** 2).sum(-1))
    errors = []
    for m in ms:
        w = gaussian_projection(m, K, gen, dtype=torch.float64)
        est = (rff_features(x, w) * rff_features(y, w)).sum(-1)
        err = (est - kernel).abs().max().item()
        bound = math.sqrt(2 * math.log(2 * N * len(ms) / delta) / m)
        assert err <= bound, f"m={m}: max error {err:.4f} above the Hoeffding bound {bound:.4f}"
        errors.append(err)
    # The largest m is 256x the smallest: its error must sit well under the smallest m's bound / 4.
    assert errors[-1] < math.sqrt(2 * math.log(2 * N * len(ms) / delta) / ms[0]) / 4


def rff_reference(q, k, v, w, eps):
    """o_t = sum_{j<=t} (fq_t . fk_j) v_j / max(sum_{j<=t} fq_t . fk_j, W_t / sqrt(m), eps) with
    W_t = sum_{j<=t} exp(|y_j|^2 / 2), the features written from the formula."""
    K = q.shape[-1]
    x, y = q * K**-0.25, k * K**-0.25
    m = w.shape[0]

    def phi(z):
        wz = z @ w.T
        return torch.cat([torch.cos(wz), torch.sin(wz)], -1) / math.sqrt(m)

    weight = torch.exp(0.5 * (y * y).sum(-1, keepdim=True))  # [B, T, H, 1]
    fq, fk = phi(x), phi(y) * weight
    T = q.shape[1]
    out = []
    for t in range(T):
        sim = (fq[:, t : t + 1] * fk[:, : t + 1]).sum(-1)  # [B, t+1, H]
        num = (sim.unsqueeze(-1) * v[:, : t + 1]).sum(1)
        floor = (weight[:, : t + 1].sum(1) / math.sqrt(m)).clamp_min(eps)  # [B, H, 1]
        out.append(num / torch.maximum(sim.sum(1).unsqueeze(-1), floor))
    return torch.stack(out, 1)


@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent", "parallel"])
def test_rff_attention_against_formula(mode):
    q, k, v = qkv(2, 37, 2, 8, 5, scale=0.5)
    w = gaussian_projection(32, 8, torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = rff_reference(q, k, v, w, 1e-6)
    o, _ = rff_attention(q, k, v, w, mode=mode, chunk_size=16)
    assert_close("o", o, ref, 1e-9)
    for name, g, gr in zip("qkv", grads([o], [q, k, v]), grads([ref], [q, k, v])):
        assert_close(f"d{name}", g, gr, 1e-8)


def test_rff_attention_continues_from_state():
    q, k, v = qkv(1, 30, 2, 8, 4, scale=0.5)
    w = gaussian_projection(16, 8, torch.Generator().manual_seed(1), dtype=torch.float64)
    full, _ = rff_attention(q, k, v, w)
    a, st = rff_attention(q[:, :11], k[:, :11], v[:, :11], w, output_final_state=True)
    b, _ = rff_attention(q[:, 11:], k[:, 11:], v[:, 11:], w, initial_state=st, mode="recurrent")
    assert_close("continued", torch.cat([a, b], 1), full, 1e-10)


def test_rff_normalizer_is_floored_at_the_noise_level():
    """One key whose similarity estimate is negative: w cos(x - y) with x - y = pi, w = exp(y^2 / 2).
    The op divides by max(den, W / sqrt(m)) = W (m = 1): o = -w v / w = -v, never num / den (= +v by
    luck of signs here) nor num / eps. Then random inputs far from their kernel's scale: every output
    stays within sqrt(m) max |v| (the bound stated in the module docstring)."""
    w = torch.ones(1, 1, dtype=torch.float64)
    q = torch.full((1, 1, 1, 1), math.pi / 2, dtype=torch.float64)
    k = torch.full((1, 1, 1, 1), -math.pi / 2, dtype=torch.float64)
    v = torch.full((1, 1, 1, 1), 2.0, dtype=torch.float64)
    for causal in (True, False):
        o, _ = rff_attention(q, k, v, w, causal=causal)
        assert o.item() == pytest.approx(-2.0, rel=1e-12)
    q, k, v = qkv(2, 64, 2, 16, 4, seed=3, scale=3.0)
    proj = gaussian_projection(8, 16, torch.Generator().manual_seed(0), dtype=torch.float64)
    for causal in (True, False):
        o, _ = rff_attention(q, k, v, proj, causal=causal)
        assert torch.isfinite(o).all()
        assert o.abs().max() <= math.sqrt(8) * v.abs().max() * (1 + 1e-9)


# ---------------------------------------------------------------- Reformer LSH


def lsh_reference(q, k, v, rot, n_buckets, C, causal, exclude_self, scale):
    """Straight from the paper, one (b, h, round, query) at a time: buckets argmax([xR, -xR]), ranks in
    the (bucket, position) sort, P(i) = same bucket, causal, chunk rule, self only when alone; rounds
    combined with weights softmax_r(logsumexp_r)."""
    B, T, H, _ = q.shape
    R = rot.shape[0]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                outs, lses = [], []
                for r in range(R):

                    def bucket(x, r=r):
                        if n_buckets == 1:
                            return 0
                        xr = x @ rot[r]
                        return int(torch.cat([xr, -xr]).argmax())

                    hq = [bucket(q[b, t, h]) for t in range(T)]
                    hk = [bucket(k[b, t, h]) for t in range(T)]
                    rank_q = {t: s for s, t in enumerate(sorted(range(T), key=lambda t: (hq[t], t)))}
                    rank_k = {t: s for s, t in enumerate(sorted(range(T), key=lambda t: (hk[t], t)))}
                    P = []
                    for j in range(T):
                        ok = hk[j] == hq[i] and (j <= i or not causal) and not (exclude_self and j == i)
                        if C is not None:
                            ok = ok and rank_k[j] // C in (rank_q[i] // C, rank_q[i] // C - 1)
                        if ok:
                            P.append(j)
                    P = P or [i]
                    s = torch.stack([scale * q[b, i, h] @ k[b, j, h] for j in P])
                    lse = torch.logsumexp(s, 0)
                    outs.append((torch.exp(s - lse)[:, None] * v[b, P, h]).sum(0))
                    lses.append(lse)
                wts = torch.softmax(torch.stack(lses), 0)
                out[b, i, h] = (wts[:, None] * torch.stack(outs)).sum(0)
    return out


@pytest.mark.parametrize(
    "shared, C, causal, rounds",
    [
        (True, 4, True, 2),
        (True, None, True, 3),
        (False, 4, True, 2),
        (False, 5, False, 1),
        (True, 4, False, 2),
    ],
)
@pytest.mark.parametrize("mode", ["chunk", "naive", "parallel"])
def test_lsh_against_formula(shared, C, causal, rounds, mode):
    q, k, v = qkv(1, 13, 2, 6, 3, seed=2)
    rot = lsh_rotations(6, 4, rounds, torch.Generator().manual_seed(3), dtype=torch.float64)
    kk = F.normalize(q, dim=-1) if shared else k
    ref = lsh_reference(q, kk, v, rot, 4, C, causal, shared, 6**-0.5)
    o, _ = lsh_attention(q, None if shared else k, v, rotations=rot, bucket_size=C, causal=causal, mode=mode)
    assert_close("o", o, ref, 1e-10)
    for name, g, gr in zip("qkv", grads([o], [q, k, v]), grads([ref], [q, k, v])):
        if gr is None:
            assert g is None or g.abs().max() == 0
        else:
            assert_close(f"d{name}", g, gr, 1e-9)


def test_lsh_one_bucket_one_round_is_exact_causal_softmax():
    q, k, v = qkv(2, 50, 2, 8, 4)
    T = 50
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ref = exact_softmax(q, k, v, causal)
    for C in (None, 64):  # the whole bucket, or one chunk holding the sequence
        o, _ = lsh_attention(q, k, v, n_buckets=1, n_rounds=1, bucket_size=C)
        assert_close("separate qk", o, ref, 1e-12)
    # Shared QK (the paper): keys q/|q|, a token never sees itself except the first, which is alone.
    kn = F.normalize(q, dim=-1)
    no_self = causal & ~torch.eye(T, dtype=torch.bool)
    no_self[0, 0] = True
    o, _ = lsh_attention(q, None, v, n_buckets=1, n_rounds=1, bucket_size=64)
    assert_close("shared qk", o, exact_softmax(q, kn, v, no_self), 1e-12)
    # Several rounds of one bucket: the same set each round, so the log-sum-exp average changes nothing.
    o, _ = lsh_attention(q, k, v, n_buckets=1, n_rounds=4, bucket_size=None)
    assert_close("4 rounds", o, ref, 1e-12)


def test_lsh_buckets_invariant_to_sequence_order():
    x = torch.randn(2, 40, 3, 16)
    rot = lsh_rotations(16, 8, 3, torch.Generator().manual_seed(0))
    perm = torch.randperm(40)
    b = lsh_buckets(x, rot)  # [B, T, H, R]
    assert b.shape == (2, 40, 3, 3) and b.min() >= 0 and b.max() < 8
    assert torch.equal(lsh_buckets(x[:, perm], rot), b[:, perm])
    assert len(b.unique()) > 1  # the hash does separate tokens


def test_lsh_whole_buckets_continue_from_a_cache():
    q, k, v = qkv(2, 30, 2, 8, 4, seed=4)
    kw = dict(n_buckets=4, n_rounds=2, bucket_size=None, seed=5)
    full, _ = lsh_attention(q, None, v, **kw)
    a, st = lsh_attention(q[:, :12], None, v[:, :12], output_final_state=True, **kw)
    b, _ = lsh_attention(
        q[:, 12:], F.normalize(q[:, 12:], dim=-1), v[:, 12:], exclude_self=True, initial_state=st, **kw
    )
    assert_close("cache + chunk", torch.cat([a, b], 1), full, 1e-10)
    rec, _ = lsh_attention(q, None, v, mode="recurrent", **kw)
    assert_close("recurrent", rec, full, 1e-10)
    kn12 = F.normalize(q[:, 12:], dim=-1)
    nv, _ = lsh_attention(q[:, 12:], kn12, v[:, 12:], exclude_self=True, initial_state=st, mode="naive", **kw)
    assert_close("naive after a cache", nv, full[:, 12:], 1e-10)
    # The exported step: the last row of the dense form.
    rot = lsh_rotations(8, 4, 2, torch.Generator().manual_seed(5), dtype=torch.float64)
    kn = F.normalize(q, dim=-1).transpose(1, 2)
    o_t, key, _ = lsh_step(
        q[:, -1], kn[:, :, -1], v[:, -1], kn[:, :, :-1], v.transpose(1, 2)[:, :, :-1], rot, scale=8**-0.5
    )
    assert key.shape == (2, 2, 30, 8)
    assert_close("step", o_t, full[:, -1], 1e-10)


def test_lsh_bad_arguments():
    q, k, v = qkv(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="n_buckets must be 1 or even"):
        lsh_attention(q, k, v, n_buckets=3)
    with pytest.raises(ValueError, match="bucket_size=None"):
        lsh_attention(q, k, v, mode="recurrent", bucket_size=4)
    with pytest.raises(ValueError, match="bucket_size"):
        lsh_attention(q, k, v, bucket_size=0)
    with pytest.raises(ValueError, match="k must have shape"):
        lsh_attention(q, k[:, :4], v)


# ---------------------------------------------------------------- Nystrom


def nystrom_reference(q, k, v, m, n_iter, scale):
    """The paper's formula with explicit segments and the iteration written out per (b, h)."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            Q, Kk, Vv = q[b, :, h], k[b, :, h], v[b, :, h]
            segs = [[i for i in range(T) if i * m // T == s] for s in range(m)]
            Ql = torch.stack([Q[s].mean(0) for s in segs])
            Kl = torch.stack([Kk[s].mean(0) for s in segs])
            Fm = torch.softmax(scale * Q @ Kl.T, -1)
            A = torch.softmax(scale * Ql @ Kl.T, -1)
            Bm = torch.softmax(scale * Ql @ Kk.T, -1)
            Z = A.T / (A.abs().sum(0).max() * A.abs().sum(1).max())
            eye = torch.eye(m, dtype=q.dtype)
            for _ in range(n_iter):
                AZ = A @ Z
                Z = 0.25 * Z @ (13 * eye - AZ @ (15 * eye - AZ @ (7 * eye - AZ)))
            out[b, :, h] = Fm @ Z @ (Bm @ Vv)
    return out


@pytest.mark.parametrize("T, m", [(24, 6), (25, 7), (9, 9)])
def test_nystrom_against_formula(T, m):
    q, k, v = qkv(2, T, 2, 8, 5, seed=6)
    ref = nystrom_reference(q, k, v, m, 6, 8**-0.5)
    o, _ = nystrom_attention(q, k, v, n_landmarks=m)
    assert_close("o", o, ref, 1e-9)
    for name, g, gr in zip("qkv", grads([o], [q, k, v]), grads([ref], [q, k, v])):
        assert_close(f"d{name}", g, gr, 1e-8)


def test_nystrom_with_every_token_a_landmark_is_softmax():
    T = 48
    q, k, v = qkv(2, T, 2, 16, 8, seed=7, dtype=torch.float32)
    ref = exact_softmax(q, k, v)
    # Any inputs, exact pseudo-inverse: F A^+ B = A A^+ A = A.
    o, _ = nystrom_attention(q, k, v, n_landmarks=T, pinv="exact")
    assert (o - ref).abs().max() < 1e-4
    # The paper's 6 iterations converge when A is well conditioned: q = k of equal, large norms makes
    # A diagonally dominant (the iteration needs sigma_min(A)^2 / (|A|_1 |A|_inf) well above 0).
    qq = F.normalize(q.detach(), dim=-1) * 8
    o, _ = nystrom_attention(qq, qq, v, n_landmarks=T)
    assert (o - exact_softmax(qq, qq, v)).abs().max() < 1e-4


def test_iterative_pinv_converges():
    a = torch.softmax(torch.randn(3, 16, 16, dtype=torch.float64) * 2, -1)
    exact = torch.linalg.pinv(a)
    errs = [((iterative_pinv(a, n) - exact).norm() / exact.norm()).item() for n in (2, 6, 12, 20)]
    assert errs[0] > errs[1] > errs[2] and errs[-1] < 1e-8, errs


def test_nystrom_conv_skip_and_refusals():
    q, k, v = qkv(1, 10, 2, 4, 3, seed=8)
    w = torch.randn(2, 3, dtype=torch.float64)
    base, _ = nystrom_attention(q, k, v, n_landmarks=5)
    o, _ = nystrom_attention(q, k, v, n_landmarks=5, conv_weight=w)
    skip = torch.zeros_like(base)
    for t in range(10):  # centred depthwise convolution over time, zero padded, one kernel per head
        for d in (-1, 0, 1):
            if 0 <= t + d < 10:
                skip[:, t] += w[:, d + 1][None, :, None] * v[:, t + d]
    assert_close("conv skip", o - base, skip, 1e-10)
    with pytest.raises(ValueError, match="bidirectional"):
        nystrom_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="bidirectional"):
        attention(q, k, v, method="nystrom")
    with pytest.raises(ValueError, match="n_landmarks"):
        nystrom_attention(q, k, v, n_landmarks=11)


# ---------------------------------------------------------------- the dispatcher


def test_dispatcher_unknown_method_names_the_list():
    q, k, v = qkv(1, 4, 1, 4, 4)
    with pytest.raises(ValueError) as e:
        attention(q, k, v, method="flashy")
    assert "'flashy'" in str(e.value)
    for name in METHODS:
        assert name in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", METHODS)
def test_dispatcher_every_method_accepts_every_dtype(name, dtype):
    """Every method takes the dtypes the others take and returns that dtype, close to its float64 result
    (performer's projection once stayed float32: `expected m1 and m2 to have the same dtype`)."""
    q, k, v = qkv(1, 12, 2, 8, 8, scale=0.5, dtype=torch.float64)
    opts = {"causal": name != "nystrom", **({"n_landmarks": 4} if name == "nystrom" else {})}
    if name == "hybrid":
        opts.update(switch_length=4, long_method="performer")  # the long branch, with random features
    ref = attention(q, k, v, method=name, **opts)
    o = attention(q.to(dtype), k.to(dtype), v.to(dtype), method=name, **opts)
    assert o.dtype == dtype and o.shape == ref.shape
    tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.02}[dtype]
    torch.testing.assert_close(o.double(), ref, rtol=tol, atol=tol)


def test_dispatcher_every_method():
    q, k, v = qkv(2, 20, 2, 8, 8, scale=0.5, dtype=torch.float32)
    ref = exact_softmax(q, k, v, torch.ones(20, 20, dtype=torch.bool).tril())
    for name in METHODS:
        causal = name != "nystrom"
        o = attention(
            q, k, v, method=name, causal=causal, **({"n_landmarks": 5} if name == "nystrom" else {})
        )
        assert o.shape == (2, 20, 2, 8) and torch.isfinite(o).all(), name
    # Exact where the method is exact; the seed fixes the random features.
    assert_close("softmax", attention(q, k, v, method="softmax"), ref, 1e-6)
    assert_close("lsh 1 bucket", attention(q, k, v, method="lsh", n_buckets=1), ref, 1e-6)
    a = attention(q, k, v, method="performer", seed=3)
    assert torch.equal(a, attention(q, k, v, method="performer", seed=3))
    assert not torch.equal(a, attention(q, k, v, method="performer", seed=4))
    # Non-causal linear: the causal output at the last token sees the whole sequence too.
    nc = attention(q, k, v, method="linear", causal=False)
    assert_close("linear last token", nc[:, -1], attention(q, k, v, method="linear")[:, -1], 1e-5)
    with pytest.raises(ValueError, match="causal=True"):
        attention(q, k, v, method="retnet", causal=False)
    with pytest.raises(TypeError):
        attention(q, k, v, method="softmax", n_features=3)


def test_dispatcher_hybrid_switches_on_length():
    q, k, v = qkv(1, 16, 2, 8, 8, dtype=torch.float32)
    short = attention(q, k, v, method="hybrid", switch_length=16)
    assert torch.equal(short, attention(q, k, v, method="softmax"))
    long = attention(q, k, v, method="hybrid", switch_length=15)
    assert torch.equal(long, attention(q, k, v, method="linear"))
    rff = attention(q, k, v, method="hybrid", switch_length=8, long_method="rff", n_features=8, seed=2)
    assert torch.equal(rff, attention(q, k, v, method="rff", n_features=8, seed=2))
    with pytest.raises(ValueError, match="long_method"):
        attention(q, k, v, method="hybrid", long_method="lsh")
