"""Triton kernels (edgeattn.kernels) against the float64 naive loop: outputs, final state, every gradient.

Runs on CUDA when there is one, otherwise in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before triton is imported); the interpreter is slow, so the default cases are small and
the long ones are marked slow. Errors are fla's relative RMS, ||got - ref|| / ||ref||: float32
within 1e-3 (tf32 off: the kernels' float32 dots are then tf32x3), bfloat16 within 1e-2.
Every torch.empty / empty_like made while a test runs is filled with NaN, so an element a kernel
forgets to write fails the test; inputs sit between NaN guards, so a read past a tensor's end fails
it too.
"""

import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

import edgeattn.kernels as kernels  # noqa: E402
from edgeattn.kernels import (  # noqa: E402
    chunk_gated_recurrence_kernel,
    chunk_gated_recurrence_triton,
    fused_recurrent_gated_recurrence,
)
from edgeattn.ops import gated_linear_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

KERNELS = {"chunk": chunk_gated_recurrence_kernel, "fused": fused_recurrent_gated_recurrence}
GATES = ("none", "head", "head_token", "key")  # None, [H], [B, T, H], [B, T, H, K]
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


def rms_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's error ratio: ||got - ref|| / ||ref|| over all elements (NaN if got holds NaN)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


# An exactly zero reference (AFT's dk at T = 1: v P - R with R = P v) has no relative error: the kernel's
# result must be zero up to rounding, which compiled code leaves (v * P - R contracted into one FMA).
ZERO_REF_ABS = 1e-6


