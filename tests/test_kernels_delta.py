"""Triton chunkwise delta rule (edgeattn.kernels.chunk_delta_rule_triton) against fla's own PyTorch
references, an independent implementation: ``fla.ops.delta_rule.naive.delta_rule_recurrence`` (no
gate), ``fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule`` ([B, T, HV] gate) and
``fla.ops.kda.naive.naive_recurrent_kda`` ([B, T, HV, K] gate). Outputs, final state and the gradients
of q, k, v, beta, g and the initial state (through torch.autograd on the references; they compute in
float32, their leaves are float64 copies of the kernel's rounded inputs).

Same conventions as test_kernels.py (whose helpers and NaN-poisoning fixture are used here): CUDA when
there is one, otherwise Triton's interpreter; relative RMS errors; inputs between NaN guards and every
torch.empty NaN-filled. float32 within 1e-5 in the interpreter (its dots are exact float32), 1e-3 on
CUDA (tf32x3 dots); bfloat16 within 1e-2. Keys are L2-normalised as in real models, beta in (0, 1)
(or (0, 2) for negative eigenvalues).
"""

import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
pytest.importorskip("fla")

from fla.ops.delta_rule.naive import delta_rule_recurrence  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402

from edgeattn.kernels import chunk_delta_rule_triton  # noqa: E402
from tests.test_kernels import _poison_empty, assert_rms, guarded, project  # noqa: E402, F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

GATES = ("none", "head", "key")  # DeltaNet, Gated DeltaNet, KDA
K_SCALE = {"head": 0.3, "key": 0.3}  # fla's DeltaNet reference fixes K ** -0.5; the others take any
TOL = {torch.float32: 1e-3 if DEVICE == "cuda" else 1e-5, torch.bfloat16: 1e-2}


def make_inputs(B, T, H, HV, K, V, gate, *, strong=False, beta_max=1.0, seed=0):
    """float32 CPU tensors q, k [B, T, H, K] (k L2-normalised), v [B, T, HV, V], beta [B, T, HV],
    g (None, [B, T, HV] or [B, T, HV, K], log space), S0 [B, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen) * beta_max
    shape = {"none": None, "head": (B, T, HV), "key": (B, T, HV, K)}[gate]
    g = None
    if shape is not None:
        g = F.logsigmoid(torch.randn(shape, generator=gen) + 2)  # typical decays, mean about -0.15
        if strong:  # a fifth of the steps forget everything
            g = torch.where(torch.rand(shape, generator=gen) < 0.2, torch.full_like(g, -1e4), g)
    S0 = torch.randn(B, HV, K, V, generator=gen)
    return q, k, v, beta, g, S0


def reference(q, k, v, beta, g, S0, *, scale):
    """fla's recurrent reference for the gate kind of ``g``: (o [B, T, HV, V], final state)."""
    r = v.shape[2] // q.shape[2]
    if g is not None and g.dim() == 4:
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=S0, output_final_state=True)
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # key head h -> value heads
    if g is not None:
        return naive_recurrent_gated_delta_rule(
            q, k, v, beta, g, scale=scale, initial_state=S0, output_final_state=True
        )
    assert scale == q.shape[-1] ** -0.5, "fla's delta_rule_recurrence fixes scale = K ** -0.5"
    o, S = delta_rule_recurrence(*(x.transpose(1, 2) for x in (q, k, v, beta)), S0, output_final_state=True)
    return o.transpose(1, 2), S


def leaves(xs, dtypes, guard):
    out = []
    for x, dt in zip(xs, dtypes):
        if x is None:
            out.append(None)
            continue
        x = x.to(device=DEVICE, dtype=dt)
        out.append((guarded(x) if guard else x.clone()).requires_grad_())
    return out


