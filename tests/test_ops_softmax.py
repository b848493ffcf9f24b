"""Causal softmax attention: every mode against the float64 naive loop (outputs, state, gradients),
continuation from any state, the attended set itself, the exportable window step, bad arguments."""

import pytest
import torch

from edgeattn.ops.softmax import WindowCache, softmax_attention, window_step
from tests.helpers import assert_close, grads

MODES = ("recurrent", "chunk", "parallel")

# name -> (window, sink)
CONFIGS = {
    "full": (None, 0),
    "window": (16, 0),
    "window_sinks": (16, 4),
    "window_over_T": (600, 4),  # larger than every sequence here
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The shapes here are tiny: a second intra-op thread only waits, and on a shared machine a
    waiting thread makes these tests ten times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_qkv(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=gen) for D in (K, K, V)]


def make_state(config, prefixes, H, K, V, seed=1):
    """A real state: the naive form run over ``prefixes[b]`` random tokens for each sequence b (their
    positions differ when the prefixes do), as float32 leaves. None when every prefix is empty."""
    window, sink = CONFIGS[config]
    if not any(prefixes):
        return None
    parts = []
    for b, n in enumerate(prefixes):
        q, k, v = (x.double() for x in make_qkv(1, n, H, K, V, seed + b))
        parts.append(
            softmax_attention(q, k, v, window=window, sink=sink, output_final_state=True, mode="naive")[1]
        )
    state = [torch.cat(ts).float() for ts in zip(*parts)]
    for s in state[:4]:  # key, value and the sinks are differentiable; the position is a counter
        s.requires_grad_(s.numel() > 0)
    return type(parts[0])(*state)


def run(qkv, state, config, mode, dtype=None):
    """Outputs (o and every state tensor) and their gradients w.r.t. q, k, v and the state leaves."""
    window, sink = CONFIGS[config]
    conv = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    st0 = None if state is None else type(state)(*(conv(s) for s in state))
    o, st = softmax_attention(
        *(conv(x) for x in qkv),
        window=window,
        sink=sink,
        initial_state=st0,
        output_final_state=True,
        mode=mode,
    )
    outs = [o, *st]
    leaves = list(qkv) + [s for s in (state or ()) if s.requires_grad]
    return outs, grads(outs, leaves)


def check_against_naive(config, mode, T, K=16, prefixes=(37, 5), dtype=torch.float32, B=2, H=2):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if CONFIGS[config][0] is None:
        prefixes = (prefixes[0],) * B  # one cache length for the batch
    qkv = [x.to(dtype).requires_grad_() for x in make_qkv(B, T, H, K, K + 4)]
    state = make_state(config, prefixes[:B], H, K, K + 4)
    ref_outs, ref_grads = run(qkv, state, config, "naive", dtype=torch.float64)
    outs, gs = run(qkv, state, config, mode)
    assert outs[0].dtype == dtype and all(s.dtype == torch.float32 for s in outs[1:])
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        if b.numel():
            assert_close(f"{mode} output {i}", a, b, tol)
    assert len(gs) == len(ref_grads)
    for i, (a, b) in enumerate(zip(gs, ref_grads)):
        assert (a is None) == (b is None), f"{mode} grad {i}: reached in one form only"
        if b is not None:
            assert_close(f"{mode} grad {i}", a, b, tol)


@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_naive_from_a_state_float32(mode, config, T):
    check_against_naive(config, mode, T)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_naive_from_scratch_float32(mode, config):
    check_against_naive(config, mode, 70, prefixes=(0, 0))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_naive_head_size_60(mode, config):
    check_against_naive(config, mode, 65, K=60, prefixes=(3, 20))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_long_sequence_500_matches_naive(mode, config):
    check_against_naive(config, mode, 500, prefixes=(0,), B=1)


def test_long_sequence_500_recurrent_window_step_matches_naive():
    check_against_naive("window_sinks", "recurrent", 500, prefixes=(7,), B=1, H=1)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_naive_bfloat16(mode, config):
    check_against_naive(config, mode, 65, dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["naive", *MODES])
