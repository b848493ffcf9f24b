"""AFT layers: the naive op as reference, continuation in pieces, state spec, aft_full refusals, export."""

import copy
import warnings

import pytest
import torch

from edgeattn.layers import MIXER_REGISTRY, build_mixer
from edgeattn.models import EdgeConfig, EdgeLM
from edgeattn.ops.aft import aft, aft_full
from tests.helpers import assert_close

STATEFUL = ("aft", "aft_local")


def tiny(mixer="aft", **kw):
    kw = {"d_model": 32, "n_layers": 1, "n_heads": 2, "mixer": mixer, "window": 16, "chunk_size": 16, **kw}
    return EdgeConfig(**kw)


def layer(mixer, **kw):
    """A layer whose decay and window bias are random, not their smooth initial values."""
    m = build_mixer(mixer, tiny(mixer, **kw)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if name.endswith("proj.weight") else 1.0))
    return m


@pytest.mark.parametrize("mixer", STATEFUL)
def test_layer_matches_the_naive_op_in_float64(mixer):
    m = layer(mixer)
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        y, _ = m(x)
        ref_layer = copy.deepcopy(m).double()
        xd = x.double()
        q, k, v = ref_layer.q_proj(xd), ref_layer.k_proj(xd), ref_layer.v_proj(xd)
        decay = -torch.nn.functional.softplus(ref_layer.decay_param)
        wb = ref_layer.window_bias_param if mixer == "aft_local" else None
        o, _ = aft(q, k, v, decay=decay, window_bias=wb, mode="naive")
        ref = ref_layer.o_proj(o)
    assert_close(mixer, y, ref, 1e-5)


@pytest.mark.parametrize("mixer", STATEFUL)
@pytest.mark.parametrize("window", [4, 16, 40])
def test_pieces_with_state_equal_one_call(mixer, window):
    m = layer(mixer, window=window)
    x = torch.randn(2, 150, 32)
    with torch.no_grad():
        full, _ = m(x)
        state, outs, pos = None, [], 0
        for n in (1, 7, 64, 1, 1, 33, 43):
            y, state = m(x[:, pos : pos + n], state)
            outs.append(y)
            pos += n
    assert pos == 150
    assert_close(mixer, torch.cat(outs, 1), full, 1e-5)


@pytest.mark.parametrize("mixer", STATEFUL)
def test_state_spec_init_state_and_forward_agree(mixer):
    m = layer(mixer)
    spec = m.state_spec(3)
    want = {"numerator": (3, 32), "denominator": (3, 32), "max": (3, 32), "max_age": (3, 32)}
    if mixer == "aft_local":
        want.update({"key": (3, 16, 32), "value": (3, 16, 32), "position": (3,)})
    assert {s.name: s.shape for s in spec} == want
    assert all(s.dtype == "float32" for s in spec)
    zeros = m.init_state(3)
    assert all(not t.any() for t in zeros.values())
    with torch.no_grad():
        y0, s0 = m(torch.randn(3, 5, 32), zeros)
        y1, s1 = m(torch.randn(3, 1, 32), s0)  # the single-token step takes and gives the same state
    for s in (s0, s1):
        assert {k: tuple(t.shape) for k, t in s.items()} == want
        assert all(t.dtype == torch.float32 for t in s.values())


def test_a_state_of_another_layer_is_refused():
    local, simple = layer("aft_local"), layer("aft")
    x = torch.randn(1, 4, 32)
    _, state = simple(x)
    with pytest.raises(ValueError, match=r"must hold \['numerator', 'denominator', 'max', 'max_age', 'key'"):
        local(x, state)
    _, state = local(x)
    with pytest.raises(ValueError, match=r"state\['key'\] .* must have shape \(1, 16, 32\)"):
        local(x, {**state, "key": state["key"][:, :8]})