def check(B, T, H, HV, K, V, gate, dtype=torch.float32, *, scale=None, strong=False, beta_max=1.0,
          use_state=True, chunk_size=64, tol=None):  # fmt: skip
    """The kernel against fla's reference: output, final state and every gradient."""
    tol = TOL[dtype] if tol is None else tol
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta, g, S0 = make_inputs(B, T, H, HV, K, V, gate, strong=strong, beta_max=beta_max)
    S0 = S0 if use_state else None
    low = [dtype] * 4 + [torch.float32] * 2  # q, k, v, beta in dtype; g and the state float32
    rounded = [None if x is None else x.to(dt) for x, dt in zip((q, k, v, beta, g, S0), low)]
    ref_in = leaves(rounded, [torch.float64] * 6, guard=False)
    ins = leaves(rounded, low, guard=True)
    o, S = chunk_delta_rule_triton(*ins[:5], scale=scale, initial_state=ins[5], chunk_size=chunk_size)
    o_ref, S_ref = reference(*ref_in, scale=scale)
    assert o.shape == (B, T, HV, V) and o.dtype == dtype
    assert S.shape == (B, HV, K, V) and S.dtype == torch.float32
    assert_rms("output", o, o_ref, tol)
    assert_rms("final state", S, S_ref, tol)
    names = [n for n, x in zip(("dq", "dk", "dv", "dbeta", "dg", "dS0"), ins) if x is not None]
    got = torch.autograd.grad(project([o, S], dtype), [x for x in ins if x is not None])
    ref = torch.autograd.grad(project([o_ref, S_ref], dtype), [x for x in ref_in if x is not None])
    for name, a, x, b in zip(names, got, [x for x in ins if x is not None], ref):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        assert_rms(name, a, b, tol)


@pytest.mark.parametrize(
    "gate, H, HV",
    [("none", 2, 2), ("none", 1, 2), ("head", 2, 2), ("head", 1, 2), ("key", 1, 2)]
    + [pytest.param("key", 2, 2, marks=pytest.mark.slow)],
)
def test_gates_float32(gate, H, HV):
    # the per-key gate shorter, in chunks of 32: the interpreter is slow on its sub-chunk loops
    T, chunk = (65, 64) if gate != "key" else (36, 16)
    check(1, T, H, HV, 16, 16, gate, scale=K_SCALE.get(gate), chunk_size=chunk)


@pytest.mark.parametrize("T", [1, 63, 64, pytest.param(200, marks=pytest.mark.slow)])
def test_lengths_gated(T):
    check(2, T, 1, 2, 16, 16, "head")


@pytest.mark.parametrize("T", [1, 64, pytest.param(200, marks=pytest.mark.slow)])
def test_lengths_ungated(T):
    check(1, T, 1, 2, 16, 16, "none")


@pytest.mark.parametrize("T", [1, *(pytest.param(t, marks=pytest.mark.slow) for t in (63, 64, 200))])
def test_lengths_per_key(T):
    check(1, T, 1, 2, 16, 16, "key")


@pytest.mark.parametrize(
    "K, V, gate",
    [
        (32, 48, "head"),
        (64, 64, "none"),
        (128, 32, "head"),
        pytest.param(64, 64, "key", marks=pytest.mark.slow),
        pytest.param(128, 128, "head", marks=pytest.mark.slow),
        pytest.param(128, 128, "key", marks=pytest.mark.slow),
    ],
)
def test_head_sizes(K, V, gate):
    check(1, 40, 1, 2, K, V, gate)


def test_float16():
    check(1, 65, 1, 2, 16, 16, "head", torch.float16, tol=1e-2)


@pytest.mark.parametrize("gate", GATES)
def test_bfloat16(gate):
    # the per-key gate shorter and in chunks of 16: the interpreter is slow on its sub-chunk loops
    T, chunk = (65, 64) if gate != "key" else (20, 16)
    check(1, T, 1, 2, 16, 16, gate, torch.bfloat16, chunk_size=chunk)


@pytest.mark.slow  # the interpreter is slow at these widths; benchmarks/gpu_check.py runs it compiled
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("gate", GATES)
def test_bfloat16_at_training_widths(K, gate):
    # see test_kernels.py::test_chunk_bfloat16_at_training_widths (Triton's Hopper miscompile, fla #640)
    check(1, 130, 1, 2, K, K, gate, torch.bfloat16)


@pytest.mark.parametrize("gate", ["head", "key"])
def test_gates_down_to_minus_1e4(gate):
    check(1, 40 if gate != "key" else 20, 1, 1, 16, 16, gate, strong=True, chunk_size=16)


