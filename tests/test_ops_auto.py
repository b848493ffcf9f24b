"""``mode="auto"``: each family op picks its form in one place (``edgeattn.ops.backend.choose_form``): the
single-token step for T == 1, the chunk form otherwise, ONNX Runtime's contrib op while the export for the
onnxruntime target traces. Each form is spied on to prove it ran, its result checked against the explicit
forms and the float64 naive loop, and the contrib form exported and run by ONNX Runtime; and the ops never
load the export code.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import edgeattn.ops.common as common
import edgeattn.ops.conv as conv
import edgeattn.ops.delta as delta
import edgeattn.ops.flash as flash_ops
import edgeattn.ops.lsh as lsh_ops
import edgeattn.ops.softmax as softmax_ops
from edgeattn.export.contrib import fused_onnxruntime_op
from edgeattn.ops import delta_rule, gated_linear_attention, short_conv
from edgeattn.ops.aft import aft
from edgeattn.ops.delta import gated_delta_gates
from edgeattn.ops.flash import mixed_chunk_attention
from edgeattn.ops.lsh import lsh_attention, lsh_rotations
from edgeattn.ops.norm import gated_rms_norm
from edgeattn.ops.rff import gaussian_projection, rff_recurrence, rff_softmax_features
from edgeattn.ops.softmax import softmax_attention
from tests.helpers import assert_close
from tests.test_ops_common import make_inputs

aft_ops = importlib.import_module("edgeattn.ops.aft")  # the module, not edgeattn.ops.aft the function

B, H, K, V = 2, 2, 8, 6


def inputs(T: int, gate: str, seed: int = 0):
    """The gated recurrence's inputs of tests/test_ops_common.py, without gradients: q, k, v, g, S0."""
    (q, k, v, g), S0 = make_inputs(B, T, H, K, V, gate, normalize=False, seed=seed)
    return tuple(None if x is None else x.detach() for x in (q, k, v, g, S0))


def spy(monkeypatch, module, name: str, calls: list):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def f64(*xs):
    return [None if x is None else x.double() for x in xs]


def gla_reference(q, k, v, g, S0, normalize):
    init = (S0.double(), S0[..., 0].abs().double()) if normalize else S0.double()
    return gated_linear_attention(
        *f64(q, k, v, g), normalize=normalize, initial_state=init, output_final_state=True, mode="naive"
    )


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("gate", ["none", "head", "head_token", "key"])
@pytest.mark.parametrize("T, form", [(1, "gated_recurrence_step"), (9, "chunk_gated_recurrence")])
def test_gated_linear_attention_auto_runs_the_step_for_one_token_and_the_chunk_form_otherwise(
    monkeypatch, T, form, gate, normalize
):
    q, k, v, g, S0 = inputs(T, gate)
    if normalize:
        q, k = torch.sigmoid(q), torch.sigmoid(k)
    calls = []
    for name in ("gated_recurrence_step", "chunk_gated_recurrence"):
        spy(monkeypatch, common, name, calls)
    init = (S0, S0[..., 0].abs()) if normalize else S0
    o, st = gated_linear_attention(
        q, k, v, g, normalize=normalize, initial_state=init, output_final_state=True, mode="auto"
    )
    assert calls == [form]
    ref_o, ref_st = gla_reference(q, k, v, g, S0, normalize)
    assert o.dtype == q.dtype
    assert_close("o", o, ref_o, 1e-5)
    for got, ref in zip(st if normalize else [st], ref_st if normalize else [ref_st]):
        assert_close("state", got, ref, 1e-5)