@pytest.mark.parametrize(
    "window, sink, prefix",
    [(None, 0, 0), (None, 0, 9), (1, 0, 0), (5, 0, 0), (5, 3, 0), (5, 3, 2), (4, 2, 20)],
)
def test_attended_set_is_the_definition(mode, window, sink, prefix):
    """q = 0 makes every attended token weigh the same and v_i = e_i names it, so o_t[i] must be
    1 / |A(t)| for i in A(t) = {t - W < i <= t} | {i < S, i <= t} and 0 elsewhere."""
    T = 12
    n = prefix + T
    eye = torch.eye(n, dtype=torch.float64).view(1, n, 1, n)
    key = torch.zeros(1, n, 1, 4, dtype=torch.float64)
    kw = dict(window=window, sink=sink)
    state = None
    if prefix:  # the first tokens come from a state
        before = (key[:, :prefix], key[:, :prefix], eye[:, :prefix])
        _, state = softmax_attention(*before, output_final_state=True, mode="naive", **kw)
    o, _ = softmax_attention(
        key[:, prefix:], key[:, prefix:], eye[:, prefix:], initial_state=state, mode=mode, **kw
    )
    want = torch.zeros(T, n, dtype=torch.float64)
    for t in range(prefix, n):
        A = [i for i in range(t + 1) if window is None or i > t - window or i < sink]
        want[t - prefix, A] = 1.0 / len(A)
    assert_close(f"{mode} attention weights", o[0, :, 0], want, 1e-6)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_split_and_continue_equals_whole(mode, config, split):
    window, sink = CONFIGS[config]
    q, k, v = make_qkv(2, 130, 2, 16, 8)
    kw = dict(window=window, sink=sink, output_final_state=True, mode=mode)
    o_full, s_full = softmax_attention(q, k, v, **kw)
    o1, s1 = softmax_attention(q[:, :split], k[:, :split], v[:, :split], **kw)
    o2, s2 = softmax_attention(q[:, split:], k[:, split:], v[:, split:], initial_state=s1, **kw)
    assert_close("output", torch.cat([o1, o2], 1), o_full, 1e-5)
    for name, a, b in zip(s_full._fields, s2, s_full):
        if b.numel():
            assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize("config", ["full", "window_sinks"])