def test_decay_is_nonpositive_and_every_parameter_learns():
    m = build_mixer("aft_local", tiny("aft_local"))
    assert (m.decay() <= 0).all() and (m.decay() < 0).all()
    # The window bias starts continuous with the decay: distance * decay.
    assert_close("initial window bias", m.window_bias(), torch.arange(16.0)[:, None] * m.decay(), 1e-6)
    y, state = m(torch.randn(2, 20, 32))
    (y.square().sum() + state["numerator"].sum()).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_aft_full_layer_matches_the_op_and_refuses_state():
    m = layer("aft_full", max_seq_len=24)
    assert MIXER_REGISTRY["aft_full"].fixed_size_state is False
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        y, state = m(x)
        o, _ = aft_full(
            m.q_proj(x).double(),
            m.k_proj(x).double(),
            m.v_proj(x).double(),
            m.pos_bias.double(),
            mode="naive",
        )
    assert state == {}
    assert_close("aft_full", y, m.o_proj(o.float()), 1e-5)
    for call in (lambda: m(x, state), lambda: m(x, {}), lambda: m.state_spec(1), lambda: m.init_state(1)):
        with pytest.raises(ValueError, match=r"no fixed-size state.*use mixer 'aft'"):
            call()
    with pytest.raises(ValueError, match=r"w must have shape \[T_max, T_max\] with T_max >= T = 30"):
        m(torch.randn(1, 30, 32))


def test_edge_lm_with_aft_mixers_continues_exactly():
    model = EdgeLM(tiny("aft,aft_local", n_layers=2, vocab_size=64)).eval()
    ids = torch.randint(0, 64, (2, 50))
    with torch.no_grad():
        full, _ = model(ids)
        a, state = model(ids[:, :17])
        b, state = model(ids[:, 17:18], state)
        c, _ = model(ids[:, 18:], state)
    assert_close("logits", torch.cat([a, b, c], 1), full, 1e-5)


@pytest.mark.parametrize("mixer", STATEFUL)
def test_exported_step_is_plain_onnx_and_matches(mixer, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from edgeattn.export.compat import tensorrt_report

    m = layer(mixer, window=8)
    names = [s.name for s in m.state_spec(1)]

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x, *state):
            y, new = self.m(x, dict(zip(names, state)))
            return (y, *(new[n] for n in names))

    with torch.no_grad():
        _, state = m(torch.randn(1, 5, 32))  # a half-full buffer
    args = (torch.randn(1, 1, 32), *(state[n] for n in names))
    path = tmp_path / "step.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer notes on shapes taken as constants, as intended
        torch.onnx.export(Step(), args, str(path), dynamo=False, opset_version=17, input_names=["x", *names])
        ref = Step()(*args)
    model = onnx.load(str(path))
    assert tensorrt_report(model) == []
    assert not {n.op_type for n in model.graph.node} & {"Loop", "Scan", "If", "ArgMax", "Range"}
    got = ort.InferenceSession(str(path)).run(
        None, {i.name: a.numpy() for i, a in zip(model.graph.input, args)}
    )
    for name, a, b in zip(["y", *names], got, ref):
        assert_close(name, torch.from_numpy(a), b, 1e-5)


@pytest.mark.parametrize("mixer", ["aft_local", "aft", "rwkv"])
@pytest.mark.parametrize("prefill", [12, 24])
def test_export_with_a_prefill_chunk_that_chunk_size_does_not_divide(mixer, prefill, tmp_path):
    """Regression: a prefill graph of 12 or 24 tokens with chunk_size 16 (a padded last chunk) failed to
    export; the layer now runs a chunk dividing T. Artifact logits (prefill chunks, then steps) equal the
    model's forward in one call, both targets."""
    import numpy as np

    from edgeattn.export import export_model
    from edgeattn.export.check import run_logits
    from edgeattn.runtimes import open_session

    model = EdgeLM(tiny(mixer, n_layers=2, vocab_size=64, window=8, chunk_size=16)).eval()
    model.save(tmp_path / "ckpt")
    ids = np.random.default_rng(0).integers(0, 64, (1, 2 * prefill + 5))
    with torch.no_grad():
        want = model(torch.from_numpy(ids))[0]
    for target in ("onnxruntime", "portable"):
        art = export_model(
            tmp_path / "ckpt", tmp_path / target, target=target, prefill_chunk=prefill, prefill_logits="all"
        )
        got = run_logits(open_session(art), ids)
        assert got["prefill"].shape[1] == 2 * prefill
        assert_close(target, torch.from_numpy(np.concatenate([got["prefill"], got["step"]], 1)), want, 1e-4)
