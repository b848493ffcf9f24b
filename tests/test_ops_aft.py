"""AFT: every mode against the float64 naive loop (outputs, state, gradients), continuation, extremes."""

import functools

import pytest
import torch

from edgeattn.ops.aft import STATE_NAMES, aft, aft_full
from tests.helpers import assert_close, grads

MODES = ("recurrent", "chunk", "parallel")
WINDOWS = ("none", "shared", "channel")  # no window bias, [W], [W, D]


def make_inputs(T, window, W=20, D=16, B=2, dtype=torch.float32, seed=0):
    """Leaves (q, k, v, decay, window_bias or None) and an initial state with a full buffer in row 0
    and 3 filled slots in row 1; every tensor but the counters max_age and position requires grad."""
    gen = torch.Generator().manual_seed(seed)
    W = 0 if window == "none" else W
    q = torch.randn(B, T, D, generator=gen)
    k = 2 * torch.randn(B, T, D, generator=gen)
    v = torch.randn(B, T, D, generator=gen)
    decay = -torch.rand(D, generator=gen) * torch.logspace(-3, 0, D)
    decay[0] = 0.0  # no decay at all in one channel
    wb = {"none": None, "shared": torch.randn(W, generator=gen), "channel": torch.randn(W, D, generator=gen)}
    state = [
        torch.randn(B, D, generator=gen),
        torch.rand(B, D, generator=gen) + 0.1,
        torch.randn(B, D, generator=gen),
    ]
    if W:
        state += [torch.randn(B, W, D, generator=gen), torch.randn(B, W, D, generator=gen)]
    cast = lambda x: None if x is None else x.to(dtype).requires_grad_()  # noqa: E731
    tensors = [cast(q), cast(k), cast(v), cast(decay), cast(wb[window])]
    state = [cast(s) for s in state]
    # Counters (max_age, position) are floats without gradients.
    state.insert(3, torch.randint(W, W + 50, (B, D), generator=gen).float())
    if W:
        state.append(torch.tensor([float(W), min(3.0, W)])[:B])
    return tensors, tuple(state)


def run(tensors, state, mode, dtype=None, chunk_size=64):
    """(outputs: o and every final state tensor, gradients of a projection of them w.r.t. the leaves)."""
    q, k, v, decay, wb = tensors
    conv = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.to(dtype))  # noqa: E731
    o, st = aft(
        conv(q),
        conv(k),
        conv(v),
        decay=conv(decay),
        window_bias=conv(wb),
        initial_state=tuple(conv(s) for s in state),
        output_final_state=True,
        mode=mode,
        chunk_size=chunk_size,
    )
    outs = [o, *st]
    leaves = [t for t in (*tensors, *state) if t is not None and t.requires_grad]
    return outs, grads([x for x in outs if x.requires_grad], leaves)


@functools.lru_cache(maxsize=32)
def reference(T, window, W, D, dtype):
    """The float64 naive loop on the same (rounded) inputs, computed once per case."""
    tensors, state = make_inputs(T, window, W, D, dtype=dtype)
    outs, gs = run(tensors, state, "naive", dtype=torch.float64)
    return [x.detach() for x in outs], gs