@pytest.mark.parametrize("gate", ["none", "head_token", "key"])
@pytest.mark.parametrize("T, form", [(1, "delta_rule_step"), (9, "chunk_delta_rule")])
def test_delta_rule_auto_runs_the_step_for_one_token_and_the_chunk_form_otherwise(monkeypatch, T, form, gate):
    q, k, v, g, S0 = inputs(T, gate)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=torch.Generator().manual_seed(1))
    calls = []
    for name in ("delta_rule_step", "chunk_delta_rule"):
        spy(monkeypatch, delta, name, calls)
    o, S = delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True, mode="auto")
    assert calls == [form]
    ref_o, ref_S = delta_rule(
        *f64(q, k, v, beta, g), initial_state=S0.double(), output_final_state=True, mode="naive"
    )
    assert_close("o", o, ref_o, 1e-5)
    assert_close("state", S, ref_S, 1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T, form", [(1, "short_conv_step"), (9, "chunk_short_conv")])
def test_short_conv_auto_runs_the_step_for_one_token_and_the_chunk_form_otherwise(monkeypatch, T, form, bias):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(B, T, 12, generator=gen), torch.randn(12, 4, generator=gen)
    b, S0 = torch.randn(12, generator=gen) if bias else None, torch.randn(B, 12, 3, generator=gen)
    calls = []
    for name in ("short_conv_step", "chunk_short_conv"):
        spy(monkeypatch, conv, name, calls)
    y, S = short_conv(x.bfloat16(), w, b, initial_state=S0, output_final_state=True, mode="auto")
    assert calls == [form]
    assert y.dtype == torch.float32  # "auto" returns float32 in every form, as the step and the contrib op
    ref_y, ref_S = short_conv(
        *f64(x.bfloat16(), w, b), initial_state=S0.double(), output_final_state=True, mode="naive"
    )
    assert_close("y", y, ref_y, 1e-5)
    assert_close("state", S, ref_S, 1e-5)


def f64_tree(x):
    """Every floating tensor in x (a tensor, tuple, named tuple or dict) as float64."""
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {n: f64_tree(y) for n, y in x.items()}
    if isinstance(x, tuple):
        items = [f64_tree(y) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    return x


def aft_inputs(T, gen):
    fixed = torch.Generator().manual_seed(10)
    kw = dict(decay=-torch.rand(6, generator=fixed), window_bias=torch.randn(3, 6, generator=fixed))
    return tuple(torch.randn(B, T, 6, generator=gen) for _ in range(3)), kw


def flash_inputs(T, gen):
    fixed = torch.Generator().manual_seed(11)
    kw = dict(chunk_size=4, rel_bias=torch.randn(4, generator=fixed))
    return (*(torch.randn(B, T, 5, generator=gen) for _ in range(4)), torch.randn(B, T, 7, generator=gen)), kw


def lsh_inputs(T, gen):
    q = torch.randn(B, T, H, K, generator=gen)
    rotations = lsh_rotations(K, 4, 2, torch.Generator().manual_seed(12))
    kw = dict(rotations=rotations, bucket_size=None, exclude_self=True)
    return (q, F.normalize(q, dim=-1), torch.randn(B, T, H, V, generator=gen)), kw


def softmax_inputs(window):
    def inputs(T, gen):
        q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
        kw = {} if window is None else dict(window=window, sink=2)
        return (q, k, torch.randn(B, T, H, V, generator=gen)), kw

    return inputs


def rff_inputs(T, gen):
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    fq, fk = rff_softmax_features(q, k, gaussian_projection(5, K, torch.Generator().manual_seed(13)))
    return (fq, fk, torch.randn(B, T, H, V, generator=gen)), dict(chunk_size=4)


def rff_op(fq, fk, v, *, initial_state, output_final_state, mode, **kw):
    """rff_recurrence in the signature of the others (it always returns its state)."""
    return rff_recurrence(fq, fk, v, initial_state, mode=mode, **kw)


# op, its inputs, the module whose forms are spied on, the form auto runs for T == 1 and for T > 1
AUTO = {
    "aft": (aft, aft_inputs, aft_ops, "aft_step", "chunk_aft"),
    "flash": (mixed_chunk_attention, flash_inputs, flash_ops, "mixed_chunk_step", "chunk_mixed_attention"),
    "lsh": (lsh_attention, lsh_inputs, lsh_ops, "lsh_step", "_dense"),
    "softmax": (softmax_attention, softmax_inputs(None), softmax_ops, "softmax_step", "chunk_softmax"),
    "swa": (softmax_attention, softmax_inputs(4), softmax_ops, "window_step", "chunk_window"),
    "rff": (rff_op, rff_inputs, common, "gated_recurrence_step", "chunk_gated_recurrence"),
}


def flat(state):
    return [state] if isinstance(state, torch.Tensor) else [x for s in state for x in flat(s)]


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("family", list(AUTO))
def test_auto_runs_the_step_for_one_token_and_the_chunk_form_otherwise(monkeypatch, family, T):
    """From a state mid-sequence (a prefix of 5 tokens: mid-chunk, the window filled), auto runs the one
    expected form and agrees with the explicit recurrent and chunk forms and the float64 naive loop."""
    op, make, module, step_form, chunk_form = AUTO[family]
    gen = torch.Generator().manual_seed(5)
    prefix, kw = make(5, gen)
    args, _ = make(T, gen)
    _, S0 = op(*prefix, **kw, initial_state=None, output_final_state=True, mode="chunk")
    calls = []
    for name in (step_form, chunk_form):
        spy(monkeypatch, module, name, calls)
    o, S = op(*args, **kw, initial_state=S0, output_final_state=True, mode="auto")
    assert calls == [step_form if T == 1 else chunk_form]
    assert o.dtype == args[0].dtype
    ref_o, ref_S = op(
        *f64_tree(args), **f64_tree(kw), initial_state=f64_tree(S0), output_final_state=True, mode="naive"
    )
    forms = {
        m: op(*args, **kw, initial_state=S0, output_final_state=True, mode=m) for m in ("recurrent", "chunk")
    }
    for name, (want_o, want_S) in {"naive": (ref_o, ref_S), **forms}.items():
        assert_close(f"o vs {name}", o, want_o, 1e-5)
        for i, (got, want) in enumerate(zip(flat(S), flat(want_S), strict=True)):
            assert_close(f"state[{i}] vs {name}", got, want.to(got.dtype), 1e-5)


@pytest.mark.parametrize("bucket_size, causal", [(4, True), (None, False)])
def test_lsh_auto_runs_the_step_for_one_token_without_a_cache_under_any_pattern(
    monkeypatch, bucket_size, causal
):
    """One token without a cache attends to itself alone whatever the bucket size (the chunked pattern
    has no recurrent form of its own) and causality."""
    (q, k, v), kw = lsh_inputs(1, torch.Generator().manual_seed(6))
    kw.update(bucket_size=bucket_size, causal=causal)
    calls = []
    for name in ("lsh_step", "_dense", "_chunked"):
        spy(monkeypatch, lsh_ops, name, calls)
    o, _ = lsh_attention(q, k, v, **kw, mode="auto")
    assert calls == ["lsh_step"]
    ref, _ = lsh_attention(*f64(q, k, v), **kw, mode="naive")
    assert_close("o", o, ref, 1e-6)
    assert_close("o is v", o, v, 1e-6)


class Ops(torch.nn.Module):
    """The five ops that have a contrib form, each called with its default (auto) or the given mode."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        gen = torch.Generator().manual_seed(2)
        self.conv_w = torch.nn.Parameter(torch.randn(H * K, 4, generator=gen))
        self.norm_w = torch.nn.Parameter(torch.rand(V, generator=gen) + 0.5)
        self.dt_bias = torch.nn.Parameter(torch.randn(H, generator=gen))
        self.decay_scale = torch.nn.Parameter(-torch.rand(H, generator=gen) - 0.5)

    def forward(self, q, k, v, a, b, S0, conv0):
        T = q.shape[1]
        mode = self.mode
        x, conv_state = short_conv(
            q.reshape(B, T, H * K), self.conv_w, initial_state=conv0, output_final_state=True, mode=mode
        )
        beta, g = gated_delta_gates(
            a, b, self.dt_bias, self.decay_scale, mode="plain" if mode != "auto" else mode
        )
        qn, kn = F.normalize(x.view(B, T, H, K), dim=-1), F.normalize(k, dim=-1)
        o_d, S_d = delta_rule(qn, kn, v, beta, g, initial_state=S0, output_final_state=True, mode=mode)
        o_g, S_g = gated_linear_attention(q, k, v, g, initial_state=S0, output_final_state=True, mode=mode)
        norm_mode = "plain" if mode != "auto" else mode
        y = gated_rms_norm(o_d, self.norm_w, o_g, eps=1e-6, activation="silu", mode=norm_mode)
        return y, conv_state, S_d, S_g


def ops_inputs(T: int):
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    a, b = (torch.randn(B, T, H, generator=gen) for _ in range(2))
    return q, k, v, a, b, torch.randn(B, H, K, V, generator=gen), torch.randn(B, H * K, 3, generator=gen)


CONTRIB = {"CausalConvWithState", "LinearAttentionGate", "LinearAttention", "GatedRMSNorm"}


def export(module, args, path, fused: bool):
    with warnings.catch_warnings(), fused_onnxruntime_op(fused), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17)
    return onnx.load(str(path))


def test_auto_runs_the_contrib_ops_inside_the_onnxruntime_export_and_onnxruntime_agrees(tmp_path):
    args = ops_inputs(5)
    with torch.no_grad():
        ref = Ops("naive").double()(*[x.double() for x in args])
    with fused_onnxruntime_op():  # in PyTorch the contrib forms compute with edgeattn's ops
        eager = Ops("auto")(*args)
    for name, got, want in zip(("y", "conv_state", "S_delta", "S_gated"), eager, ref):
        assert_close(name, got, want, 1e-5)

    model = export(Ops("auto"), args, tmp_path / "auto.onnx", fused=True)
    found = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    assert found == CONTRIB
    # the explicit forms are never swapped, and outside the export "auto" traces plain ops
    explicit = export(Ops("chunk"), args, tmp_path / "chunk.onnx", fused=True)
    plain = export(Ops("auto"), args, tmp_path / "plain.onnx", fused=False)
    for m in (explicit, plain):
        assert not {n.domain for n in m.graph.node} - {"", "ai.onnx"}

    # ONNX Runtime runs the contrib graph (its GatedRMSNorm, LinearAttention, ... kernels)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), args)}
    for name, got, want in zip(("y", "conv_state", "S_delta", "S_gated"), sess.run(None, feeds), ref):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_ops_never_load_the_export_code():
    code = (
        "import sys, edgeattn.ops, edgeattn.layers, edgeattn.models; "
        "print(sorted(m for m in sys.modules if m.startswith('edgeattn.export')))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert res.stdout.strip() == "[]"
