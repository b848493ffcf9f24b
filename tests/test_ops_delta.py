"""The delta rule: every mode against the float64 naive loop (outputs, state, gradients), against
fla-core's own PyTorch references, continuation, extreme gates, bad inputs and ONNX export of the step."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from edgeattn.ops import delta_rule, delta_rule_step
from tests.helpers import assert_close, grads

GATES = ("none", "head", "key")


def make_inputs(B, T, H, HV, K, V, gate, dtype=torch.float32, seed=0):
    """Unit keys (as every delta-rule layer feeds it; the recurrence is a contraction only then)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen) * 2
    g = {
        "none": None,
        "head": F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2),
        "key": F.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + 2),
    }[gate]
    S0 = torch.randn(B, HV, K, V, generator=gen)
    cast = lambda x: None if x is None else x.to(dtype).requires_grad_()  # noqa: E731
    return [cast(x) for x in (q, k, v, beta, g)], cast(S0)


def run(tensors, S0, mode, dtype=None, chunk_size=64, **kw):
    conv = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.to(dtype))
    q, k, v, beta, g = tensors
    o, S = delta_rule(
        *(conv(x) for x in (q, k, v, beta, g)),
        initial_state=conv(S0),
        output_final_state=True,
        mode=mode,
        chunk_size=chunk_size,
        **kw,
    )
    leaves = [x for x in tensors if x is not None] + [S0]
    return [o, S], grads([o, S], leaves)


def check_against_naive(T, K, gate, mode, *, H=1, HV=1, dtype=torch.float32, chunk_size=64, B=2):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    tensors, S0 = make_inputs(B, T, H, HV, K, K + 4, gate, dtype)
    ref_outs, ref_grads = run(tensors, S0, "naive", dtype=torch.float64)
    outs, gs = run(tensors, S0, mode, chunk_size=chunk_size)
    assert outs[0].dtype == dtype and outs[1].dtype == torch.float32
    for name, a, b in zip(("output", "state"), outs, ref_outs):
        assert_close(f"{mode} {name}", a, b, tol)
    names = ["q", "k", "v", "beta"] + (["g"] if gate != "none" else []) + ["initial_state"]
    for name, a, b in zip(names, gs, ref_grads):
        assert_close(f"{mode} grad {name}", a, b, tol)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("ratio", [1, 2])
def test_modes_match_naive_float32(mode, gate, ratio):
    check_against_naive(65, 16, gate, mode, H=2, HV=2 * ratio, B=1)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("gate", ["head", "key"])
def test_chunk_awkward_lengths(T, gate):
    check_against_naive(T, 16, gate, "chunk", HV=2, B=1)


@pytest.mark.parametrize("K", [16, 64, 128])
@pytest.mark.parametrize("gate", GATES)
def test_chunk_head_sizes(K, gate):
    check_against_naive(40, K, gate, "chunk", H=1, HV=2, chunk_size=16, B=1)


@pytest.mark.slow
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_big_heads_long_sequences(K, gate, mode):
    check_against_naive(500, K, gate, mode, H=2, HV=4)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 100])
def test_any_chunk_size(chunk_size):
    check_against_naive(50, 16, "key", "chunk", H=1, HV=2, chunk_size=chunk_size, B=1)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("gate", ["none", "key"])
def test_modes_match_naive_bfloat16(mode, gate):
    check_against_naive(65, 16, gate, mode, H=1, HV=2, dtype=torch.bfloat16, B=1)


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_split_and_continue_equals_whole(mode, split):
    (q, k, v, beta, g), S0 = make_inputs(1, 130, 1, 2, 16, 16, "key")
    kw = dict(output_final_state=True, mode=mode, chunk_size=32)
    o, S = delta_rule(q, k, v, beta, g, initial_state=S0, **kw)
    a, b = slice(None, split), slice(split, None)
    o1, S1 = delta_rule(q[:, a], k[:, a], v[:, a], beta[:, a], g[:, a], initial_state=S0, **kw)
    o2, S2 = delta_rule(q[:, b], k[:, b], v[:, b], beta[:, b], g[:, b], initial_state=S1, **kw)
    assert_close("output", torch.cat([o1, o2], 1), o, 1e-5)
    assert_close("state", S2, S, 1e-5)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("gate", ["head", "key"])