def assert_rms(name: str, got, ref, tol: float) -> None:
    if got.shape == ref.shape and not ref.detach().any():
        rms = got.detach().double().pow(2).mean().sqrt().item()
        assert rms <= ZERO_REF_ABS, (
            f"{name}: reference is 0, RMS of the result {rms:.3e} > {ZERO_REF_ABS:.0e}"
        )
        return
    err = rms_err(got, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.0e}"  # NaN fails too


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """torch.empty and torch.empty_like return NaN-filled tensors while a test runs; tf32 stays off."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan_fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan_fill(empty_like(*a, **kw)))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def guarded(x: torch.Tensor) -> torch.Tensor:
    """x (contiguous) stored between NaN guards: a read out of its bounds returns NaN."""
    pad = 4096
    buf = torch.full((x.numel() + 2 * pad,), float("nan"), dtype=x.dtype, device=x.device)
    buf[pad : pad + x.numel()] = x.reshape(-1)
    return buf[pad : pad + x.numel()].view(x.shape)


def make_gate(kind, B, T, H, K, gen, strong=False):
    shape = {"none": None, "head": (H,), "head_token": (B, T, H), "key": (B, T, H, K)}[kind]
    if shape is None:
        return None
    g = F.logsigmoid(torch.randn(shape, generator=gen) + 2)  # typical decays, mean about -0.15
    if strong:  # a fifth of the steps forget everything, the rest keep their memory
        g = torch.where(torch.rand(shape, generator=gen) < 0.2, torch.full_like(g, -1e4), g)
    return g


def make_inputs(B, T, H, K, V, gate, *, positive=False, strong=False, seed=0):
    """float32 CPU tensors: q, k [B, T, H, K], v [B, T, H, V], g (layout of ``gate``), S0 [B, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    if positive:  # normalized attention needs positive features
        q, k = torch.sigmoid(q), torch.sigmoid(k)
    v = torch.randn(B, T, H, V, generator=gen)
    g = make_gate(gate, B, T, H, K, gen, strong)
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, S0


def project(outputs, low=torch.float32, seed=1):
    """A fixed random projection of ``outputs`` to a scalar loss. Its weights are rounded to ``low``
    so that a bfloat16 run and its float64 reference see the same output gradients."""
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for o in outputs:
        w = torch.randn(o.shape, generator=gen).to(low).to(device=o.device, dtype=o.dtype)
        loss = loss + (o * w).sum()
    return loss


def leaves(tensors, dtype, device=DEVICE, guard=False):
    out = []
    for x in tensors:
        if x is None:
            out.append(None)
            continue
        x = x.to(device=device, dtype=dtype)
        out.append((guarded(x) if guard else x.clone()).requires_grad_())
    return out


def check_kernel(fn, T, K, V, gate, dtype=torch.float32, B=2, H=2, strong=False, tol=None):
    """``fn`` (a kernel's function) against the naive loop on a [B, T, H, *] problem."""
    tol = TOL[dtype] if tol is None else tol
    q, k, v, g, S0 = make_inputs(B, T, H, K, V, gate, strong=strong)
    if g is not None and g.dim() != 4:  # the kernels take [B, T, H, 1] or [B, T, H, K]
        g = (g.view(1, 1, H, 1) if g.dim() == 1 else g.unsqueeze(-1)).expand(B, T, H, 1).contiguous()
    # the reference sees exactly the (rounded) inputs the kernel sees
    ref_in = leaves([x.to(dtype) for x in (q, k, v)] + [g, S0], torch.float64)
    g_ref = None if g is None else (ref_in[3].squeeze(-1) if g.shape[-1] == 1 else ref_in[3])
    o_ref, S_ref = gated_linear_attention(
        *ref_in[:3], g_ref, scale=1.0, initial_state=ref_in[4], output_final_state=True, mode="naive"
    )
    ins = leaves((q, k, v), dtype, guard=True) + leaves((g, S0), torch.float32, guard=True)
    o, S = fn(*ins[:4], initial_state=ins[4])
    assert o.dtype == dtype and S.dtype == torch.float32
    assert_rms("output", o, o_ref, tol)
    assert_rms("final state", S, S_ref, tol)
    wanted = [x for x in ins if x is not None]
    got = torch.autograd.grad(project([o, S], dtype), wanted)
    ref = torch.autograd.grad(project([o_ref, S_ref], dtype), [x for x in ref_in if x is not None])
    names = [n for n, x in zip(("dq", "dk", "dv", "dg", "dS0"), ins) if x is not None]
    for name, a, b in zip(names, got, ref):
        assert_rms(name, a, b, tol)


# -- the chunk kernels ----------------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
def test_chunk_gates_float32(gate):
    check_kernel(chunk_gated_recurrence_kernel, 65, 16, 20, gate)


# the per-key gate at 63 and 64 tokens: slow (3 s each in the interpreter); it runs at 65 here and in
# test_chunk_gates_float32, and the per-token gate runs at every length
@pytest.mark.parametrize(
    "T, gate",
    [
        (T, g) if g == "head_token" or T in (1, 65) else pytest.param(T, g, marks=pytest.mark.slow)
        for g in ("head_token", "key")
        for T in (1, 63, 64, 65)
    ]
    + [pytest.param(500, g, marks=pytest.mark.slow) for g in ("head_token", "key")],
)
def test_chunk_lengths(T, gate):
    check_kernel(chunk_gated_recurrence_kernel, T, 16, 16, gate)


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_chunk_long(gate):
    check_kernel(chunk_gated_recurrence_kernel, 1000, 64, 64, gate, B=1)


@pytest.mark.parametrize("K, V", [(16, 16), (60, 61), (64, 64), (128, 128), (256, 24)])
@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_chunk_head_sizes(K, V, gate):
    check_kernel(chunk_gated_recurrence_kernel, 40, K, V, gate, B=1)


@pytest.mark.parametrize("gate", GATES)
def test_chunk_bfloat16(gate):
    check_kernel(chunk_gated_recurrence_kernel, 65, 16, 20, gate, dtype=torch.bfloat16)


@pytest.mark.slow  # the interpreter is slow at these widths; benchmarks/gpu_check.py runs it compiled
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_chunk_bfloat16_at_training_widths(K, gate):
    # Triton 3.4 to 3.7.0 on Hopper miscompiles dot(trans(x), y) where x is a dot's result at some tile
    # widths (fla #640: 64 failed, 32 and 128 passed); the kernels have that pattern in the backward
    check_kernel(chunk_gated_recurrence_kernel, 130, K, K, gate, dtype=torch.bfloat16, B=1)


@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_chunk_gates_down_to_minus_1e4(gate):
    # float32 cumulative sums would lose the small gates after a -1e4 one; see kernels/utils.py
    check_kernel(chunk_gated_recurrence_kernel, 70, 16, 16, gate, B=1, strong=True, tol=1e-5)


def test_chunk_size_is_only_a_tile():
    q, k, v, g, S0 = (x.to(DEVICE) for x in make_inputs(1, 40, 2, 16, 16, "key"))
    o64, S64 = chunk_gated_recurrence_kernel(q, k, v, g, initial_state=S0, chunk_size=64)
    o16, S16 = chunk_gated_recurrence_kernel(q, k, v, g, initial_state=S0, chunk_size=16)
    assert_rms("output", o16, o64, 1e-5)
    assert_rms("state", S16, S64, 1e-5)


# -- the fused recurrent kernel -------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [1, 33, 64])
def test_fused_recurrent(T, gate):
    check_kernel(fused_recurrent_gated_recurrence, T, 16, 20, gate)


@pytest.mark.parametrize("K, V", [(60, 61), (128, 40), (256, 24)])
def test_fused_recurrent_head_sizes(K, V):
    check_kernel(fused_recurrent_gated_recurrence, 20, K, V, "key", B=1)


@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_fused_recurrent_bfloat16_and_strong_gates(gate):
    check_kernel(fused_recurrent_gated_recurrence, 33, 16, 20, gate, dtype=torch.bfloat16)
    check_kernel(fused_recurrent_gated_recurrence, 33, 16, 20, gate, strong=True, tol=1e-5)


# -- through the public op -------------------------------------------------------------------------


def run_op(inputs, normalize, dtype, **kw):
    q, k, v, g, init = inputs
    o, st = gated_linear_attention(
        *(None if x is None else x.to(dtype) for x in (q, k, v, g)),
        normalize=normalize,
        initial_state=tuple(s.to(dtype) for s in init) if normalize else init.to(dtype),
        output_final_state=True,
        **kw,
    )
    return [o, *(st if normalize else (st,))]


# bfloat16 with normalize: slow (3 s each in the interpreter); float32 runs normalize with every gate, and
# bfloat16 every gate without it
@pytest.mark.parametrize(
    "dtype, gate, normalize",
    [
        pytest.param(d, g, n, marks=pytest.mark.slow) if (d == torch.bfloat16 and n) else (d, g, n)
        for d in (torch.float32, torch.bfloat16)
        for g in GATES
        for n in (False, True)
    ],
)
def test_public_op_backend_triton(gate, normalize, dtype):
    B, T, H, K, V = 2, 65, 2, 16, 20
    q, k, v, g, S0 = make_inputs(B, T, H, K, V, gate, positive=normalize)
    gen = torch.Generator().manual_seed(2)
    init = (S0, torch.rand(B, H, K, generator=gen)) if normalize else S0
    flat = [q, k, v, g, *(init if normalize else (init,))]
    ref_leaves = leaves([x if x is None else x.to(dtype) for x in flat], torch.float64)
    mine = leaves(flat, dtype) if dtype == torch.float32 else leaves(flat, torch.float32)

    def pack(xs):
        return (*xs[:4], tuple(xs[4:]) if normalize else xs[4])

    ref = run_op(pack(ref_leaves), normalize, torch.float64, mode="naive")
    got = run_op(pack(mine), normalize, dtype, mode="chunk", backend="triton")
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_rms(f"output {i}", a, b, TOL[dtype])
    wanted = [x for x in mine if x is not None]
    dgot = torch.autograd.grad(project(got, dtype), wanted)
    dref = torch.autograd.grad(project(ref, dtype), [x for x in ref_leaves if x is not None])
    for i, (a, b) in enumerate(zip(dgot, dref)):
        assert_rms(f"grad {i}", a, b, TOL[dtype])


def test_only_the_output_or_only_the_state_is_used():
    q, k, v, g, S0 = make_inputs(1, 40, 2, 16, 16, "key")
    for fn in KERNELS.values():
        for use in ("o", "S"):
            ins = leaves((q, k, v, g, S0), torch.float32)
            ref_in = leaves((q, k, v, g, S0), torch.float64)
            o, S = fn(*ins[:4], initial_state=ins[4])
            o_ref, S_ref = gated_linear_attention(
                *ref_in[:4], scale=1.0, initial_state=ref_in[4], output_final_state=True, mode="naive"
            )
            got = torch.autograd.grad(project([o if use == "o" else S]), ins, allow_unused=True)
            ref = torch.autograd.grad(project([o_ref if use == "o" else S_ref]), ref_in, allow_unused=True)
            for i, (a, b) in enumerate(zip(got, ref)):
                if b is None:  # q does not reach the state: its gradient must be 0 (or None)
                    assert a is None or (a == 0).all(), f"{fn.__name__}, loss on {use}: grad {i} is not 0"
                    continue
                assert_rms(f"{fn.__name__}, loss on {use}: grad {i}", a, b, 1e-3)


def test_launcher_runs_fused_recurrent_for_short_inputs_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "fused_recurrent_gated_recurrence", lambda *a, **kw: calls.append("fused"))
    monkeypatch.setattr(kernels, "chunk_gated_recurrence_kernel", lambda *a, **kw: calls.append("chunk"))
    for T in (1, 64, 65):
        q = torch.zeros(1, T, 1, 16, device=DEVICE)
        chunk_gated_recurrence_triton(q, q, q, None, initial_state=None, chunk_size=64)
    short = "fused" if DEVICE == "cuda" else "chunk"
    assert calls == [short, short, "chunk"]


