"""The softmax and swa mixers: pieces with the state carried equal one call, the op they wrap,
the single-token step path, state specs, refused states."""

import pytest
import torch

import edgeattn.ops.softmax as softmax_ops
from edgeattn.layers import MIXER_REGISTRY, build_mixer
from edgeattn.models import EdgeConfig
from edgeattn.ops.softmax import softmax_attention
from tests.helpers import assert_close

# name -> (mixer, window, n_sinks)
LAYERS = {
    "softmax": ("softmax", 16, 4),
    "swa": ("swa", 16, 4),
    "swa_no_sinks": ("swa", 16, 0),
    "swa_window_over_T": ("swa", 400, 4),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: a second intra-op thread only waits (ten times slower on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_layer(name, dtype=torch.float32):
    mixer, window, n_sinks = LAYERS[name]
    cfg = EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer=mixer, window=window, n_sinks=n_sinks)
    torch.manual_seed(0)
    return build_mixer(mixer, cfg).to(dtype).eval()


@pytest.mark.parametrize("name", LAYERS)
def test_pieces_with_state_equal_one_call(name):
    layer = make_layer(name)
    x = torch.randn(2, 150, 32)
    with torch.no_grad():
        y_full, s_full = layer(x)
        state, outs, pos = None, [], 0
        for n in (1, 7, 64, 1, 33, 44):
            y, state = layer(x[:, pos : pos + n], state)
            outs.append(y)
            pos += n
    assert pos == 150
    assert_close(name, torch.cat(outs, 1), y_full, 1e-5)
    assert set(state) == set(s_full)
    for key in s_full:
        assert_close(key, state[key], s_full[key], 1e-5)


@pytest.mark.parametrize("name", LAYERS)
def test_layer_is_the_naive_op_between_projections(name):
    """Heads, scale and window as documented: o_proj(naive softmax attention of the projections)."""
    layer = make_layer(name, torch.float64)
    mixer, window, sink = LAYERS[name]
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        y, _ = layer(x)
        q, k, v = (p(x).view(1, 40, 2, 16) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        kw = dict(window=window, sink=sink) if mixer == "swa" else {}
        o, _ = softmax_attention(q, k, v, scale=16**-0.5, mode="naive", **kw)
        ref = layer.o_proj(o.reshape(1, 40, 32))
    assert_close(name, y, ref, 1e-12)


@pytest.mark.parametrize("name", ["softmax", "swa"])
def test_single_tokens_take_the_step_path(name, monkeypatch):
    """T == 1 must run the step function alone, so that the exported step graph is the pure step."""
    layer = make_layer(name)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        y_ref, _ = layer(x)

        def refuse(*args, **kwargs):
            raise AssertionError("the chunk form ran for a single token")

        for form in ("chunk_softmax", "chunk_window", "parallel_softmax", "parallel_window"):
            monkeypatch.setattr(softmax_ops, form, refuse)
        state, outs = None, []
        for t in range(5):
            y, state = layer(x[:, t : t + 1], state)
            outs.append(y)
    assert_close(name, torch.cat(outs, 1), y_ref, 1e-5)


def test_swa_with_a_window_over_the_sequence_is_softmax():
    full, swa = make_layer("softmax"), make_layer("swa_window_over_T")
    swa.load_state_dict(full.state_dict())
    x = torch.randn(2, 70, 32)
    with torch.no_grad():
        assert_close("swa vs softmax", swa(x)[0], full(x)[0], 1e-5)


def test_state_specs_and_initial_states():
    assert {"softmax", "swa"} <= set(MIXER_REGISTRY)
    full, swa, swa0 = make_layer("softmax"), make_layer("swa"), make_layer("swa_no_sinks")
    assert full.fixed_size_state is False and swa.fixed_size_state is True
    assert [(s.name, s.shape, s.dtype) for s in full.state_spec(3)] == [
        ("key", (3, 2, "past_length", 16), "float32"),
        ("value", (3, 2, "past_length", 16), "float32"),
    ]
    assert [(s.name, s.shape) for s in swa.state_spec(3)] == [
        ("key", (3, 2, 16, 16)),
        ("value", (3, 2, 16, 16)),
        ("sink_key", (3, 2, 4, 16)),
        ("sink_value", (3, 2, 4, 16)),
        ("position", (3,)),
    ]
    assert [s.name for s in swa0.state_spec(1)] == ["key", "value", "position"]
    assert full.init_state(3)["key"].shape == (3, 2, 0, 16)
    init = swa.init_state(3)
    assert all(t.dtype == torch.float32 and not t.any() for t in init.values())


def test_states_keep_their_shapes_and_grow_only_for_softmax():
    full, swa = make_layer("softmax"), make_layer("swa")
    x = torch.randn(1, 40, 32)
    with torch.no_grad():
        _, sf = full(x)
        _, ss = swa(x)
        _, ss = swa(x[:, :1], ss)
    assert sf["key"].shape == (1, 2, 40, 16)
    assert {k: tuple(v.shape) for k, v in ss.items()} == {s.name: s.shape for s in swa.state_spec(1)}
    assert ss["position"].item() == 41.0 and all(v.dtype == torch.float32 for v in ss.values())


def test_bfloat16_layer_keeps_a_float32_state():
    layer = make_layer("swa", torch.bfloat16)
    x = torch.randn(1, 20, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        y, state = layer(x)
        y1, state = layer(x[:, :1], state)
    assert y.dtype == y1.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in state.values())


def test_a_state_of_another_layer_is_refused():
    full, swa, swa0 = make_layer("softmax"), make_layer("swa"), make_layer("swa_no_sinks")
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        _, s_full = full(x)
        _, s_swa = swa(x)
        with pytest.raises(ValueError, match=r"must hold \['key', 'value', 'sink_key'"):
            swa(x, s_full)
        with pytest.raises(ValueError, match=r"state\['key'\] .* must have shape \(1, 2, 16, 16\)"):
            swa0(x, {k: s_swa[k] for k in ("value", "position")} | {"key": s_swa["key"][:, :, :3]})
        with pytest.raises(ValueError, match=r"must hold \['key', 'value'\]"):
            full(x[:, :1], s_swa)