@pytest.mark.parametrize(
    "first, then", [("chunk", "recurrent"), ("recurrent", "parallel"), ("parallel", "chunk")]
)
def test_a_state_from_one_mode_continues_in_another(config, first, then):
    window, sink = CONFIGS[config]
    q, k, v = make_qkv(2, 90, 2, 16, 8)
    kw = dict(window=window, sink=sink, output_final_state=True)
    ref, _ = softmax_attention(q.double(), k.double(), v.double(), mode="naive", **kw)
    o1, s1 = softmax_attention(q[:, :50], k[:, :50], v[:, :50], mode=first, **kw)
    o2, _ = softmax_attention(q[:, 50:], k[:, 50:], v[:, 50:], initial_state=s1, mode=then, **kw)
    assert_close(f"{first} then {then}", torch.cat([o1, o2], 1), ref, 1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_window_state_has_a_fixed_size(mode):
    q, k, v = make_qkv(1, 300, 2, 8, 8)
    _, st = softmax_attention(q, k, v, window=16, sink=4, output_final_state=True, mode=mode)
    shapes = [tuple(s.shape) for s in st]
    assert shapes == [(1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 4, 8), (1, 2, 4, 8), (1,)]
    assert st.position.item() == 300.0 and all(s.dtype == torch.float32 for s in st)
    _, full = softmax_attention(q, k, v, output_final_state=True, mode=mode)
    assert full.key.shape == (1, 2, 300, 8)


@pytest.mark.parametrize("mode", ["naive", *MODES])
def test_no_tokens_pass_the_state_through(mode):
    q, k, v = make_qkv(1, 0, 2, 8, 4)
    state = make_state("window_sinks", (9,), 2, 8, 4)
    o, st = softmax_attention(
        q, k, v, window=16, sink=4, initial_state=state, output_final_state=True, mode=mode
    )
    assert o.shape == (1, 0, 2, 4) and all(torch.equal(a, b) for a, b in zip(st, state))


def test_window_one_attends_to_the_token_itself():
    q, k, v = make_qkv(2, 40, 2, 8, 8)
    for mode in ("naive", *MODES):
        o, _ = softmax_attention(q, k, v, window=1, mode=mode)
        assert_close(mode, o, v, 1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_window_step_traces_once_for_every_position():
    """Traced at position 0, the step graph must serve every later position: nothing about the position
    may be baked in (no branches on tensor values), and the graph holds no control flow."""
    B, H, K, W, S = 2, 2, 8, 6, 3
    q, k, v = make_qkv(B, 30, H, K, K)
    zeros = WindowCache(*(torch.zeros(B, H, n, K) for n in (W, W, S, S)), torch.zeros(B))
    traced = torch.jit.trace(lambda *a: window_step(*a, scale=0.3), (q[:, 0], k[:, 0], v[:, 0], *zeros))
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert not kinds & {"prim::If", "prim::Loop"}, kinds
    state, outs = zeros, []
    for t in range(30):
        o, *state = traced(q[:, t], k[:, t], v[:, t], *state)
        outs.append(o)
    ref, ref_state = softmax_attention(
        q.double(), k.double(), v.double(), scale=0.3, window=W, sink=S, output_final_state=True, mode="naive"
    )
    assert_close("traced step", torch.stack(outs, 1), ref, 1e-5)
    for name, a, b in zip(WindowCache._fields, state, ref_state):
        assert_close(name, a, b, 1e-6)


def test_window_step_leaves_its_inputs_untouched():
    B, H, K = 1, 2, 8
    q, k, v = (x[:, 0] for x in make_qkv(B, 1, H, K, K))
    state = WindowCache(*(torch.randn(B, H, n, K) for n in (5, 5, 2, 2)), torch.tensor([7.0]))
    before = [s.clone() for s in state]
    window_step(q, k, v, *state, scale=1.0)
    assert all(torch.equal(a, b) for a, b in zip(state, before))


def test_default_scale_and_no_state_by_default():
    q, k, v = make_qkv(1, 5, 1, 16, 8)
    o, st = softmax_attention(q, k, v)
    assert st is None
    o2, _ = softmax_attention(q * 0.25, k, v, scale=1.0)  # K ** -0.5 = 1/4
    assert_close("scale", o, o2, 1e-6)


def _window_state(B=1, H=2, K=16, V=8, W=4, S=2):
    return WindowCache(
        torch.zeros(B, H, W, K),
        torch.zeros(B, H, W, V),
        torch.zeros(B, H, S, K),
        torch.zeros(B, H, S, V),
        torch.zeros(B),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=lambda q: q[0]), r"q must have shape \[B, T, H, K\]"),
        (dict(k=lambda k: k[:, :, :1]), r"k must have shape \[B, T, H, K\] \(as q\)"),
        (dict(v=lambda v: v[:, :3]), r"v must have shape \[B, T, H, V\]"),
        (dict(window=0), r"window must be None \(full attention\) or an int >= 1"),
        (dict(window=2.5), r"window must be None"),
        (dict(window=4, sink=-1), r"sink must be an int >= 0"),
        (dict(sink=2), r"sink=2 needs a window"),
        (dict(mode="fast"), r"mode must be one of"),
        (dict(initial_state=_window_state()), r"initial_state must be a KV cache \(key \[B, H, L, K\]"),
        (
            dict(window=4, sink=2, initial_state=(torch.zeros(1, 2, 3, 16),) * 2),
            r"initial_state must be a window",
        ),
        (
            dict(initial_state=(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 4, 8))),
            r"initial_state.value must have",
        ),
        (
            dict(initial_state=(torch.zeros(1, 3, 3, 16), torch.zeros(1, 3, 3, 8))),
            r"initial_state.key must have",
        ),
        (
            dict(window=5, sink=2, initial_state=_window_state()),
            r"initial_state.key must have shape \[B, H, W, K\]",
        ),
        (dict(window=4, sink=1, initial_state=_window_state()), r"initial_state.sink_key must have shape"),
        (
            dict(window=4, sink=2, initial_state=_window_state()._replace(position=torch.zeros(1, 1))),
            r"initial_state.position must have shape \[B\]",
        ),
        (
            dict(window=4, sink=2, initial_state=_window_state()._replace(position=torch.tensor([1.5]))),
            r"initial_state.position must hold token counts",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, match):
    q, k, v = make_qkv(1, 4, 2, 16, 8)
    args = dict(q=q, k=k, v=v)
    kwargs = {}
    for name, value in change.items():
        if name in args:
            args[name] = value(args[name])
        else:
            kwargs[name] = value
    with pytest.raises(ValueError, match=match):
        softmax_attention(args["q"], args["k"], args["v"], **kwargs)