def test_no_initial_state_and_negative_eigenvalues():
    check(1, 65, 1, 2, 16, 16, "head", use_state=False, beta_max=2.0)


def test_chunk_size_is_only_a_tile():
    q, k, v, beta, g, S0 = (x.to(DEVICE) for x in make_inputs(1, 40, 1, 2, 16, 16, "head"))
    o64, S64 = chunk_delta_rule_triton(q, k, v, beta, g, scale=0.25, initial_state=S0, chunk_size=64)
    o16, S16 = chunk_delta_rule_triton(q, k, v, beta, g, scale=0.25, initial_state=S0, chunk_size=16)
    assert_rms("output", o16, o64, 1e-5)
    assert_rms("state", S16, S64, 1e-5)
    o1, S1 = chunk_delta_rule_triton(q, k, v, beta, g.unsqueeze(-1), scale=0.25, initial_state=S0)
    assert torch.equal(o1, o64) and torch.equal(S1, S64)  # [B, T, HV, 1] is the same gate as [B, T, HV]


@pytest.mark.parametrize("use", ["o", "S"])
def test_only_the_output_or_only_the_state_is_used(use):
    q, k, v, beta, g, S0 = make_inputs(1, 40, 1, 2, 16, 16, "head")
    ins = leaves((q, k, v, beta, g, S0), [torch.float32] * 6, guard=True)
    ref_in = leaves((q, k, v, beta, g, S0), [torch.float64] * 6, guard=False)
    o, S = chunk_delta_rule_triton(*ins[:5], scale=0.25, initial_state=ins[5])
    o_ref, S_ref = reference(*ref_in, scale=0.25)
    got = torch.autograd.grad(project([o if use == "o" else S]), ins)
    ref = torch.autograd.grad(project([o_ref if use == "o" else S_ref]), ref_in, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, ref)):
        if b is None:  # q does not reach the state: its gradient must be 0
            assert (a == 0).all(), f"loss on {use}: grad {i} is not 0"
            continue
        assert_rms(f"loss on {use}: grad {i}", a, b, TOL[torch.float32])


def test_empty_sequence_returns_the_initial_state():
    q, k, v, beta, g, S0 = (x.to(DEVICE) for x in make_inputs(1, 0, 1, 2, 16, 8, "key"))
    o, S = chunk_delta_rule_triton(q, k, v, beta, g, scale=0.25, initial_state=S0)
    assert o.shape == (1, 0, 2, 8) and torch.equal(S, S0)


def test_bad_inputs_raise_value_error():
    q, k, v, beta, g, S0 = (x.to(DEVICE) for x in make_inputs(1, 4, 2, 4, 16, 8, "key"))
    with pytest.raises(ValueError, match="HV a multiple of H"):
        chunk_delta_rule_triton(q, k, v[:, :, :3], beta[:, :, :3], scale=1.0)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, HV\]"):
        chunk_delta_rule_triton(q, k, v, beta[:, :, :2], scale=1.0)
    with pytest.raises(ValueError, match="g must be None"):
        chunk_delta_rule_triton(q, k, v, beta, g[..., :3], scale=1.0)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_delta_rule_triton(q, k, v, beta, g, scale=1.0, initial_state=S0[:, :2])
    with pytest.raises(ValueError, match="one dtype"):
        chunk_delta_rule_triton(q, k, v.double(), beta, scale=1.0)
    with pytest.raises(ValueError, match="K <= 128"):
        big = torch.zeros(1, 4, 2, 256, device=DEVICE)
        chunk_delta_rule_triton(big, big, v, beta, scale=1.0)


# the compile checks' (GATE, GS): every gate with its gates as pairs (GS 2, shipped); bfloat16 (training) also
# as float32 sums (GS 1)
_GATES_GS = (
    'GATES_GS = {"bf16": ((0, 1), (1, 2), (2, 2), (1, 1), (2, 1)), "fp32": ((0, 1), (1, 2), (2, 2))}\n'
)

