"""The reformer mixer and the rff feature map of the linear / performer mixers: pieces with the state
carried equal one call (layer and EdgeLM), the op they wrap, the single-token step path, state specs,
ONNX export against PyTorch."""

import numpy as np
import pytest
import torch

import edgeattn.ops.lsh as lsh_ops
from edgeattn import MIXERS
from edgeattn.export import export_model
from edgeattn.export.check import run_logits
from edgeattn.export.compat import tensorrt_report
from edgeattn.layers import MIXER_REGISTRY, build_mixer
from edgeattn.models import EdgeConfig, EdgeLM
from edgeattn.ops.lsh import lsh_attention
from edgeattn.ops.performer import orthogonal_random_features
from edgeattn.ops.rff import rff_attention
from edgeattn.runtimes import open_session
from tests.export_helpers import PREFILL, make_checkpoint, text_ids
from tests.helpers import assert_close

F = torch.nn.functional

# name -> (mixer, config fields)
LAYERS = {
    "reformer": ("reformer", {"lsh_buckets": 4, "lsh_rounds": 2}),
    "reformer_1_round": ("reformer", {"lsh_buckets": 8, "lsh_rounds": 1}),
    "linear_rff": ("linear", {"feature_map": "rff", "feature_dim": 16}),
    "performer_rff": ("performer", {"feature_map": "rff", "feature_dim": 24}),
    "linear_favor": ("linear", {"feature_map": "favor", "feature_dim": 16}),
}


def make_layer(name, dtype=torch.float32):
    mixer, kw = LAYERS[name]
    cfg = EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer=mixer, chunk_size=16, **kw)
    torch.manual_seed(0)
    return build_mixer(mixer, cfg).to(dtype).eval()


@pytest.mark.parametrize("name", LAYERS)
def test_pieces_with_state_equal_one_call(name):
    layer = make_layer(name)
    x = torch.randn(2, 100, 32) * 0.5
    with torch.no_grad():
        y_full, s_full = layer(x)
        state, outs, pos = None, [], 0
        for n in (1, 7, 40, 1, 1, 50):
            y, state = layer(x[:, pos : pos + n], state)
            outs.append(y)
            pos += n
    assert_close(name, torch.cat(outs, 1), y_full, 1e-5)
    assert set(state) == set(s_full)
    for key in s_full:
        assert_close(key, state[key], s_full[key], 1e-5)


@pytest.mark.parametrize("mixer", ["reformer", "linear,reformer", "performer"])
def test_edgelm_split_and_continue(mixer):
    n_layers = 2
    kw = {"feature_map": "rff", "feature_dim": 16} if mixer == "performer" else {}
    torch.manual_seed(0)
    model = EdgeLM(
        EdgeConfig(d_model=32, n_layers=n_layers, n_heads=2, mixer=mixer, chunk_size=16, **kw)
    ).eval()
    ids = torch.randint(0, 256, (2, 60))
    with torch.no_grad():
        full, _ = model(ids)
        a, state = model(ids[:, :25])
        outs = [a]
        for t in range(25, 40):
            o, state = model(ids[:, t : t + 1], state=state)
            outs.append(o)
        outs.append(model(ids[:, 40:], state=state)[0])
    assert_close(mixer, torch.cat(outs, 1), full, 1e-5)


def test_reformer_is_the_naive_op_between_projections():
    """Shared qk, normalized keys, whole buckets, scale Dh^-1/2, self only when alone."""
    layer = make_layer("reformer", torch.float64)
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        y, _ = layer(x)
        q = layer.qk_proj(x).view(1, 40, 2, 16)
        v = layer.v_proj(x).view(1, 40, 2, 16)
        o, _ = lsh_attention(q, None, v, rotations=layer.rotations.double(), bucket_size=None, mode="naive")
        ref = layer.o_proj(o.reshape(1, 40, 32))
    assert_close("reformer", y, ref, 1e-12)


@pytest.mark.parametrize("name", ["linear_rff", "performer_rff"])
def test_rff_layer_is_the_naive_op_between_projections(name):
    layer = make_layer(name, torch.float64)
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        y, _ = layer(x)
        q, k, v = (p(x).view(1, 40, 2, 16) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        o, _ = rff_attention(q, k, v, layer.projection.double(), mode="naive")
        ref = layer.o_proj(o.reshape(1, 40, 32))
    assert_close(name, y, ref, 1e-12)


def test_reformer_single_tokens_take_the_step_path(monkeypatch):
    layer = make_layer("reformer")
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        y_ref, _ = layer(x)

        def refuse(*args, **kwargs):
            raise AssertionError("the dense form ran for a single token")

        monkeypatch.setattr(lsh_ops, "_dense", refuse)
        state, outs = None, []
        for t in range(6):
            y, state = layer(x[:, t : t + 1], state)
            outs.append(y)
    assert_close("steps", torch.cat(outs, 1), y_ref, 1e-5)


def test_state_specs_and_feature_maps():
    assert "reformer" in MIXERS and "reformer" in MIXER_REGISTRY
    layer = make_layer("reformer")
    assert layer.fixed_size_state is False
    assert [(s.name, s.shape) for s in layer.state_spec(3)] == [
        ("key", (3, 2, "past_length", 16)),
        ("value", (3, 2, "past_length", 16)),
    ]
    assert layer.rotations.shape == (2, 16, 2) and "rotations" in layer.state_dict()
    assert [s.shape for s in make_layer("performer_rff").state_spec(1)] == [(1, 2, 49, 16), (1, 2, 49)]
    # "default" keeps each family's own map: the performer's projection is unchanged.
    cfg = EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer="performer", feature_dim=16)
    perf = build_mixer("performer", cfg)
    assert perf.feature_map == "favor"
    ref = orthogonal_random_features(16, 16, torch.Generator().manual_seed(1234))
    assert torch.equal(perf.projection, ref)
    assert build_mixer("linear", cfg).feature_map == "elu1"
    with pytest.raises(ValueError, match="feature_map must be"):
        build_mixer(
            "linear", EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer="linear", feature_map="tanh")
        )


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("mixer, kw", [("reformer", {}), ("linear", {"feature_map": "rff"})])
def test_export_matches_pytorch(tmp_path, mixer, kw, target):
    ckpt = make_checkpoint(tmp_path / "ckpt", mixer, **kw)
    art = export_model(ckpt, tmp_path / "art", target=target, prefill_chunk=PREFILL, prefill_logits="all")
    import onnx

    from edgeattn.export.optimize import checkable

    for g in sorted(p.name for p in art.glob("*.onnx")):  # one graph (fused linear) or step and prefill
        model = onnx.load(str(art / g))
        onnx.checker.check_model(checkable(model), full_check=True)
        if mixer != "reformer" and target == "portable":  # a growing KV cache is no TensorRT target
            assert tensorrt_report(model) == []
    ids = text_ids(120)
    with torch.no_grad():
        ref = EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()
    got = run_logits(open_session(art), ids)
    full = np.concatenate([got["prefill"], got["step"]], axis=1)
    assert got["step"].shape[1] > 0
    assert np.abs(full - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0), np.abs(full - ref).max()