def test_bad_inputs_raise_value_error():
    q = torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="K <= 256"):
        chunk_gated_recurrence_kernel(
            *(torch.zeros(1, 4, 1, 512, device=DEVICE),) * 3, None, initial_state=None
        )
    with pytest.raises(ValueError, match="one dtype"):
        chunk_gated_recurrence_kernel(q, q, q.double(), None, initial_state=None)
    with pytest.raises(ValueError, match="g must be"):
        fused_recurrent_gated_recurrence(q, q, q, q[..., :3], initial_state=None)
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_gated_recurrence(q, q, q, None, initial_state=torch.zeros(1, 1, 16, 15))


# -- a tiny model trained with each backend --------------------------------------------------------


# 28 s in Triton's interpreter: the kernels' forward and backward are covered case by case above, and the
# GPU check (benchmarks/gpu_check.py) runs this compiled with the slow cases
@pytest.mark.slow
def test_tiny_gla_model_follows_the_torch_loss_curve(monkeypatch):
    from edgeattn.models import EdgeConfig, EdgeLM

    cfg = EdgeConfig(d_model=32, n_layers=2, n_heads=2, mixer="gla", chunk_size=16, gate_low_rank=8)
    text = torch.tensor(list(b"def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n" * 8))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(20):
        starts = torch.randint(0, len(text) - 34, (1,), generator=gen)
        batches.append(torch.stack([text[s : s + 33] for s in starts]).to(DEVICE))

    calls = []
    triton_fn = kernels.chunk_gated_recurrence_triton
    monkeypatch.setattr(
        kernels, "chunk_gated_recurrence_triton", lambda *a, **kw: calls.append(1) or triton_fn(*a, **kw)
    )
    curves = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("EDGEATTN_KERNELS", backend)
        torch.manual_seed(0)
        model = EdgeLM(cfg).to(DEVICE)
        # eps 1e-6, not 1e-8: with a tiny eps Adam turns float-noise gradients (~1e-9) of parameters whose
        # true gradient is ~0 into full lr-sized steps of random sign, which says nothing about the kernels.
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
        losses = []
        for batch in batches:
            logits, _ = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[backend] = losses
    assert len(calls) == 2 * 20  # 2 layers x 20 steps, all with backend triton
    diffs = [abs(a - b) for a, b in zip(curves["torch"], curves["triton"])]
    assert max(diffs) <= 1e-3, f"loss curves differ by up to {max(diffs):.2e}: {curves}"
    assert curves["triton"][-1] < curves["triton"][0]


