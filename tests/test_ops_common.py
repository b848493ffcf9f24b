"""The gated linear recurrence: every mode against the float64 naive loop (outputs, state, gradients)."""

import pytest
import torch
import torch.nn.functional as F

from edgeattn.ops import gated_linear_attention
from tests.helpers import assert_close, grads

GATES = ("none", "head", "head_token", "key")


def make_inputs(B, T, H, K, V, gate, normalize, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if normalize:  # normalized attention needs positive features
        q, k = torch.sigmoid(q), torch.sigmoid(k)
    v = torch.randn(B, T, H, V, generator=gen)
    g = {
        "none": None,
        "head": torch.log(torch.rand(H, generator=gen) * 0.5 + 0.45),
        "head_token": F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2),
        "key": F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2),
    }[gate]
    S0 = torch.randn(B, H, K, V, generator=gen)
    init = (S0, torch.rand(B, H, K, generator=gen)) if normalize else S0
    cast = lambda x: x.to(dtype).requires_grad_()  # noqa: E731
    tensors = [cast(q), cast(k), cast(v), None if g is None else cast(g)]
    init = tuple(cast(s) for s in init) if normalize else cast(init)
    return tensors, init


def run(tensors, init, normalize, mode, dtype=None, chunk_size=64):
    q, k, v, g = tensors
    conv = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.to(dtype))
    state0 = tuple(conv(s) for s in init) if normalize else conv(init)
    o, st = gated_linear_attention(
        conv(q),
        conv(k),
        conv(v),
        conv(g),
        normalize=normalize,
        initial_state=state0,
        output_final_state=True,
        mode=mode,
        chunk_size=chunk_size,
    )
    outs = [o, *(st if normalize else (st,))]
    leaves = [t for t in (q, k, v, g) if t is not None] + list(init if normalize else (init,))
    return outs, grads(outs, leaves)


def check_against_naive(T, K, gate, normalize, mode, dtype=torch.float32, chunk_size=64):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    tensors, init = make_inputs(2, T, 2, K, K + 4, gate, normalize, dtype)
    ref_outs, ref_grads = run(tensors, init, normalize, "naive", dtype=torch.float64)
    outs, gs = run(tensors, init, normalize, mode, chunk_size=chunk_size)
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert_close(f"{mode} output {i}", a, b, tol)
    for i, (a, b) in enumerate(zip(gs, ref_grads)):
        assert_close(f"{mode} grad {i}", a, b, tol)


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("normalize", [False, True])
def test_modes_match_naive_float32(mode, gate, normalize):
    check_against_naive(65, 16, gate, normalize, mode)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("gate", ["head", "key"])
def test_chunk_awkward_lengths(T, gate):
    check_against_naive(T, 16, gate, False, "chunk")


@pytest.mark.parametrize("K", [16, 60, 64])
def test_chunk_head_sizes(K):
    check_against_naive(70, K, "key", True, "chunk", chunk_size=32)


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
@pytest.mark.parametrize("gate", ["none", "key"])
def test_modes_match_naive_bfloat16(mode, gate):
    check_against_naive(65, 16, gate, gate == "none", mode, dtype=torch.bfloat16)
    tensors, init = make_inputs(1, 9, 2, 16, 16, gate, False, torch.bfloat16)
    o, st = gated_linear_attention(*tensors, initial_state=init, output_final_state=True, mode=mode)
    assert o.dtype == torch.bfloat16 and st.dtype == torch.float32


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_split_and_continue_equals_whole(mode, split):
    (q, k, v, g), init = make_inputs(2, 130, 2, 16, 16, "key", True)
    kw = dict(normalize=True, output_final_state=True, mode=mode, chunk_size=32)
    o_full, s_full = gated_linear_attention(q, k, v, g, initial_state=init, **kw)
    o1, s1 = gated_linear_attention(
        q[:, :split], k[:, :split], v[:, :split], g[:, :split], initial_state=init, **kw
    )
    o2, s2 = gated_linear_attention(
        q[:, split:], k[:, split:], v[:, split:], g[:, split:], initial_state=s1, **kw
    )
    assert_close("output", torch.cat([o1, o2], 1), o_full, 1e-5)
    for a, b in zip(s2, s_full):
        assert_close("state", a, b, 1e-5)


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
def test_gates_down_to_minus_1e4_stay_finite_and_exact(mode):
    (q, k, v, _), S0 = make_inputs(1, 100, 2, 16, 16, "none", False)
    g = -1e4 * torch.rand(1, 100, 2, 16)
    g[:, ::7] = -0.01  # some tokens keep their memory
    o, S = gated_linear_attention(q, k, v, g, initial_state=S0, output_final_state=True, mode=mode)
    ref, Sref = gated_linear_attention(
        q.double(),
        k.double(),
        v.double(),
        g.double(),
        initial_state=S0.double(),
        output_final_state=True,
        mode="naive",
    )
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close("output", o, ref, 1e-5)
    assert_close("state", S, Sref, 1e-5)


