"""deltanet, gated_deltanet, kda and mamba2: continuation in pieces, the fused contrib ops in exported graphs,
bad states, and each layer against an independent implementation (transformers' Qwen3.5 Gated DeltaNet and
Mamba2 on CPU, with the same weights)."""

import numpy as np
import onnx
import pytest
import torch

from edgeattn.export import Manifest, export_model
from edgeattn.export.check import run_logits
from edgeattn.layers import build_mixer
from edgeattn.models import EdgeConfig, EdgeLM
from edgeattn.runtimes import open_session
from tests.export_helpers import PREFILL, make_checkpoint, text_ids
from tests.helpers import assert_close

NEW = ["deltanet", "gated_deltanet", "kda", "mamba2"]
QWEN35 = "gated_deltanet,gated_deltanet,gated_deltanet,softmax"  # Qwen3.5's 3:1 hybrid pattern


def tiny(mixer, **kw):
    n_layers = len(mixer.split(",")) if "," in mixer else 2
    base = dict(d_model=32, n_layers=n_layers, n_heads=2, mixer=mixer, chunk_size=16, max_seq_len=256)
    return EdgeConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "mixer, kw",
    [
        *[(m, {}) for m in NEW],
        ("gated_deltanet", {"num_v_heads": 4, "expand_v": 0.5, "allow_neg_eigval": True}),
        ("kda", {"num_v_heads": 4}),
        ("deltanet", {"conv_size": 2}),
        ("mamba2", {"mamba_n_groups": 2, "ssm_state_size": 8}),
        (QWEN35, {"num_v_heads": 4}),
        ("mamba2,softmax,kda,deltanet", {}),
    ],
)
def test_pieces_with_state_equal_one_call(mixer, kw):
    torch.manual_seed(0)
    model = EdgeLM(tiny(mixer, **kw)).eval()
    ids = torch.randint(0, 256, (2, 150))
    with torch.no_grad():
        full, _ = model(ids)
        state, outs, pos = None, [], 0
        for n in (1, 2, 1, 64, 1, 33, 48):
            logits, state = model(ids[:, pos : pos + n], state=state)
            outs.append(logits)
            pos += n
    assert pos == 150
    assert_close(mixer, torch.cat(outs, 1), full, 1e-4)


@pytest.mark.parametrize("mixer", NEW)
def test_state_names_and_shapes(mixer):
    cfg = tiny(mixer, num_v_heads=4)
    spec = {s.name: s.shape for s in build_mixer(mixer, cfg).state_spec(3)}
    if mixer == "mamba2":  # I = 64 inner channels, 4 heads of P = 16, N = 16, G = 1
        assert spec == {"conv_state": (3, 64 + 2 * 16, 3), "recurrent_state": (3, 4, 16, 16)}
    else:  # q|k: 2 heads of K = 16, v: 4 heads of V = 16
        assert spec == {"conv_state": (3, 2 * 32 + 64, 3), "recurrent_state": (3, 4, 16, 16)}


@pytest.mark.parametrize("mixer", NEW)
def test_bad_states_and_configs_raise_value_errors(mixer):
    layer = build_mixer(mixer, tiny(mixer))
    x = torch.randn(1, 3, 32)
    state = layer.init_state(1)
    wrong = dict(state, conv_state=state["conv_state"][..., :-1])  # a conv state of the wrong width
    with pytest.raises(ValueError, match=r"conv_state.*must have shape"):
        layer(x, wrong)
    with pytest.raises(ValueError, match="recurrent_state"):
        layer(x, {"conv_state": state["conv_state"]})
    with pytest.raises(ValueError, match="conv_size"):
        tiny(mixer, conv_size=1)
    with pytest.raises(ValueError, match="num_v_heads"):
        tiny(mixer, num_v_heads=3)


# Fused norms of edgeattn.export.optimize (tested in test_optimize.py), not part of the recurrence.
OPTIMIZER_OPS = {"SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"}


def _rules(path):
    """{op_type: {update_rule or activation, ...}} of the com.microsoft nodes other than the optimizer's
    fused norms, and the LinearAttention inputs."""
    found, inputs = {}, []
    for n in onnx.load(str(path)).graph.node:
        if n.domain == "com.microsoft" and n.op_type not in OPTIMIZER_OPS:
            attrs = {a.name: a.s.decode() for a in n.attribute if a.type == onnx.AttributeProto.STRING}
            found.setdefault(n.op_type, set()).update(attrs.values())
            if n.op_type == "LinearAttention":
                inputs.append(list(n.input))
    return found, inputs


# The gates' and gated output norm's contrib ops beside LinearAttention (their string attributes).
GATE_OPS = {
    "deltanet": {},
    "gated_deltanet": {
        "LinearAttentionGate": set()
    },  # the gated norm: plain ops (optimize.unfuse_gated_norms)
    "kda": {},
    "mamba2": {},
}


