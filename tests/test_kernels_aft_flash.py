"""Triton kernels for AFT (decay, with and without a window bias) and FLASH mixed-chunk attention
(no initial state) against the float64 naive loops: outputs and every gradient, then the ops'
backend dispatch.

Same conventions as test_kernels.py (whose helpers and NaN-poisoning fixture are used here): CUDA when
there is one, otherwise Triton's interpreter; relative RMS errors, float32 within 1e-3, bfloat16
within 1e-2; inputs between NaN guards and every torch.empty NaN-filled.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from edgeattn.kernels import aft_triton, mixed_chunk_attention_triton  # noqa: E402
from edgeattn.ops.aft import aft  # noqa: E402
from edgeattn.ops.flash import mixed_chunk_attention  # noqa: E402
from tests.test_kernels import _poison_empty, assert_rms, guarded, project  # noqa: E402, F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
LENGTHS = [1, 63, 64, 65, pytest.param(300, marks=pytest.mark.slow)]


def _leaves(xs, dtype, guard):
    out = []
    for x in xs:
        x = x.to(device=DEVICE, dtype=dtype)
        out.append((guarded(x) if guard else x.clone()).requires_grad_())
    return out


def check(fn, ref_fn, inputs, n_low, dtype, names, tol=None):
    """fn (the kernel) on ``inputs`` (the first ``n_low`` in ``dtype``, the rest float32) against
    ref_fn on float64 copies of the same (rounded) values: the output and every gradient."""
    tol = TOL[dtype] if tol is None else tol
    rounded = [x.to(dtype) if i < n_low else x for i, x in enumerate(inputs)]
    ref_in = _leaves(rounded, torch.float64, guard=False)
    ins = _leaves(rounded[:n_low], dtype, guard=True) + _leaves(rounded[n_low:], torch.float32, guard=True)
    o_ref = ref_fn(*ref_in)
    o = fn(*ins)
    assert o.dtype == dtype
    assert_rms("output", o, o_ref, tol)
    got = torch.autograd.grad(project([o], dtype), ins)
    ref = torch.autograd.grad(project([o_ref], dtype), ref_in, allow_unused=True)
    # a short sequence never reaches the linear part's keys: their gradient is zero
    ref = [torch.zeros_like(x) if r is None else r for r, x in zip(ref, ref_in)]
    for name, a, b in zip(names, got, ref):
        assert a.dtype == (dtype if name in names[:n_low] else torch.float32), name
        assert_rms(name, a, b, tol)


# -- AFT ------------------------------------------------------------------------------------------


def aft_inputs(B, T, D, seed=0, key_scale=2.0, strong=False, W=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, D, generator=gen)
    k = key_scale * torch.randn(B, T, D, generator=gen)
    v = torch.randn(B, T, D, generator=gen)
    decay = -torch.rand(D, generator=gen) * torch.logspace(-3, 0, D)
    decay[0] = 0.0  # no decay in one channel
    if strong:
        decay[1] = -1e4  # forgets everything at once
    return [q, k, v, decay] + ([torch.randn(W, D, generator=gen)] if W else [])


def aft_ref(q, k, v, decay, window_bias=None):
    return aft(q, k, v, decay=decay, window_bias=window_bias, mode="naive")[0]


def check_aft(B, T, D, dtype=torch.float32, **kw):
    names = ("dq", "dk", "dv", "ddecay", "dwindow_bias")
    check(aft_triton, aft_ref, aft_inputs(B, T, D, **kw), 3, dtype, names)


@pytest.mark.parametrize("T", LENGTHS)
def test_aft_lengths(T):
    check_aft(2, T, 20)


@pytest.mark.parametrize("D", [1, 130])
def test_aft_channels(D):
    check_aft(1, 40, D)


def test_aft_bfloat16():
    check_aft(2, 65, 20, dtype=torch.bfloat16)


def test_aft_extremes():
    # keys of +-80 and a decay of -1e4: the running maximum keeps every exponent <= 0
    check_aft(2, 65, 8, key_scale=40.0, strong=True)


# 63 and 64: slow (6 s each in the interpreter); the windowed path runs at 40 and 65 tokens below and above, and
# test_aft_lengths runs the plain one at every length
WINDOW_LENGTHS = [1, *(pytest.param(T, marks=pytest.mark.slow) for T in (63, 64)), 65, LENGTHS[-1]]


@pytest.mark.parametrize("T", WINDOW_LENGTHS)
def test_aft_window_lengths(T):
    check_aft(2, T, 12, W=20)


@pytest.mark.parametrize("W", [1, 5])  # a window of the token alone; several windows per sequence
def test_aft_window_sizes(W):
    check_aft(2, 40, 12, W=W)


def test_aft_window_bfloat16():
    check_aft(2, 65, 12, dtype=torch.bfloat16, W=8)


def test_aft_window_extremes():
    check_aft(1, 40, 8, key_scale=40.0, strong=True, W=6)


# -- FLASH ----------------------------------------------------------------------------------------


def flash_inputs(B, T, S, E, C, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, T, S, generator=gen) for _ in range(4)] + [torch.randn(B, T, E, generator=gen)]
    return xs + ([torch.randn(C, generator=gen)] if bias else [])


def check_flash(B, T, S, E, C, dtype=torch.float32, bias=True):
    kw = dict(chunk_size=C, quad_scale=S**-0.5, lin_scale=1.0 / C)

    def kernel(*xs):
        return mixed_chunk_attention_triton(*xs[:5], rel_bias=xs[5] if bias else None, **kw)

    def ref(*xs):
        return mixed_chunk_attention(*xs[:5], rel_bias=xs[5] if bias else None, mode="naive", **kw)[0]

    names = ("dq_quad", "dk_quad", "dq_lin", "dk_lin", "dv", "drel_bias")
    check(kernel, ref, flash_inputs(B, T, S, E, C, bias), 5, dtype, names)


@pytest.mark.parametrize("T", LENGTHS)
def test_flash_lengths(T):
    check_flash(2, T, 16, 20, 64)


@pytest.mark.parametrize("C", [16, 24])  # several chunks; a chunk that is not a power of two
def test_flash_chunks(C):
    check_flash(2, 65, 16, 20, C)


@pytest.mark.parametrize("S, E", [(40, 72), (128, 16)])
def test_flash_head_sizes(S, E):
    check_flash(1, 40, S, E, 16)


@pytest.mark.slow  # the interpreter is slow at these widths; benchmarks/gpu_check.py runs it compiled
@pytest.mark.parametrize("S, E", [(64, 64), (128, 128)])
def test_flash_bfloat16_at_training_widths(S, E):
    # see test_kernels.py::test_chunk_bfloat16_at_training_widths (Triton's Hopper miscompile, fla #640)
    check_flash(1, 130, S, E, 64, dtype=torch.bfloat16)


def test_flash_no_bias():
    check_flash(2, 40, 16, 20, 16, bias=False)


def test_flash_bfloat16():
    check_flash(2, 65, 16, 20, 16, dtype=torch.bfloat16)


# -- the ops' dispatch ----------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, (6,), (6, 16)])  # none, shared [W], per channel [W, D]
def test_aft_op_backends_agree(window):
    q, k, v, decay = (x.to(DEVICE) for x in aft_inputs(2, 40, 16))
    wb = None if window is None else torch.randn(window, device=DEVICE)
    o_t, _ = aft(q, k, v, decay=decay, window_bias=wb, mode="chunk", backend="torch")
    o_k, _ = aft(q, k, v, decay=decay, window_bias=wb, mode="chunk", backend="triton")
    assert_rms("output", o_k, o_t, 1e-5)


def test_flash_op_backends_agree():
    xs = [x.to(DEVICE) for x in flash_inputs(2, 40, 16, 20, 16)]
    o_t, _ = mixed_chunk_attention(*xs[:5], chunk_size=16, rel_bias=xs[5], mode="chunk", backend="torch")
    o_k, _ = mixed_chunk_attention(*xs[:5], chunk_size=16, rel_bias=xs[5], mode="chunk", backend="triton")
    assert_rms("output", o_k, o_t, 1e-5)


def test_uncovered_cases_refuse_explicit_triton():
    q, k, v, decay = (x.to(DEVICE) for x in aft_inputs(1, 8, 4))
    state = tuple(torch.zeros(1, 4, device=DEVICE) for _ in range(4))
    with pytest.raises(ValueError, match="initial state"):
        aft(q, k, v, decay=decay, initial_state=state, backend="triton")
    with pytest.raises(ValueError, match="output_final_state"):
        aft(q, k, v, decay=decay, output_final_state=True, backend="triton")
    xs = [x.to(DEVICE) for x in flash_inputs(1, 8, 4, 4, 4, bias=False)]
    with pytest.raises(ValueError, match="output_final_state"):
        mixed_chunk_attention(*xs, chunk_size=4, output_final_state=True, backend="triton")
    xs = [x.to(DEVICE) for x in flash_inputs(1, 8, 128, 4, 128, bias=False)]
    with pytest.raises(ValueError, match="tiles too large"):
        mixed_chunk_attention(*xs, chunk_size=128, backend="triton")


def test_uncovered_cases_keep_torch_under_auto():
    q, k, v, decay = (x.to(DEVICE) for x in aft_inputs(1, 8, 4))
    o, state = aft(q, k, v, decay=decay, window_bias=torch.zeros(3, device=DEVICE), output_final_state=True)
    assert state is not None and torch.isfinite(o).all()
    xs = [x.to(DEVICE) for x in flash_inputs(1, 8, 4, 4, 4, bias=False)]
    o, state = mixed_chunk_attention(*xs, chunk_size=4, output_final_state=True, backend="auto")
    assert state is not None and torch.isfinite(o).all()