def test_gates_down_to_minus_1e4_stay_finite_and_exact(mode, gate):
    (q, k, v, beta, _), S0 = make_inputs(1, 100, 1, 2, 16, 16, "none")
    shape = (1, 100, 2) if gate == "head" else (1, 100, 2, 16)
    g = -1e4 * torch.rand(*shape)
    g[:, ::7] = -0.01  # some tokens keep their memory
    g.requires_grad_()
    (o, S), gs = run([q, k, v, beta, g], S0, mode)
    (ref, Sref), ref_gs = run([q, k, v, beta, g], S0, "naive", dtype=torch.float64)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close("output", o, ref, 1e-5)
    assert_close("state", S, Sref, 1e-5)
    for i, (a, b) in enumerate(zip(gs, ref_gs)):
        assert_close(f"grad {i}", a, b, 1e-5)


def test_default_scale_and_no_state_by_default():
    (q, k, v, beta, _), _ = make_inputs(1, 5, 1, 1, 16, 8, "none")
    o, S = delta_rule(q, k, v, beta)
    assert S is None and o.shape == (1, 5, 1, 8)
    o2, _ = delta_rule(q, k, v, beta, scale=1.0)
    assert_close("scale", o * 4.0, o2, 1e-6)  # K ** -0.5 = 1/4


def test_value_heads_share_key_heads_by_repeat_interleave():
    """HV = 2H equals HV = H calls with each key head repeated for its value heads (0, 0, 1, 1)."""
    (q, k, v, beta, g), S0 = make_inputs(1, 20, 2, 4, 16, 8, "key")
    o, S = delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True)
    rep = [0, 0, 1, 1]
    o_ref, S_ref = delta_rule(
        q[:, :, rep], k[:, :, rep], v, beta, g, initial_state=S0, output_final_state=True
    )
    assert_close("output", o, o_ref, 1e-6)
    assert_close("state", S, S_ref, 1e-6)


# ---- fla-core's PyTorch references, same inputs --------------------------------------------------

fla_delta = pytest.importorskip("fla.ops.delta_rule.naive")
fla_gated = pytest.importorskip("fla.ops.gated_delta_rule.naive")
fla_kda = pytest.importorskip("fla.ops.kda.naive")


def compare_with_fla(ours, theirs, leaves, tol=1e-5):
    """Outputs, final state and the gradients of every leaf."""
    for name, a, b in zip(("output", "state"), ours, theirs):
        assert_close(f"fla {name}", a, b, tol)
    for i, (a, b) in enumerate(zip(grads(ours, leaves), grads(theirs, leaves))):
        assert_close(f"fla grad {i}", a, b, tol)


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
def test_deltanet_matches_fla_delta_rule_recurrence(mode):
    """fla's DeltaNet reference is head-first ([B, H, T, K]) and always scales q by K ** -0.5."""
    (q, k, v, beta, _), S0 = make_inputs(2, 70, 2, 2, 16, 12, "none")
    ours = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, mode=mode, chunk_size=16)
    hf = lambda x: x.transpose(1, 2)  # noqa: E731
    o, S = fla_delta.delta_rule_recurrence(hf(q), hf(k), hf(v), hf(beta), initial_state=S0)
    compare_with_fla(list(ours), [hf(o), S], [q, k, v, beta, S0])