@pytest.mark.parametrize(
    "mixer, rule",
    [("deltanet", "delta"), ("gated_deltanet", "gated_delta"), ("kda", "gated_delta"), ("mamba2", "gated")],
)
def test_fused_target_emits_linear_attention_and_causal_conv(tmp_path, mixer, rule):
    ckpt = make_checkpoint(tmp_path / "ck", mixer, num_v_heads=4 if mixer != "mamba2" else 0)
    fused = export_model(
        ckpt, tmp_path / "fused", target="onnxruntime", prefill_chunk=PREFILL, prefill_logits="all"
    )
    portable = export_model(ckpt, tmp_path / "portable", target="portable", prefill_chunk=PREFILL)
    assert not (fused / "prefill.onnx").exists()  # one graph for any number of tokens
    found, inputs = _rules(fused / "step.onnx")
    assert found == {"LinearAttention": {rule}, "CausalConvWithState": {"silu"}} | GATE_OPS[mixer]
    assert len(inputs) == 2  # one per layer
    if rule == "delta":  # no decay: the optional input is left empty and beta is the sixth
        assert all(len(i) == 6 and i[4] == "" and i[5] for i in inputs)
    for g in ("step.onnx", "prefill.onnx"):
        assert _rules(portable / g) == ({}, [])
    assert (
        Manifest.load(fused).data["requires"]["onnxruntime"] == "1.32.0"
    )  # the version these ops were checked on
    ids = text_ids(40)  # with HV = 2H (mamba2: 4 heads, 1 group) both targets equal PyTorch
    with torch.no_grad():
        ref = EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()
    for art in (fused, portable):
        got = run_logits(open_session(art), ids)
        full = np.concatenate([got["prefill"], got["step"]], axis=1)
        assert np.abs(full - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0), art.name
    if mixer == "kda":  # the per-key-dimension gate goes to the op as [B, T, HV * K]
        model = onnx.shape_inference.infer_shapes(onnx.load(str(fused / "step.onnx")))
        shapes = {
            v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.value_info, *model.graph.input]
        }
        _, inputs = _rules(fused / "step.onnx")
        assert shapes[inputs[0][4]] == [1, "sequence_length", 4 * 16]


def test_qwen3_5_hybrid_with_grouped_value_heads_matches_pytorch(tmp_path):
    """test_export runs every new mixer over 300 tokens with HV = H; here Qwen3.5's 3:1 hybrid with a
    softmax layer, HV = 2H and beta in (0, 2) on both targets, over 120 tokens (7 prefill chunks + 8 steps)."""
    ckpt = make_checkpoint(tmp_path / "ck", QWEN35, num_v_heads=4, allow_neg_eigval=True)
    ids = text_ids(120)
    with torch.no_grad():
        ref = EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()
    for target in ("onnxruntime", "portable"):
        art = export_model(
            ckpt, tmp_path / target, target=target, prefill_chunk=PREFILL, prefill_logits="all"
        )
        got = run_logits(open_session(art), ids)
        full = np.concatenate([got["prefill"], got["step"]], axis=1)
        assert np.abs(full - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0), target


# ---- independent implementations: transformers on CPU, weights copied in ----


def _torch_paths(monkeypatch, module):
    """transformers picks fla's (CUDA-only) kernels when fla is installed: use its own torch code instead."""
    for name in dir(module):
        f = getattr(module, name)
        if callable(f) and getattr(f, "__wrapped__", None) is not None and not isinstance(f, type):
            monkeypatch.setattr(module, name, f.__wrapped__)