_COMPILE = (
    """
import os, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from edgeattn.kernels import delta_chunk as dc
"""
    + _GATES_GS
    + """for arch in (80, 90):
    for dt, torch_dt in (("bf16", dc.torch.bfloat16), ("fp32", dc.torch.float32)):
        for K in (64, 128):
            BK, BV, stages = dc._blocks(K, K, torch_dt)
            for fn, flag in ((dc.chunk_delta_fwd_h_kernel, "USE_H0"), (dc.chunk_delta_bwd_dhu_kernel, "USE_DHT")):
                for gate, gs in GATES_GS[dt]:
                    prec = "tf32" if dt == "bf16" else "tf32x3"
                    c = dict(H=4, K=K, V=K, BT=64, BK=BK, BV=BV, GATE=gate, GS=gs, PREC=prec, **{flag: True})
                    if gate == 0:
                        c["gc"] = None
                    low = {"k", "w", "u", "vn", "q", "do"}
                    sig = {n: "constexpr" if n in c else "i32" if n == "T" else f"*{dt}" if n in low else "*fp32"
                           for n in fn.arg_names}
                    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in c.items()})
                    out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=dc.launch(torch_dt)[0], num_stages=stages))
                    print(arch, dt, K, fn.__name__, gate, gs, out.metadata.shared)
"""
)


