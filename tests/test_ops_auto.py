"""``mode="auto"``: each family op picks its form in one place (``edgeattn.ops.backend.choose_form``): the
single-token step for T == 1, the chunk form otherwise, ONNX Runtime's contrib op while the export for the
onnxruntime target traces. Each form is spied on to prove it ran, its result checked against the float64
naive loop, and the contrib form exported and run by ONNX Runtime; and the ops never load the export code.
"""

from __future__ import annotations

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
from edgeattn.export.contrib import fused_onnxruntime_op
from edgeattn.ops import delta_rule, gated_linear_attention, short_conv
from edgeattn.ops.delta import gated_delta_gates
from edgeattn.ops.norm import gated_rms_norm
from tests.helpers import assert_close

B, H, K, V = 2, 2, 8, 6


def inputs(T: int, gate: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = {
        "none": None,
        "head": torch.log(torch.rand(H, generator=gen) * 0.5 + 0.45),
        "head_token": F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2),
        "key": F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2),
    }[gate]
    return q, k, v, g, torch.randn(B, H, K, V, generator=gen)


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