def test_default_scale_and_no_state_by_default():
    (q, k, v, g), _ = make_inputs(1, 5, 1, 16, 8, "none", False)
    o, st = gated_linear_attention(q, k, v)
    assert st is None
    o2, _ = gated_linear_attention(q, k, v, scale=1.0)
    assert_close("scale", o * 4.0, o2, 1e-6)  # K ** -0.5 = 1/4


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda q, k, v: (q[0], k, v, None, None), r"q must have shape \[B, T, H, K\]"),
        (lambda q, k, v: (q, k[:, :, :1], v, None, None), r"k must have shape"),
        (lambda q, k, v: (q, k, v[..., :1, :], None, None), r"v must have shape"),
        (lambda q, k, v: (q, k, v, torch.full((3,), -0.1), None), r"g must have shape \[H\]"),
        (lambda q, k, v: (q, k, v, torch.full((2,), 0.5), None), r"g is a log-space gate and must be <= 0"),
        (
            lambda q, k, v: (q, k, v, None, torch.zeros(1, 2, 16, 3)),
            r"initial_state must have shape \[B, H, K, V\]",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(build, match):
    (q, k, v, _), _ = make_inputs(1, 4, 2, 16, 8, "none", False)
    q_, k_, v_, g_, s_ = build(q, k, v)
    with pytest.raises(ValueError, match=match):
        gated_linear_attention(q_, k_, v_, g_, initial_state=s_)
    with pytest.raises(ValueError, match="mode must be one of"):
        gated_linear_attention(q, k, v, mode="fast")


# ----------------------------------------------------------------------------------------------------------
# a log-gate of -inf: a hard reset, exact in every mode
# ----------------------------------------------------------------------------------------------------------


def _hard_reset_inputs(gate: str, T: int = 40, reset_at=(5, 23)):
    gen = torch.Generator().manual_seed(3)
    B, H, K, V = 1, 2, 8, 8
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    shape = (B, T, H) if gate == "head_token" else (B, T, H, K)
    g = F.logsigmoid(torch.randn(*shape, generator=gen) + 2)
    for t in reset_at:
        g[:, t] = float("-inf")
    if gate == "key" and T > 31:
        g[:, 31, 0, :3] = float("-inf")  # a reset of some key rows of one head only
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, S0


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk", "parallel"])
@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_minus_inf_gate_is_a_hard_reset_in_every_mode(mode, gate):
    """Compared with fla's own naive recurrences (exp(-inf) = 0 there), outputs, state and gradients."""
    fla_naive = pytest.importorskip(
        "fla.ops.simple_gla.naive" if gate == "head_token" else "fla.ops.gla.naive"
    )
    q, k, v, g, S0 = _hard_reset_inputs(gate)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    if gate == "head_token":
        ref_o, ref_S = fla_naive.naive_recurrent_simple_gla(
            *leaves, g.double(), initial_state=S0.double(), output_final_state=True
        )
    else:
        ref_o, ref_S = fla_naive.naive_recurrent_gla(
            *leaves, g.double(), initial_state=S0.double(), output_final_state=True
        )
    ref_grads = grads([ref_o, ref_S], leaves)

    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    o, S = gated_linear_attention(
        *mine, g, initial_state=S0, output_final_state=True, mode=mode, chunk_size=16
    )
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(f"{mode} output", o, ref_o, 1e-5)
    assert_close(f"{mode} state", S, ref_S, 1e-5)
    for name, a, b in zip("qkv", grads([o, S], mine), ref_grads):
        assert_close(f"{mode} grad {name}", a, b, 1e-5)
    # after a whole-head reset at t = 23 nothing before it matters: a changed prefix gives the same tail
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :23] = torch.randn_like(x[:, :23])
    o2, _ = gated_linear_attention(q2, k2, v2, g, initial_state=S0 * 7, mode=mode, chunk_size=16)
    torch.testing.assert_close(o2[:, 23:], o[:, 23:], rtol=1e-5, atol=1e-5)