def test_float32_dot_precision_per_device_and_forced(monkeypatch):
    from edgeattn.kernels import utils

    monkeypatch.setattr(utils, "INTERPRET", False)
    monkeypatch.delenv("EDGEATTN_TRITON_F32_DOT", raising=False)
    monkeypatch.setattr(utils, "_hopper_or_newer", lambda: False)
    torch.backends.cuda.matmul.allow_tf32 = False  # _poison_empty restores it
    assert utils.dot_precision(torch.float32) == "tf32x3"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert utils.dot_precision(torch.float32) == "tf32"
    # sm_90 and newer: tf32x3 dots were wrong there (an H100, Triton 3.6), so float32 is "ieee"
    monkeypatch.setattr(utils, "_hopper_or_newer", lambda: True)
    assert utils.dot_precision(torch.float32) == "ieee"
    assert utils.dot_precision(torch.bfloat16) == "tf32"  # 16-bit operands: tensor cores as they are
    monkeypatch.setenv("EDGEATTN_TRITON_F32_DOT", "tf32x3")
    assert utils.dot_precision(torch.float32) == "tf32x3"
    monkeypatch.setenv("EDGEATTN_TRITON_F32_DOT", "fp64")
    with pytest.raises(ValueError, match="EDGEATTN_TRITON_F32_DOT must be one of ieee, tf32, tf32x3"):
        utils.dot_precision(torch.float32)


