"""What ONNX Runtime's contrib ops compute, checked against edgeattn's naive loops on one-node graphs.

These pin the facts the `onnxruntime` export target relies on (see docs/ort-contrib-ops.md):
LinearAttention's "delta" / "gated_delta" rules with a per-head [B, T, HV] or per-key [B, T, HV*K] decay
(Kimi Delta Attention), beta [B, T, HV], fewer query heads than KV heads ("inverse GQA", query head h
serving KV heads h*HV/H ...), and CausalConvWithState's channels-first [B, D, W-1] state with SiLU.
"""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from edgeattn.ops import delta_rule, gated_linear_attention, short_conv


def run_node(op, inputs: dict, input_names: list[str], **attrs):
    node = helper.make_node(op, input_names, ["out", "present"], domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        op,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize(
    "rule, gate, H, HV",
    [
        ("delta", None, 2, 2),
        ("delta", None, 2, 4),
        ("gated_delta", "head", 2, 2),
        ("gated_delta", "head", 2, 4),
        ("gated_delta", "key", 2, 2),  # KDA's per-key-dimension decay is accepted
        ("gated_delta", "key", 1, 4),
    ],
)
def test_linear_attention_delta_rules_equal_the_naive_delta_rule(T, rule, gate, H, HV):
    gen = torch.Generator().manual_seed(0)
    B, K, V = 2, 8, 6
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    g = None if gate is None else -torch.rand(B, T, HV, *([K] if gate == "key" else []), generator=gen)
    S0 = torch.randn(B, HV, K, V, generator=gen)
    want, want_S = delta_rule(
        q, k, v, beta, g, scale=0.5, initial_state=S0, output_final_state=True, mode="naive"
    )
    feeds = {
        "q": q.reshape(B, T, -1).numpy(),
        "k": k.repeat_interleave(HV // H, dim=2).reshape(B, T, -1).numpy(),  # one key per KV (value) head
        "v": v.reshape(B, T, -1).numpy(),
        "s": S0.numpy(),
        "b": beta.numpy(),
    }
    names = ["q", "k", "v", "s", "", "b"]
    if g is not None:
        feeds["g"] = g.reshape(B, T, -1).numpy()
        names[4] = "g"
    out, S = run_node(
        "LinearAttention", feeds, names, q_num_heads=H, kv_num_heads=HV, scale=0.5, update_rule=rule
    )
    assert out.shape == (B, T, HV * V)
    np.testing.assert_allclose(out, want.reshape(B, T, -1).numpy(), atol=2e-5)
    np.testing.assert_allclose(S, want_S.numpy(), atol=2e-5)


def test_linear_attention_gated_rule_with_fewer_query_heads_is_mamba2_grouping():
    gen = torch.Generator().manual_seed(1)
    B, T, G, Hm, N, P = 1, 20, 2, 4, 8, 4
    C = torch.randn(B, T, G, N, generator=gen)
    Bk = torch.randn(B, T, Hm, N, generator=gen)
    x = torch.randn(B, T, Hm, P, generator=gen)
    g = -torch.rand(B, T, Hm, generator=gen)
    want, want_S = gated_linear_attention(
        C.repeat_interleave(Hm // G, dim=2), Bk, x, g, scale=1.0, output_final_state=True, mode="naive"
    )
    feeds = {
        "q": C.reshape(B, T, -1).numpy(),
        "k": Bk.reshape(B, T, -1).numpy(),
        "v": x.reshape(B, T, -1).numpy(),
        "s": np.zeros((B, Hm, N, P), np.float32),
        "g": g.numpy(),
    }
    out, S = run_node(
        "LinearAttention", feeds, list(feeds), q_num_heads=G, kv_num_heads=Hm, scale=1.0, update_rule="gated"
    )
    np.testing.assert_allclose(out, want.reshape(B, T, -1).numpy(), atol=2e-5)
    np.testing.assert_allclose(S, want_S.numpy(), atol=2e-5)


@pytest.mark.parametrize("T", [1, 2, 9])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_with_state_equals_short_conv(T, activation, bias):
    gen = torch.Generator().manual_seed(2)
    B, D, W = 2, 5, 4
    x = torch.randn(B, T, D, generator=gen)
    w = torch.randn(D, W, generator=gen)
    b = torch.randn(D, generator=gen) if bias else None
    s0 = torch.randn(B, D, W - 1, generator=gen)
    want, want_s = short_conv(
        x, w, b, activation=activation, initial_state=s0, output_final_state=True, mode="naive"
    )
    feeds = {"x": x.transpose(1, 2).numpy(), "w": w.unsqueeze(1).numpy(), "s": s0.numpy()}
    if bias:
        feeds["b"] = b.numpy()
    out, s = run_node(
        "CausalConvWithState",
        feeds,
        ["x", "w", "b" if bias else "", "s"],
        activation="none" if activation is None else activation,
    )
    np.testing.assert_allclose(out, want.transpose(1, 2).numpy(), atol=1e-5)
    np.testing.assert_allclose(s, want_s.numpy(), atol=1e-6)