def test_minus_inf_gate_gradient_is_finite_and_matches_naive():
    q, k, v, g, S0 = _hard_reset_inputs("key")
    ref_g = g.double().requires_grad_()
    ref = gated_linear_attention(
        q.double(), k.double(), v.double(), ref_g, initial_state=S0.double(), mode="naive"
    )
    (dref,) = grads([ref[0]], [ref_g])
    for mode in ("recurrent", "chunk", "parallel"):
        g_ = g.clone().requires_grad_()
        o, _ = gated_linear_attention(q, k, v, g_, initial_state=S0, mode=mode, chunk_size=16)
        (dg,) = grads([o], [g_])
        assert torch.isfinite(dg).all(), mode
        assert_close(f"{mode} grad g", dg, dref, 1e-5)


def test_minus_inf_gate_in_a_gla_layer():
    """A GLA layer whose gate resets at one token: the chunk forward equals stepping token by token."""
    from edgeattn.layers import gated  # noqa: F401  (registers the mixers)
    from edgeattn.layers.gated import GLA
    from tests.export_helpers import tiny_config

    layer = GLA(tiny_config("gla"), 0).eval()
    real_gate = layer.gate
    reset_at = 9

    def gate_with_reset(x):
        g = real_gate(x).clone()
        if x.shape[1] > 1:
            g[:, reset_at] = float("-inf")
        elif gate_with_reset.t == reset_at:
            g[:] = float("-inf")
        return g

    gate_with_reset.t = 0
    layer.gate = gate_with_reset
    x = torch.randn(1, 37, 32)
    with torch.no_grad():
        full, state = layer(x)
        outs, st = [], None
        for t in range(x.shape[1]):
            gate_with_reset.t = t
            o, st = layer(x[:, t : t + 1], st)
            outs.append(o)
    assert torch.isfinite(full).all()
    assert_close("layer output", full, torch.cat(outs, 1), 1e-5)
    assert_close("layer state", state["recurrent_state"], st["recurrent_state"], 1e-5)


@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_minus_inf_gate_through_the_triton_kernel(gate):
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    q, k, v, g, S0 = _hard_reset_inputs(gate, T=20, reset_at=(5,))
    if gate == "key":
        g[:, 13, 1, :2] = float("-inf")
    ref, ref_S = gated_linear_attention(
        q.double(),
        k.double(),
        v.double(),
        g.double(),
        initial_state=S0.double(),
        output_final_state=True,
        mode="naive",
    )
    o, S = gated_linear_attention(
        q, k, v, g, initial_state=S0, output_final_state=True, chunk_size=16, backend="triton"
    )
    assert_close("triton output", o, ref, 1e-4)
    assert_close("triton state", S, ref_S, 1e-4)