@pytest.mark.parametrize("G", [1, 80])  # 80: keys in three blocks of 32, the last one partial
def test_chunk_local_cumsum_against_a_float64_cumsum_within_each_chunk(G):
    from edgeattn.kernels.utils import chunk_local_cumsum

    gen = torch.Generator().manual_seed(0)
    T, BT = 100, 64  # one full chunk and a partial one
    g = (-torch.rand(2, T, 3, G, generator=gen) * 5).float()
    g[0, 3, 1] = -1e4  # a gate at the floor: the pair keeps the small ones after it exact
    gc = chunk_local_cumsum(g.to(DEVICE), BT).cpu()
    assert gc.shape == (2, T, 3, G, 2) and gc.dtype == torch.float32
    ref = torch.cat([c.double().cumsum(1) for c in g.split(BT, dim=1)], dim=1)
    got = gc[..., 0].double() + gc[..., 1].double()
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-9), (got - ref).abs().max()
    assert torch.equal(gc[..., 0], ref.float())  # hi is the float64 sum rounded


# -- float32 gate sums (EDGEATTN_GATE_SUM=float32, fla's form) -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_chunk_float32_gate_sums(monkeypatch, gate, dtype):
    monkeypatch.setenv("EDGEATTN_GATE_SUM", "float32")
    check_kernel(chunk_gated_recurrence_kernel, 70, 16, 16, gate, dtype=dtype, B=1)


@pytest.mark.parametrize("gate", ["head_token", "key"])
def test_chunk_float32_gate_sums_lose_precision_after_minus_1e4(monkeypatch, gate):
    # The trade of the float32 form: after a -1e4 gate the sums are near -1e4 or below, where float32's
    # spacing is 1e-3, so exp of their differences is off by a relative 1e-3 (measured: 2.1-2.5e-3 of the
    # output in the interpreter, against 9e-8 with the pairs, which test_chunk_gates_down_to_minus_1e4
    # holds to 1e-5). Within bfloat16 training's 1e-2.
    monkeypatch.setenv("EDGEATTN_GATE_SUM", "float32")
    check_kernel(chunk_gated_recurrence_kernel, 70, 16, 16, gate, B=1, strong=True, tol=1e-2)


@pytest.mark.parametrize("G", [1, 80])
def test_chunk_local_cumsum_float32_form_against_a_float64_cumsum(G):
    from edgeattn.kernels.utils import chunk_local_cumsum

    gen = torch.Generator().manual_seed(0)
    T, BT = 100, 64
    g = (-torch.rand(2, T, 3, G, generator=gen) * 5).float()
    gc = chunk_local_cumsum(g.to(DEVICE), BT, form="float32").cpu()
    assert gc.shape == (2, T, 3, G, 1) and gc.dtype == torch.float32
    ref = torch.cat([c.double().cumsum(1) for c in g.split(BT, dim=1)], dim=1)
    assert torch.allclose(gc[..., 0].double(), ref, rtol=1e-5, atol=1e-5), (
        (gc[..., 0].double() - ref).abs().max()
    )


def test_gate_sum_form_from_the_environment(monkeypatch):
    from edgeattn.kernels import utils

    monkeypatch.setenv("EDGEATTN_GATE_SUM", " Float32")
    assert utils.gate_sum_form() == "float32"
    monkeypatch.setenv("EDGEATTN_GATE_SUM", "bf16")
    with pytest.raises(ValueError, match="EDGEATTN_GATE_SUM must be one of pair, float32, got 'bf16'"):
        utils.gate_sum_form()
    monkeypatch.delenv("EDGEATTN_GATE_SUM")
    assert utils.gate_sum_form() == utils.GATE_SUM == "pair"
    with pytest.raises(ValueError, match="must be one of pair, float32, got 'f64'"):
        utils.chunk_local_cumsum(torch.zeros(1, 4, 1, 1, device=DEVICE), 16, form="f64")
