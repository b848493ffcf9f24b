"""The short convolution: every mode against the naive loop, against torch's conv1d written here and
against transformers' Qwen3-Next ``causal_conv1d_update`` (same state layout), and continuation."""

import pytest
import torch
import torch.nn.functional as F

from edgeattn.ops import short_conv, short_conv_step
from tests.helpers import assert_close, grads


def make_inputs(B, T, D, W, dtype=torch.float32, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen)
    w = torch.randn(D, W, generator=gen) / W**0.5
    b = torch.randn(D, generator=gen) if bias else None
    s0 = torch.randn(B, D, W - 1, generator=gen)
    cast = lambda t: None if t is None else t.to(dtype).requires_grad_()  # noqa: E731
    return cast(x), cast(w), cast(b), cast(s0)


def torch_reference(x, w, b, s0, activation):
    """nn.Conv1d(D, D, W, groups=D, padding=W-1) over the state followed by x; output t is the one
    whose window ends at x_t."""
    B, T, D = x.shape
    W = w.shape[1]
    conv = torch.nn.Conv1d(D, D, W, groups=D, padding=W - 1).to(x.dtype)
    xs = torch.cat([s0, x.transpose(1, 2)], dim=-1)  # [B, D, W-1+T]
    y = torch.func.functional_call(conv, {"weight": w.unsqueeze(1), "bias": b}, (xs,))[..., W - 1 : W - 1 + T]
    return (F.silu(y) if activation == "silu" else y).transpose(1, 2), xs[..., T:]


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("T", [1, 3, 65])
def test_modes_match_torch_conv1d(mode, W, activation, T):
    x, w, b, s0 = make_inputs(2, T, 6, W)
    y, s = short_conv(x, w, b, activation=activation, initial_state=s0, output_final_state=True, mode=mode)
    x64, w64, b64, s64 = (t.detach().double().requires_grad_() for t in (x, w, b, s0))
    y_ref, s_ref = torch_reference(x64, w64, b64, s64, activation)
    assert_close("output", y, y_ref, 1e-6)
    if W > 1:
        assert_close("state", s, s_ref, 0)
    assert s.shape == (2, 6, W - 1) and s.dtype == torch.float32
    # With W = 1 the state is empty: it has no gradient to compare.
    leaves, leaves64 = [x, w, b, s0][: 3 + (W > 1)], [x64, w64, b64, s64][: 3 + (W > 1)]
    for i, (a, r) in enumerate(zip(grads([y, s], leaves), grads([y_ref, s_ref], leaves64))):
        assert_close(f"grad {i}", a, r, 1e-6)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_modes_match_naive_bfloat16(mode):
    x, w, b, s0 = make_inputs(2, 40, 8, 4, dtype=torch.bfloat16)
    y, s = short_conv(x, w, b, initial_state=s0, output_final_state=True, mode=mode)
    y_ref, s_ref = short_conv(
        *(t.double() for t in (x, w, b)), initial_state=s0.double(), output_final_state=True, mode="naive"
    )
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close("output", y, y_ref, 2e-2)
    assert_close("state", s, s_ref, 0)
    ga = grads([y, s], [x, w, b, s0])
    gr = grads([y_ref, s_ref], [x, w, b, s0])
    for i, (a, r) in enumerate(zip(ga, gr)):
        assert_close(f"grad {i}", a, r, 2e-2)


def test_no_state_means_zeros_and_no_final_state_by_default():
    x, w, b, _ = make_inputs(1, 7, 3, 4)
    y, s = short_conv(x, w, b)
    assert s is None
    y0, _ = short_conv(x, w, b, initial_state=torch.zeros(1, 3, 3))
    assert_close("zero state", y, y0, 0)


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("split", [1, 2, 5, 29])
def test_split_and_continue_equals_whole(mode, split):
    x, w, b, s0 = make_inputs(2, 30, 5, 4)
    kw = dict(initial_state=s0, output_final_state=True, mode=mode)
    y, s = short_conv(x, w, b, **kw)
    y1, s1 = short_conv(x[:, :split], w, b, **kw)
    y2, s2 = short_conv(x[:, split:], w, b, **{**kw, "initial_state": s1})
    assert_close("output", torch.cat([y1, y2], 1), y, 1e-6)
    assert_close("state", s2, s, 0)


def test_step_matches_transformers_qwen3_next_conv_update():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, b, s0 = (t.detach() for t in make_inputs(2, 6, 5, 4))
    state, hf_state = s0, s0.clone()
    for t in range(x.shape[1]):
        y, new_state = short_conv_step(x[:, t], state, w, b, "silu")
        assert_close("state is not mutated", state, s0 if t == 0 else state, 0)
        hf = modeling.causal_conv1d_update(x[:, t, :, None], hf_state, w, b, "silu")  # mutates hf_state
        assert_close(f"token {t}", y, hf[..., 0], 1e-6)
        assert_close(f"state {t}", new_state, hf_state, 0)
        state = new_state
    assert_close("first state untouched", s0, make_inputs(2, 6, 5, 4)[3].detach(), 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.zeros(2, 5)), r"x must have shape \[B, T, D\]"),
        (dict(weight=torch.zeros(3, 4)), r"weight must have shape \[D, W\]"),
        (dict(weight=torch.zeros(4)), r"weight must have shape \[D, W\]"),
        (dict(bias=torch.zeros(3)), r"bias must have shape \[D\]"),
        (
            dict(initial_state=torch.zeros(2, 4, 2)),
            r"initial_state must have shape \[B, D, W-1\] with W-1 = 3",
        ),
        (dict(initial_state=torch.zeros(2, 4, 4)), r"initial_state must have shape \[B, D, W-1\]"),
        (dict(activation="relu"), r"activation must be one of"),
        (dict(mode="parallel"), r"mode must be one of"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    args = dict(x=torch.zeros(2, 5, 4), weight=torch.zeros(4, 4), bias=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        short_conv(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)


class _Step(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)

    def forward(self, x, state):
        return short_conv_step(x, state, self.w, self.b, "silu")


def test_step_exports_to_onnx_opset17(tmp_path):
    """The step traces to plain opset-17 ops and ONNX Runtime reproduces it, state included."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    x, w, b, s0 = (t.detach() for t in make_inputs(2, 1, 5, 4))
    module = _Step(w, b)
    path = tmp_path / "conv.onnx"
    torch.onnx.export(
        module,
        (x[:, 0], s0),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["x", "conv_state"],
        output_names=["y", "present_conv_state"],
    )
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert not ops & {"Loop", "Scan", "If"}, ops
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y, s = sess.run(None, {"x": x[:, 0].numpy(), "conv_state": s0.numpy()})
    y_ref, s_ref = module(x[:, 0], s0)
    assert_close("output", torch.from_numpy(y), y_ref, 1e-6)
    assert_close("state", torch.from_numpy(s), s_ref, 0)
