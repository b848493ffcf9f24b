"""The FLASH mixer (GAU + mixed-chunk attention): the GAU formula, pieces with state equal one call,
the state spec, and bad states."""

import pytest
import torch
import torch.nn.functional as F

from edgeattn.layers import MIXER_REGISTRY, build_mixer
from edgeattn.layers.flash import FLASH
from edgeattn.models import EdgeConfig
from edgeattn.ops.flash import mixed_chunk_attention
from tests.helpers import assert_close

C = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Token-by-token pieces are many tiny ops: a second intra-op thread slows them on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_layer(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer="flash", flash_chunk=C, flash_qk_dim=16, **kw)
    layer = build_mixer("flash", cfg)
    with torch.no_grad():  # away from the zero-ish init, so every term of the output matters
        layer.gamma.normal_()
        layer.beta.normal_(std=0.5)
        layer.rel_bias.normal_()
    return layer


def test_registered_as_flash_with_its_state_spec():
    layer = make_layer()
    assert MIXER_REGISTRY["flash"] is FLASH and isinstance(layer, FLASH)
    e, s = 64, 16  # flash_expansion 2 * d_model 32, flash_qk_dim
    specs = {spec.name: spec for spec in layer.state_spec(3)}
    assert list(specs) == ["linear_state", "chunk_state", "key_quad", "value", "position"]
    assert specs["linear_state"].shape == specs["chunk_state"].shape == (3, s, e)
    assert specs["key_quad"].shape == (3, C, s)
    assert specs["value"].shape == (3, C, e)
    assert specs["position"].shape == (3,)
    state = layer.init_state(3)
    assert all(t.dtype == torch.float32 and not t.any() for t in state.values())


def test_forward_is_the_gau_formula():
    """y = (U * mixed_chunk_attention(Z * gamma_i + beta_i ..., V)) W_o, against the float64 naive op."""
    layer = make_layer().double()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    W_u, W_v, W_z = layer.in_proj.weight.split([64, 64, 16])
    U, V, Z = F.silu(x @ W_u.T), F.silu(x @ W_v.T), F.silu(x @ W_z.T)
    q_quad, k_quad, q_lin, k_lin = (Z * layer.gamma[i] + layer.beta[i] for i in range(4))
    attn, _ = mixed_chunk_attention(
        q_quad, k_quad, q_lin, k_lin, V, chunk_size=C, rel_bias=layer.rel_bias, mode="naive"
    )
    ref = (U * attn) @ layer.o_proj.weight.T
    y, _ = layer(x)
    assert_close("y", y, ref, 1e-10)


@pytest.mark.parametrize("pieces", [(1, 7, 64, 1, 33, 44), (16, 16, 1, 15, 100, 2), (150,), (5,) * 30])
def test_pieces_with_state_equal_one_call(pieces):
    layer = make_layer().eval()
    x = torch.randn(2, sum(pieces), 32)
    with torch.no_grad():
        full, full_state = layer(x)
        state, outs, pos = None, [], 0
        for n in pieces:
            y, state = layer(x[:, pos : pos + n], state=state)
            outs.append(y)
            pos += n
    assert_close("output", torch.cat(outs, 1), full, 1e-5)
    for name in full_state:
        assert_close(name, state[name], full_state[name], 1e-5)
    assert state["position"].tolist() == [sum(pieces) % C] * 2


def test_token_by_token_steps_equal_one_call_and_gradients_flow():
    layer = make_layer()
    x = torch.randn(1, 40, 32)
    full, _ = layer(x)
    state, outs = None, []
    for t in range(40):
        y, state = layer(x[:, t : t + 1], state=state)
        outs.append(y)
    stepped = torch.cat(outs, 1)
    assert_close("output", stepped, full, 1e-5)
    params = dict(layer.named_parameters())
    gs = torch.autograd.grad(stepped.square().sum(), list(params.values()))
    ref = torch.autograd.grad(full.square().sum(), list(params.values()))
    for name, a, b in zip(params, gs, ref):
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        assert_close(f"grad {name}", a, b, 1e-4)


def test_bfloat16_input_keeps_a_float32_state():
    layer = make_layer().to(torch.bfloat16)
    x = torch.randn(1, 20, 32, dtype=torch.bfloat16)
    y, state = layer(x)
    y1, state1 = layer(x[:, :1], state=state)
    assert y.dtype == y1.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in (*state.values(), *state1.values()))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda st: {k: v for k, v in st.items() if k != "position"}, r"must hold \['linear_state'"),
        (lambda st: {**st, "recurrent_state": st["linear_state"]}, r"a state of another layer"),
        (lambda st: {**st, "key_quad": st["key_quad"][:, :8]}, r"state\['key_quad'\] .* must have shape"),
        (lambda st: {**st, "position": st["position"][:, None]}, r"state\['position'\] .* must have shape"),
    ],
)
def test_bad_state_raises_value_error(change, match):
    layer = make_layer()
    x = torch.randn(2, 3, 32)
    _, state = layer(x)
    for T in (1, 3):  # the step and the chunk path both check
        with pytest.raises(ValueError, match=match):
            layer(x[:, :T], state=change(state))