def test_gated_deltanet_equals_transformers_qwen3_5_gated_deltanet(monkeypatch):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    _torch_paths(monkeypatch, q35)

    H, HV, K, V, D = 2, 4, 16, 16, 32
    hf_cfg = Qwen3_5TextConfig(
        hidden_size=D,
        linear_num_key_heads=H,
        linear_num_value_heads=HV,
        linear_key_head_dim=K,
        linear_value_head_dim=V,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-5,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    ref = q35.Qwen3_5GatedDeltaNet(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        ref.A_log.copy_(torch.rand(HV) * 2)
    ours = build_mixer(
        "gated_deltanet", EdgeConfig(d_model=D, n_heads=H, num_v_heads=HV, n_layers=1, chunk_size=16)
    )
    assert (ours.n_heads, ours.n_v_heads, ours.key_dim, ours.value_dim) == (H, HV, K, V)
    w = ref.in_proj_qkv.weight
    with torch.no_grad():
        ours.q_proj.weight.copy_(w[: H * K])
        ours.k_proj.weight.copy_(w[H * K : 2 * H * K])
        ours.v_proj.weight.copy_(w[2 * H * K :])
        ours.conv_weight.copy_(ref.conv1d.weight.squeeze(1))
        ours.b_proj.weight.copy_(ref.in_proj_b.weight)
        ours.a_proj.weight.copy_(ref.in_proj_a.weight)
        ours.A_log.copy_(ref.A_log)
        ours.dt_bias.copy_(ref.dt_bias)
        ours.g_proj.weight.copy_(ref.in_proj_z.weight)
        ours.o_norm.weight.copy_(ref.norm.weight)
        ours.o_proj.weight.copy_(ref.out_proj.weight)
    x = torch.randn(2, 100, D)
    with torch.no_grad():
        want = ref(x)
        got, _ = ours(x)
    assert_close("gated_deltanet vs Qwen3.5", got, want, 1e-4)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_equals_transformers_mamba2_mixer(n_groups):
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    D, N, P = 32, 8, 16
    hf_cfg = Mamba2Config(
        hidden_size=D,
        state_size=N,
        expand=2,
        head_dim=P,
        num_heads=2 * D // P,
        n_groups=n_groups,
        conv_kernel=4,
        layer_norm_epsilon=1e-5,
        use_conv_bias=True,
        use_bias=False,
        chunk_size=16,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    ref = Mamba2Mixer(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name not in ("A_log", "dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3)
    cfg = EdgeConfig(
        d_model=D,
        n_layers=1,
        mixer="mamba2",
        ssm_state_size=N,
        mamba_head_dim=P,
        mamba_n_groups=n_groups,
        chunk_size=16,
    )
    ours = build_mixer("mamba2", cfg)
    with torch.no_grad():
        ours.in_proj.weight.copy_(ref.in_proj.weight)
        ours.conv_weight.copy_(ref.conv1d.weight.squeeze(1))
        ours.conv_bias.copy_(ref.conv1d.bias)
        ours.dt_bias.copy_(ref.dt_bias)
        ours.A_log.copy_(ref.A_log)
        ours.D.copy_(ref.D)
        ours.norm_weight.copy_(ref.norm.weight)
        ours.o_proj.weight.copy_(ref.out_proj.weight)
    x = torch.randn(2, 70, D)
    with torch.no_grad():
        want = ref.torch_forward(x) if hasattr(ref, "torch_forward") else ref(x)
        got, _ = ours(x)
    assert_close("mamba2 vs transformers", got, want, 1e-4)


def test_kda_equals_transformers_kimi_linear_delta_attention(monkeypatch):
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    _torch_paths(monkeypatch, kimi)
    H, K, D = 2, 16, 32
    hf_cfg = KimiLinearConfig(
        hidden_size=D,
        linear_attn_config={"num_heads": H, "head_dim": K, "short_conv_kernel_size": 4},
        layer_types=["linear_attention"],
        rms_norm_eps=1e-5,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    ref = kimi.KimiLinearDeltaAttention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = build_mixer("kda", EdgeConfig(d_model=D, n_heads=H, n_layers=1, mixer="kda", chunk_size=16))
    with torch.no_grad():
        for a, b in [
            ("q_proj", "q_proj"),
            ("k_proj", "k_proj"),
            ("v_proj", "v_proj"),
            ("b_proj", "b_proj"),
            ("f_down", "forget_gate.f_a_proj"),
            ("f_up", "forget_gate.f_b_proj"),
            ("g_down", "g_a_proj"),
            ("g_up", "g_b_proj"),
            ("o_proj", "o_proj"),
        ]:
            ours.get_submodule(a).weight.copy_(ref.get_submodule(b).weight)
        ours.conv_weight.copy_(ref.conv1d.weight.squeeze(1))
        ours.A_log.copy_(ref.forget_gate.A_log.view(-1))
        ours.dt_bias.copy_(ref.forget_gate.dt_bias)
        ours.o_norm.weight.copy_(ref.o_norm.weight)
    x = torch.randn(2, 100, D)
    with torch.no_grad():
        want = ref(x)
        got, _ = ours(x)
    assert_close("kda vs Kimi Linear", got, want, 1e-4)


@pytest.mark.parametrize("mixer, precision", [("gated_deltanet", "fp16"), ("mamba2", "int8")])
def test_reduced_precision_with_the_fused_ops_stays_close(tmp_path, mixer, precision):
    from edgeattn.export.check import check_artifact

    ckpt = make_checkpoint(tmp_path / "ck", mixer)
    art = export_model(ckpt, tmp_path / "art", precision=precision, prefill_chunk=PREFILL)
    want = {"LinearAttention", "CausalConvWithState"} | GATE_OPS[mixer].keys()
    # int8's weights are 8-bit MatMulNBits (com.microsoft too): the fused recurrence ops stay beside them
    assert _rules(art / "step.onnx")[0].keys() - {"MatMulNBits"} == want
    report = check_artifact(art, tokens=120)
    assert report.ok, report.graphs
    assert abs(report.bpb["artifact"] - report.bpb["torch"]) < 0.01 * report.bpb["torch"]