def test_deltanet_chunk_matches_fla_delta_rule_chunkwise():
    """fla's chunkwise DeltaNet reference: no initial state, T a multiple of its chunk size."""
    (q, k, v, beta, _), _ = make_inputs(1, 64, 2, 2, 16, 12, "none")
    ours = delta_rule(q, k, v, beta, output_final_state=True, chunk_size=64)
    hf = lambda x: x.transpose(1, 2)  # noqa: E731
    o, S = fla_delta.delta_rule_chunkwise(hf(q), hf(k), hf(v), hf(beta), chunk_size=16)
    compare_with_fla(list(ours), [hf(o), S], [q, k, v, beta])


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
def test_gated_deltanet_matches_fla_naive_recurrent_gated_delta_rule(mode):
    (q, k, v, beta, g), S0 = make_inputs(2, 70, 2, 2, 16, 12, "head")
    ours = delta_rule(
        q, k, v, beta, g, scale=0.3, initial_state=S0, output_final_state=True, mode=mode, chunk_size=32
    )
    theirs = fla_gated.naive_recurrent_gated_delta_rule(
        q, k, v, beta, g, scale=0.3, initial_state=S0, output_final_state=True
    )
    compare_with_fla(list(ours), list(theirs), [q, k, v, beta, g, S0])


def test_gated_deltanet_chunk_matches_fla_naive_chunk_gated_delta_rule():
    (q, k, v, beta, g), S0 = make_inputs(1, 70, 2, 2, 16, 12, "head")
    ours = delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True, chunk_size=32)
    theirs = fla_gated.naive_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=16, initial_state=S0, output_final_state=True
    )
    compare_with_fla(list(ours), list(theirs), [q, k, v, beta, g, S0])


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_kda_matches_fla_naive_recurrent_kda(mode, ratio):
    """KDA with more value heads than key heads (fla's GVA layout, repeat_interleave)."""
    (q, k, v, beta, g), S0 = make_inputs(2, 70, 2, 2 * ratio, 16, 12, "key")
    ours = delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True, mode=mode, chunk_size=32)
    theirs = fla_kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    compare_with_fla(list(ours), list(theirs), [q, k, v, beta, g, S0])


def test_kda_chunk_matches_fla_naive_chunk_kda():
    (q, k, v, beta, g), S0 = make_inputs(1, 64, 2, 4, 16, 12, "key")
    ours = delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True, chunk_size=16)
    theirs = fla_kda.naive_chunk_kda(
        q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=32
    )
    compare_with_fla(list(ours), list(theirs), [q, k, v, beta, g, S0])


# ---- bad input ------------------------------------------------------------------------------------


def _bad(name):
    (q, k, v, beta, g), S0 = make_inputs(1, 4, 2, 4, 16, 8, "head")
    args = dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=S0)
    return {
        "q rank": (dict(args, q=q[0]), r"q must have shape \[B, T, H, K\]"),
        "k shape": (dict(args, k=k[:, :, :1]), r"k must have shape \[B, T, H, K\]"),
        "v rank": (dict(args, v=v[0]), r"v must have shape \[B, T, HV, V\]"),
        "v time": (dict(args, v=v[:, :2]), r"v must have shape \[B, T, HV, V\]"),
        "HV not a multiple": (
            dict(args, v=v[:, :, :3]),
            r"v must have shape \[B, T, HV, V\] with HV a multiple of H = 2",
        ),
        "HV below H": (dict(args, v=v[:, :, :1]), r"HV a multiple of H = 2"),
        "beta shape": (dict(args, beta=beta[..., :2]), r"beta must have shape \[B, T, HV\]"),
        "beta above 2": (dict(args, beta=beta.detach() + 2.5), r"beta must lie in \[0, 2\]"),
        "beta negative": (dict(args, beta=-beta.detach()), r"beta must lie in \[0, 2\]"),
        "g positive": (dict(args, g=-g.detach() + 0.1), r"g is a log-space gate and must be <= 0"),
        "g shape": (dict(args, g=g[..., :2]), r"g must have shape \[B, T, HV\]"),
        "g key shape": (dict(args, g=torch.zeros(1, 4, 4, 3)), r"g must have shape \[B, T, HV, K\]"),
        "g rank": (dict(args, g=torch.zeros(4)), r"g must have shape \[B, T, HV\] or \[B, T, HV, K\]"),
        "state shape": (
            dict(args, initial_state=S0[:, :2]),
            r"initial_state must have shape \[B, HV, K, V\]",
        ),
    }[name]