def check_against_naive(T, window, mode, W=20, D=16, dtype=torch.float32, chunk_size=64):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref_outs, ref_grads = reference(T, window, W, D, dtype)
    tensors, state = make_inputs(T, window, W, D, dtype=dtype)
    outs, gs = run(tensors, state, mode, chunk_size=chunk_size)
    names = ["o", *STATE_NAMES]
    assert outs[0].dtype == dtype and all(s.dtype == torch.float32 for s in outs[1:])
    for name, a, b in zip(names, outs, ref_outs):
        assert_close(f"{mode} {name}", a, b, tol)
    assert len(gs) == len(ref_grads)
    for i, (a, b) in enumerate(zip(gs, ref_grads)):
        assert_close(f"{mode} grad of leaf {i}", a, b, tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", WINDOWS)
def test_modes_match_naive_float32(mode, window):
    check_against_naive(65, window, mode, chunk_size=16)  # W = 20 > C = 16: windows span chunks


@pytest.mark.parametrize("T", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("window", ["none", "channel"])
def test_chunk_awkward_lengths(T, window):
    check_against_naive(T, window, "chunk")


@pytest.mark.parametrize("window", ["none", "channel"])
def test_recurrent_500_tokens(window):
    check_against_naive(500, window, "recurrent")


@pytest.mark.parametrize("W", [1, 16, 40])
def test_chunk_window_sizes(W):
    check_against_naive(70, "channel", "chunk", W=W, chunk_size=16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", ["none", "channel"])
def test_modes_match_naive_bfloat16(mode, window):
    check_against_naive(65, window, mode, dtype=torch.bfloat16, chunk_size=32)


@pytest.mark.parametrize("mode", ("naive", *MODES))
@pytest.mark.parametrize("split", [1, 7, 37, 64, 99])
@pytest.mark.parametrize("window", ["none", "channel"])
def test_split_and_continue_equals_whole(mode, split, window):
    (q, k, v, decay, wb), state = make_inputs(130, window)
    kw = dict(decay=decay, window_bias=wb, output_final_state=True, mode=mode, chunk_size=32)
    with torch.no_grad():
        o_full, s_full = aft(q, k, v, initial_state=state, **kw)
        o1, s1 = aft(q[:, :split], k[:, :split], v[:, :split], initial_state=state, **kw)
        o2, s2 = aft(q[:, split:], k[:, split:], v[:, split:], initial_state=s1, **kw)
    assert_close("output", torch.cat([o1, o2], 1), o_full, 1e-5)
    for name, a, b in zip(STATE_NAMES, s2, s_full):
        assert_close(name, a, b, 1e-5)


def test_state_of_one_mode_continues_in_another():
    (q, k, v, decay, wb), _ = make_inputs(90, "channel")
    kw = dict(decay=decay, window_bias=wb, output_final_state=True)
    with torch.no_grad():
        ref, _ = aft(q.double(), k.double(), v.double(), **{**kw, "decay": decay.double()}, mode="naive")
        o1, s1 = aft(q[:, :50], k[:, :50], v[:, :50], **kw, mode="chunk", chunk_size=16)
        o2, s2 = aft(q[:, 50:80], k[:, 50:80], v[:, 50:80], initial_state=s1, **kw, mode="recurrent")
        o3, _ = aft(q[:, 80:], k[:, 80:], v[:, 80:], initial_state=s2, **kw, mode="parallel")
    assert_close("output", torch.cat([o1, o2, o3], 1), ref, 1e-5)


def test_zeros_state_is_the_start_and_no_state_by_default():
    (q, k, v, decay, wb), _ = make_inputs(10, "channel", W=4)
    with torch.no_grad():
        o, st = aft(q, k, v, decay=decay, window_bias=wb)
        assert st is None
        zeros = (torch.zeros(2, 16),) * 4 + (torch.zeros(2, 4, 16),) * 2 + (torch.zeros(2),)
        o0, st = aft(q, k, v, decay=decay, window_bias=wb, initial_state=zeros, output_final_state=True)
    assert_close("output", o0, o, 1e-6)
    assert [tuple(s.shape) for s in st] == [(2, 16)] * 4 + [(2, 4, 16)] * 2 + [(2,)]
    assert st[-1].tolist() == [4.0, 4.0]


def test_naive_equals_the_double_sum():
    """The reference itself, against the formula written as a double loop over (t, i)."""
    (q, k, v, decay, wb), _ = make_inputs(12, "channel", W=3, D=4, B=1)
    q, k, v, decay, wb = (x.detach().double() for x in (q, k, v, decay, wb))
    o, _ = aft(q, k, v, decay=decay, window_bias=wb, mode="naive")
    for t in range(12):
        w = [wb[t - i] if t - i < 3 else (t - i) * decay for i in range(t + 1)]
        e = torch.stack([torch.exp(k[0, i] + w[i]) for i in range(t + 1)])
        want = torch.sigmoid(q[0, t]) * (e * v[0, : t + 1]).sum(0) / e.sum(0)
        assert_close(f"token {t}", o[0, t], want, 1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", ["none", "channel"])
def test_extreme_keys_and_decays_stay_finite_and_exact(mode, window):
    (q, k, v, _, wb), state = make_inputs(100, window, W=8)
    k = (80 * torch.sign(torch.randn(2, 100, 16))).requires_grad_()
    decay = torch.tensor([0.0, -1e-3, -1.0, -1e4] * 4, requires_grad=True)
    if wb is not None:
        wb = (torch.randn(8, 16) * 50).requires_grad_()
    kw = dict(window_bias=wb, initial_state=state, output_final_state=True, mode=mode, chunk_size=32)
    o, st = aft(q, k, v, decay=decay, **kw)
    g = torch.autograd.grad(o.sum() + st[0].sum(), [q, k, v, decay])
    ref, st_ref = aft(q.double(), k.double(), v.double(), decay=decay.double(), **{**kw, "mode": "naive"})
    assert all(torch.isfinite(x).all() for x in (o, *st, *g))
    assert_close("output", o, ref, 1e-5)
    assert_close("denominator", st[1], st_ref[1], 1e-5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.zeros(4, 8)), r"q must have shape \[B, T, D\]"),
        (dict(k=torch.zeros(1, 5, 8)), r"k must have shape \[B, T, D\] \(as q\)"),
        (dict(v=torch.zeros(1, 4, 9)), r"v must have shape \[B, T, D\] \(as q\)"),
        (dict(decay=torch.zeros(7)), r"decay must have shape \[D\]"),
        (dict(decay=torch.full((8,), 0.5)), r"decay is a log-space gate and must be <= 0"),
        (dict(window_bias=torch.zeros(3, 7)), r"window_bias must have shape \[W\] or \[W, D\]"),
        (dict(window_bias=torch.zeros(3, 8, 1)), r"window_bias must have shape \[W\] or \[W, D\]"),
        (dict(initial_state=(torch.zeros(1, 8),) * 4), r"initial_state must be a tuple of 7 tensors"),
        (dict(window_bias=None), r"initial_state must be a tuple of 4 tensors"),
        (dict(initial_state="state"), r"initial_state must be a tuple of 7"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, match):
    (q, k, v, decay, wb), state = make_inputs(4, "channel", W=3, D=8, B=1)
    args = dict(q=q, k=k, v=v, decay=decay, window_bias=wb, initial_state=state)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        aft(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_bad_state_tensor_and_mode_raise_value_error():
    (q, k, v, decay, wb), state = make_inputs(4, "channel", W=3, D=8, B=1)
    bad = (*state[:4], torch.zeros(1, 2, 8), *state[5:])
    with pytest.raises(ValueError, match=r"initial_state\[4\] \(key\) must have shape \[B, W, D\]"):
        aft(q, k, v, decay=decay, window_bias=wb, initial_state=bad)
    with pytest.raises(ValueError, match="mode must be one of"):
        aft(q, k, v, mode="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        aft(q, k, v, chunk_size=0)


def test_aft_full_matches_naive_with_gradients():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 8, generator=gen, requires_grad=True) for _ in range(3))
    w = torch.randn(48, 48, generator=gen, requires_grad=True)
    o, st = aft_full(q, k, v, w)
    assert st is None
    ref, _ = aft_full(q.double(), k.double(), v.double(), w.double(), mode="naive")
    assert_close("output", o, ref, 1e-5)
    for i, (a, b) in enumerate(zip(grads([o], [q, k, v, w]), grads([ref], [q, k, v, w]))):
        assert_close(f"grad {i}", a, b, 1e-5)


def test_aft_full_with_zero_biases_is_aft_without_decay():
    (q, k, v, _, _), _ = make_inputs(30, "none")
    with torch.no_grad():
        o, _ = aft_full(q, k, v, torch.zeros(30, 30))
        ref, _ = aft(q, k, v)
    assert_close("output", o, ref, 1e-5)


def test_aft_full_refuses_long_sequences_and_other_modes():
    q = torch.zeros(1, 10, 4)
    with pytest.raises(ValueError, match=r"w must have shape \[T_max, T_max\] with T_max >= T = 10"):
        aft_full(q, q, q, torch.zeros(8, 8))
    with pytest.raises(ValueError, match=r"w must have shape \[T_max, T_max\]"):
        aft_full(q, q, q, torch.zeros(16))
    with pytest.raises(ValueError, match="mode must be one of"):
        aft_full(q, q, q, torch.zeros(16, 16), mode="recurrent")