@pytest.mark.slow
def test_new_kernels_compile_for_sm80_and_sm90_within_99_kb_of_shared_memory():
    """Compiled (not run: no GPU needed) as on a GPU, outside the interpreter; shared memory as consumer
    GPUs allow (99 KB), except float32 with a whole-head gate at K = 64 (96 KB, still under)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines()]
    assert len(rows) == 2 * 2 * 2 * (5 + 3)  # arch, K, kernel, (GATE, GS) of bf16 and fp32
    too_big = [row for row in rows if int(row[-1]) > 99 * 1024]
    assert not too_big, too_big


# -- through the public op -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gate, dtype",
    [("none", torch.float32), ("head", torch.float32), ("head", torch.bfloat16)]
    + [
        pytest.param("key", torch.float32, marks=pytest.mark.slow)
    ]  # the op's dispatch does not see the gate kind
    + [pytest.param(gate, torch.bfloat16, marks=pytest.mark.slow) for gate in ("none", "key")],
)
def test_public_op_backend_triton_equals_naive(gate, dtype):
    from edgeattn.ops import delta_rule

    B, T, H, HV, K, V = 1, 24, 1, 2, 16, 16
    inputs = make_inputs(B, T, H, HV, K, V, gate)
    low = [dtype] * 4 + [torch.float32] * 2
    rounded = [None if x is None else x.to(dt) for x, dt in zip(inputs, low)]
    ref_in = leaves(rounded, [torch.float64] * 6, guard=False)
    ins = leaves(rounded, low, guard=True)
    kw = dict(scale=0.3, output_final_state=True, chunk_size=16)  # chunks of 16: two of them
    o_ref, S_ref = delta_rule(*ref_in[:5], initial_state=ref_in[5], mode="naive", **kw)
    o, S = delta_rule(*ins[:5], initial_state=ins[5], mode="chunk", backend="triton", **kw)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert_rms("output", o, o_ref, TOL[dtype])
    assert_rms("final state", S, S_ref, TOL[dtype])
    got = torch.autograd.grad(project([o, S], dtype), [x for x in ins if x is not None])
    ref = torch.autograd.grad(project([o_ref, S_ref], dtype), [x for x in ref_in if x is not None])
    names = [n for n, x in zip(("dq", "dk", "dv", "dbeta", "dg", "dS0"), ins) if x is not None]
    for name, a, b in zip(names, got, ref):
        assert_rms(name, a, b, TOL[dtype])


def test_public_op_dispatch(monkeypatch):
    import edgeattn.kernels
    from edgeattn.ops import delta_rule

    calls = []
    fn = edgeattn.kernels.chunk_delta_rule_triton
    monkeypatch.setattr(
        edgeattn.kernels, "chunk_delta_rule_triton", lambda *a, **kw: calls.append(1) or fn(*a, **kw)
    )
    q, k, v, beta, g, S0 = (x.to(DEVICE) for x in make_inputs(1, 8, 1, 2, 16, 16, "head"))
    delta_rule(q, k, v, beta, g, mode="chunk", backend="triton")
    delta_rule(q, k, v, beta, g, mode="chunk", backend="torch")
    assert len(calls) == 1
    # float64 is not the kernels' case: PyTorch under "auto", a ValueError naming it under "triton"
    delta_rule(*(x.double() for x in (q, k, v, beta, g)), mode="chunk", backend="auto")
    with pytest.raises(ValueError, match="float64 inputs"):
        delta_rule(*(x.double() for x in (q, k, v, beta, g)), mode="chunk", backend="triton")
    assert len(calls) == 1


# -- a tiny model trained with each backend --------------------------------------------------------


@pytest.mark.parametrize(
    "n_layers, steps",
    [(1, 3), pytest.param(2, 20, marks=pytest.mark.slow)],  # the 20-step curve is slow here
)
def test_tiny_gated_deltanet_model_follows_the_torch_loss_curve(monkeypatch, n_layers, steps):
    import edgeattn.kernels
    from edgeattn.models import EdgeConfig, EdgeLM

    # HV = 2H value heads, chunks of 16 over 32 tokens: two chunks per call
    cfg = EdgeConfig(
        d_model=32, n_layers=n_layers, n_heads=2, mixer="gated_deltanet", chunk_size=16, num_v_heads=4
    )
    text = torch.tensor(list(b"def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n" * 8))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - 34, (1,), generator=gen)
        batches.append(torch.stack([text[s : s + 33] for s in starts]).to(DEVICE))

    calls = []
    fn = edgeattn.kernels.chunk_delta_rule_triton
    monkeypatch.setattr(
        edgeattn.kernels, "chunk_delta_rule_triton", lambda *a, **kw: calls.append(1) or fn(*a, **kw)
    )
    curves = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("EDGEATTN_KERNELS", backend)
        torch.manual_seed(0)
        model = EdgeLM(cfg).to(DEVICE)
        # eps 1e-6 as in test_kernels.py's GLA curve: float-noise gradients must not become lr-sized steps
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
    assert len(calls) == n_layers * steps  # every layer, every step, with backend triton
    diffs = [abs(a - b) for a, b in zip(curves["torch"], curves["triton"])]
    print(f"loss curves over {steps} steps: max difference {max(diffs):.2e}")
    assert max(diffs) <= 1e-3, f"loss curves differ by up to {max(diffs):.2e}: {curves}"
    assert curves["triton"][-1] < curves["triton"][0]


# -- the WY part in Triton (EDGEATTN_DELTA_WY=triton) ---------------------------------------------


@pytest.mark.parametrize(
    "gate, T, chunk, kw",
    [
        ("none", 65, 64, {}),
        ("head", 65, 64, {}),
        ("head", 63, 32, {"use_state": False, "beta_max": 2.0}),  # negative eigenvalues
        ("head", 40, 16, {"strong": True}),  # gates down to -1e4
        ("key", 36, 16, {}),
        ("key", 20, 16, {"strong": True}),
    ],
)
def test_wy_part_in_triton_against_fla(monkeypatch, gate, T, chunk, kw):
    from edgeattn.kernels import delta_chunk

    monkeypatch.setattr(delta_chunk, "WY", "triton")
    check(1, T, 1, 2, 16, 16, gate, scale=K_SCALE.get(gate), chunk_size=chunk, **kw)


@pytest.mark.parametrize("gate", GATES)
def test_wy_part_in_triton_bfloat16(monkeypatch, gate):
    from edgeattn.kernels import delta_chunk

    monkeypatch.setattr(delta_chunk, "WY", "triton")
    T, chunk = (65, 64) if gate != "key" else (20, 16)
    check(1, T, 1, 2, 16, 16, gate, torch.bfloat16, chunk_size=chunk)


def test_wy_part_in_triton_equals_pytorch_at_a_wider_head(monkeypatch):
    """Both forms of the WY part on the same inputs, K = 32 and V = 48 (two value blocks in backward)."""
    from edgeattn.kernels import delta_chunk

    q, k, v, beta, g, S0 = make_inputs(1, 70, 1, 2, 32, 48, "head")
    outs = {}
    for form in ("torch", "triton"):
        monkeypatch.setattr(delta_chunk, "WY", form)
        ins = leaves((q, k, v, beta, g, S0), [torch.float32] * 6, guard=False)
        o, S = chunk_delta_rule_triton(*ins[:5], scale=0.3, initial_state=ins[5])
        outs[form] = [o, S, *torch.autograd.grad(project([o, S], torch.float32), ins)]
    for a, b in zip(outs["triton"], outs["torch"]):
        assert_rms("triton vs torch WY", a, b, 1e-5)


def test_wy_form_from_the_environment(monkeypatch):
    from edgeattn.kernels import delta_chunk

    monkeypatch.setenv("EDGEATTN_DELTA_WY", "Triton")
    assert delta_chunk.wy_form() == "triton"
    monkeypatch.setenv("EDGEATTN_DELTA_WY", "cuda")
    with pytest.raises(ValueError, match="EDGEATTN_DELTA_WY must be one of torch, triton, got 'cuda'"):
        delta_chunk.wy_form()
    monkeypatch.delenv("EDGEATTN_DELTA_WY")
    assert delta_chunk.wy_form() == delta_chunk.WY == "torch"


@pytest.mark.parametrize("wy", ["torch", "triton"])
@pytest.mark.parametrize("gate", ["head", "key"])
def test_float32_gate_sums(monkeypatch, gate, wy):
    """EDGEATTN_GATE_SUM=float32 (fla's form of the cumulative gates) through both WY parts."""
    from edgeattn.kernels import delta_chunk

    monkeypatch.setenv("EDGEATTN_GATE_SUM", "float32")
    monkeypatch.setattr(delta_chunk, "WY", wy)
    T, chunk = (65, 64) if gate != "key" else (20, 16)
    check(1, T, 1, 2, 16, 16, gate, scale=K_SCALE.get(gate), chunk_size=chunk)
    # after -1e4 gates float32 sums lose a relative 1e-3 (measured 3.5-7.1e-4 of the output; pairs: 1.6e-7)
    check(1, 20, 1, 1, 16, 16, gate, strong=True, chunk_size=16, tol=1e-2)


_COMPILE_WY = (
    """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from edgeattn.kernels import delta_chunk as dc
"""
    + _GATES_GS
    + """for arch in (80, 90):
    for dt, torch_dt in (("bf16", dc.torch.bfloat16), ("fp32", dc.torch.float32)):
        for K in (64, 128):
            for fn in (dc.wy_fwd_kernel, dc.wy_bwd_kernel):
                for gate, gs in GATES_GS[dt]:
                    fwd = fn is dc.wy_fwd_kernel
                    c = dict(H=4, K=K, V=K, BT=64, BK=K, BV=64 if fwd else 32, GATE=gate, GS=gs,
                             PREC="ieee" if arch >= 90 else "tf32x3")
                    if fwd:
                        c["SOLVE"] = True
                    if gate == 0:
                        c["gc"] = None
                    low = {"k", "v", "w", "u"}
                    sig = {n: "constexpr" if n in c else "i32" if n == "T" else f"*{dt}" if n in low else "*fp32"
                           for n in fn.arg_names}
                    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in c.items()})
                    out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dc.wy_launch(torch_dt))
                    print(arch, dt, K, fn.__name__, gate, gs, out.metadata.shared)
"""
)


@pytest.mark.slow
def test_wy_kernels_compile_for_sm80_and_sm90_within_99_kb_of_shared_memory():
    """The WY kernels compiled (not run) as on a GPU at their launch settings: shared memory as consumer
    GPUs allow (99 KB) for 16-bit inputs (training); float32 inputs at K = 128 take 128 KB on sm_80 (the
    backward's float32 products, tf32x3 there), within an A100's 164 KB, not a consumer card's 99 KB."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_WY], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines()]
    assert len(rows) == 2 * 2 * 2 * (5 + 3)  # arch, K, kernel, (GATE, GS) of bf16 and fp32
    too_big = [row for row in rows if int(row[-1]) > (99 if row[1] == "bf16" else 164) * 1024]
    assert not too_big, too_big