@pytest.mark.parametrize(
    "name",
    [
        "q rank",
        "k shape",
        "v rank",
        "v time",
        "HV not a multiple",
        "HV below H",
        "beta shape",
        "beta above 2",
        "beta negative",
        "g positive",
        "g shape",
        "g key shape",
        "g rank",
        "state shape",
    ],
)
def test_bad_arguments_raise_value_error_naming_them(name):
    args, match = _bad(name)
    with pytest.raises(ValueError, match=match):
        delta_rule(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("beta"), args.pop("g"), **args)


def test_bad_mode_and_chunk_size():
    (q, k, v, beta, _), _ = make_inputs(1, 4, 1, 1, 16, 8, "none")
    with pytest.raises(ValueError, match="mode must be one of"):
        delta_rule(q, k, v, beta, mode="parallel")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        delta_rule(q, k, v, beta, chunk_size=0)


def test_triton_backend_without_the_kernel_is_a_value_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setitem(sys.modules, "edgeattn.kernels", types.ModuleType("edgeattn.kernels"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (q, k, v, beta, _), _ = make_inputs(1, 4, 1, 1, 16, 8, "none")
    with pytest.raises(ValueError, match="Triton delta-rule kernel is not available"):
        delta_rule(q, k, v, beta, backend="triton")


# ---- export ---------------------------------------------------------------------------------------


class _Step(torch.nn.Module):
    def forward(self, q, k, v, beta, g, state):
        return delta_rule_step(q, k, v, beta, g, state, scale=0.25)


class _Chunk(torch.nn.Module):
    def forward(self, q, k, v, beta, g, state):
        return delta_rule(q, k, v, beta, g, initial_state=state, output_final_state=True, chunk_size=8)


@pytest.mark.parametrize("gate", ["head", "key"])
@pytest.mark.parametrize("form", ["step", "chunk"])
def test_step_and_chunk_export_to_onnx_opset17(tmp_path, gate, form):
    """The step graph (one token) and the chunk form (prefill) trace to plain opset-17 ops with no
    float64, and ONNX Runtime reproduces PyTorch."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    (q, k, v, beta, g), S0 = (
        [None if x is None else x.detach() for x in xs] if isinstance(xs, list) else xs.detach()
        for xs in make_inputs(1, 20, 2, 4, 16, 8, gate)
    )
    if form == "step":
        args, module = (q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], S0), _Step()
    else:
        args, module = (q, k, v, beta, g, S0), _Chunk()
    names = ["q", "k", "v", "beta", "g", "state"]
    path = tmp_path / "graph.onnx"
    torch.onnx.export(
        module, args, str(path), dynamo=False, opset_version=17, input_names=names, output_names=["o", "S"]
    )
    model = onnx.load(str(path))
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Loop", "Scan", "If"}, ops
    doubles = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.DOUBLE]
    casts = [
        n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.DOUBLE
    ]
    assert not doubles and not casts
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {n: a.numpy() for n, a in zip(names, args)})
    want = module(*args)
    for name, a, b in zip(("o", "S"), got, want):
        assert_close(name, torch.from_numpy(a), b, 1e-5)


def test_traceable_substitution_inverse_equals_solve_triangular():
    """The chunk form's triangular inverse: the row-by-row substitution (used while tracing for ONNX)
    against torch.linalg.solve_triangular (used in PyTorch), values and gradients."""
    from edgeattn.ops.delta.chunk import substitution_inverse, unit_lower_inverse

    gen = torch.Generator().manual_seed(0)
    L = (torch.randn(2, 3, 64, 64, generator=gen, dtype=torch.float64) * 0.2).tril(-1).requires_grad_()
    a, b = substitution_inverse(L), unit_lower_inverse(L)
    eye = torch.eye(64, dtype=torch.float64)
    assert_close("inverse", (eye + L) @ a, eye.expand(2, 3, 64, 64), 1e-12)
    assert_close("inverse", a, b, 1e-12)
    for i, (x, y) in enumerate(zip(grads([a], [L]), grads([b], [L]))):
        assert_close(f"grad {i}", x.tril(-1), y.tril(-1), 1e-10)
