"""Training speed of the gated linear recurrence on CUDA: our Triton kernels against the alternatives.

What it measures: the time of one forward + one backward pass (the output's gradient given, the final
state unused: the training step) at B=8, H=16, K=V=128, bfloat16 inputs (float32 gates), T = 2048 and
8192, for

    triton   edgeattn.kernels.chunk_gated_recurrence_triton (bfloat16 in, float32 state and accumulation)
    torch    the PyTorch chunk form, edgeattn.ops.gated_linear_attention(mode="chunk", backend="torch")
    fla      fla.ops.gla.chunk_gla / fla.ops.simple_gla.chunk_simple_gla, when fla is installed
    sdpa     torch.nn.functional.scaled_dot_product_attention(is_causal=True): softmax attention

with a per-key gate ([B, T, H, K], GLA) and a whole-head gate ([B, T, H], RetNet-like). Times are the
median of CUDA-event timings (triton.testing.do_bench). Next to each time: achieved TFLOP/s and GB/s
and their share of the device's peak (datasheet dense bf16 and memory bandwidth; --peak-tflops and
--peak-gbs override). FLOPs are counted as the chunk kernels do them (C = 64):
fwd = B H T (2 C (K + V) + 4 K V), bwd = 2 fwd; for SDPA fwd = 2 B H T^2 (K + V) / 2 (causal), bwd =
2.5 fwd. Bytes are the compulsory traffic: q, k, v, g read and o written forward; q, k, v, g, do read
and dq, dk, dv, dg written backward.

Then AFT (decay, no window bias; q, k, v [B, T, D] with D = H * K) and FLASH mixed-chunk attention
(q_*, k_* [B, T, S], v [B, T, E], chunk C; S = 128, E = 1024, C = 64 by default, see ``--flash-*``),
bfloat16, forward + backward, the Triton kernels (``edgeattn.ops.aft.aft`` / ``mixed_chunk_attention`` with
backend="triton") against the same ops' PyTorch chunk forms (backend="torch"), each checked first at a
small size against the PyTorch form. Rows in the table with impl ``aft-triton``, ``aft-torch``,
``flash-triton``, ``flash-torch`` (no FLOP or byte model: times only).

Then the delta rule (q, k [B, T, H, K] L2-normalised, v [B, T, HV, V] with HV = H * --delta-v-ratio,
beta = sigmoid, bfloat16; K = V = --head-dim), forward + backward, for each gate kind: ``none``
(DeltaNet), ``head`` ([B, T, HV], Gated DeltaNet) and ``key`` ([B, T, HV, K], KDA), float32 gates:

    delta-triton  edgeattn.kernels.chunk_delta_rule_triton
    delta-torch   edgeattn.ops.delta_rule(mode="chunk", backend="torch"), when that op exists
    delta-fla     fla.ops.delta_rule.chunk_delta_rule / gated_delta_rule.chunk_gated_delta_rule /
                  kda.chunk_kda, when fla is installed

each checked first at a small size against the PyTorch chunk form (against fla when the op is absent).
Rows with impl ``delta-*`` (times only).

Why: the kernels exist to make training fast. This shows where they stand against the PyTorch form
they replace on CUDA, against the reference implementation (fla), and against softmax attention,
and whether they are bound by compute or by memory. Before timing, each implementation's output at
a small size is compared with the PyTorch chunk form, so a fast but wrong kernel shows up.

    python benchmarks/kernels.py [--lengths 2048,8192] [--batch 8] [--heads 16] [--head-dim 128]
    python benchmarks/kernels.py --only-delta      # the delta-rule rows only

Prints a table, then one JSON line. Without CUDA it says so and prints {"skipped": ...}, exit code 0.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

CHUNK = 64
# Datasheet dense bf16 tensor TFLOP/s and memory GB/s, matched on torch.cuda.get_device_name().
PEAKS = [
    ("H200", 989.0, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100", 989.0, 3350.0),  # SXM5
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100", 312.0, 1555.0),
    ("L40S", 362.0, 864.0),
    ("RTX 4090", 165.0, 1008.0),
    ("A10", 125.0, 600.0),
]


def device_peaks(name: str, tflops: float | None, gbs: float | None) -> tuple[float | None, float | None]:
    for key, t, g in PEAKS:
        if key in name:
            return tflops or t, gbs or g
    return tflops, gbs


def flops_linear(B, T, H, K, V) -> float:
    fwd = B * H * T * (2 * CHUNK * (K + V) + 4 * K * V)
    return 3.0 * fwd


def flops_sdpa(B, T, H, K, V) -> float:
    fwd = 2.0 * B * H * T * T * (K + V) / 2
    return 3.5 * fwd


def flops_delta(B, T, H, HV, K, V) -> float:
    """Forward + backward FLOPs of the chunkwise delta rule (C = 64), per value head: the WY/UT transform
    (beta K K^T, then w = A beta K and u = A beta V: 2 C (2 K + V) per token), the state pass (v - w S,
    S += K^T v, q S: 6 K V) and the intra-chunk part (q K^T and its product with v: 2 C (K + V)); the
    triangular solve (C^2 / 3 per token) is left out. fwd = B HV T (6 C K + 4 C V + 6 K V), bwd = 2 fwd."""
    return 3.0 * B * HV * T * (6 * CHUNK * K + 4 * CHUNK * V + 6 * K * V)


def bytes_delta(B, T, H, HV, K, V, gate: str, elt: int = 2) -> float:
    """Compulsory traffic of the delta rule's forward + backward: q, k [H heads], v, beta and the gate
    [HV heads] read and o written forward; all of them and do read, their gradients written backward."""
    g = {"key": B * T * HV * K, "head": B * T * HV, "none": 0}[gate] * 4  # float32 gates
    ins = B * T * (2 * H * K + HV * V + HV) * elt + g  # q, k, v, beta, g
    o = B * T * HV * V * elt
    return 3 * ins + 2 * o  # fwd: ins, o; bwd: ins and do in, their gradients out


def bytes_moved(B, T, H, K, V, gate: str, elt: int = 2) -> float:
    g = {"key": B * T * H * K, "head": B * T * H, "none": 0}[gate] * 4  # float32 gates
    qkv = B * T * H * (2 * K + V) * elt
    o = B * T * H * V * elt
    return 2 * (qkv + g) + 2 * o + qkv + g  # fwd: qkv, g, o; bwd: qkv, g, do in and dq, dk, dv, dg out


def make_inputs(B, T, H, K, V, gate: str, seed: int = 0, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K) * K**-0.5, rnd(B, T, H, V)
    shape = {"key": (B, T, H, K), "head": (B, T, H)}[gate]
    g = F.logsigmoid(rnd(*shape, dtype=torch.float32) + 4) / 4  # decays of about 0.996
    return q, k, v, g


def implementations(gate: str):
    """name -> fn(q, k, v, g) returning the output [B, T, H, V], or a string saying why it is absent."""
    from edgeattn.kernels import chunk_gated_recurrence_triton
    from edgeattn.ops import gated_linear_attention

    def ours(q, k, v, g):
        gg = g if g.dim() == 4 else g.unsqueeze(-1)
        return chunk_gated_recurrence_triton(q, k, v, gg, initial_state=None, chunk_size=CHUNK)[0]

    def torch_chunk(q, k, v, g):
        return gated_linear_attention(q, k, v, g, scale=1.0, mode="chunk", backend="torch")[0]

    impls = {"triton": ours, "torch": torch_chunk}
    try:
        if gate == "key":
            from fla.ops.gla import chunk_gla as fla_fn
        else:
            from fla.ops.simple_gla import chunk_simple_gla as fla_fn

        impls["fla"] = lambda q, k, v, g: fla_fn(q, k, v, g, scale=1.0)[0]
    except ImportError as e:
        impls["fla"] = f"fla not installed ({e.name}); pip install flash-linear-attention"

    def sdpa(q, k, v, g):
        o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
        return o.transpose(1, 2)

    impls["sdpa"] = sdpa
    return impls


def check(impls, gate: str) -> dict[str, float]:
    """Relative RMS error of each linear-attention output against the PyTorch chunk form (small size)."""
    q, k, v, g = make_inputs(1, 512, 2, 64, 64, gate, seed=1)
    ref = impls["torch"](q, k, v, g).float()
    errs = {}
    for name, fn in impls.items():
        if callable(fn) and name not in ("torch", "sdpa"):
            out = fn(q, k, v, g).float()
            errs[name] = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    return errs


def time_fwd_bwd(fn, q, k, v, g) -> float:
    from triton.testing import do_bench

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    do = torch.randn_like(v)

    def step():
        fn(*leaves).backward(do)

    return do_bench(step, warmup=5, rep=50, grad_to_none=leaves, return_mode="median")


def other_ops(B: int, D: int, S: int, E: int, C: int):
    """name -> (make_inputs(T, seed), fn(*inputs) -> output) for the AFT and FLASH rows."""
    from edgeattn.ops.aft import aft
    from edgeattn.ops.flash import mixed_chunk_attention

    def aft_inputs(T, seed=0, B=B, D=D):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(B, T, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
        decay = -torch.rand(D, generator=gen, device="cuda") * 0.1
        return q, k, v, decay

    def flash_inputs(T, seed=0, B=B, S=S, E=E):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        xs = [torch.randn(B, T, S, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4)]
        v = torch.randn(B, T, E, generator=gen, device="cuda").to(torch.bfloat16)
        return (*xs, v, torch.randn(C, generator=gen, device="cuda") * 0.1)

    def aft_fn(backend):
        return lambda q, k, v, d: aft(q, k, v, decay=d, mode="chunk", backend=backend)[0]

    def flash_fn(backend):
        def fn(qq, kq, ql, kl, v, b):
            return mixed_chunk_attention(
                qq, kq, ql, kl, v, chunk_size=C, quad_scale=S**-0.5, rel_bias=b, mode="chunk", backend=backend
            )[0]

        return fn

    return {
        "aft": (aft_inputs, {"aft-triton": aft_fn("triton"), "aft-torch": aft_fn("torch")}),
        "flash": (flash_inputs, {"flash-triton": flash_fn("triton"), "flash-torch": flash_fn("torch")}),
    }


def time_fwd_bwd_any(fn, inputs) -> float:
    """Forward + backward of fn over ``inputs`` (every floating tensor a leaf), ms: the median of CUDA-event
    timings on CUDA; off CUDA (benchmarks/gpu_check.py --tiny, Triton's interpreter) one wall-clock run,
    which says only that it runs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    do = torch.randn_like(fn(*leaves))

    def step():
        fn(*leaves).backward(do)

    if leaves[0].is_cuda:
        from triton.testing import do_bench

        return do_bench(step, warmup=5, rep=50, grad_to_none=leaves, return_mode="median")
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def other_rows(args, lengths) -> tuple[list[dict], dict[str, float]]:
    """The AFT and FLASH rows and their check against the PyTorch chunk forms."""
    B, D = args.batch, args.heads * args.head_dim
    S, E, C = args.flash_qk_dim, args.flash_value_dim, args.flash_chunk
    rows, checks = [], {}
    for op, (make, fns) in other_ops(B, D, S, E, C).items():
        small = make(300, seed=1, B=1)
        ref = fns[f"{op}-torch"](*small).float()
        out = fns[f"{op}-triton"](*small).float()
        checks[op] = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
        for T in lengths:
            inputs = make(T)
            for impl, fn in fns.items():
                row = {"impl": impl, "gate": "-", "T": T}
                try:
                    row["ms"] = time_fwd_bwd_any(fn, inputs)
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of memory"
                rows.append(row)
                torch.cuda.empty_cache()
            del inputs
    return rows, checks


def delta_impls(gate: str):
    """name -> fn(q, k, v, beta[, g]) returning o [B, T, HV, V], or a string saying why it is absent."""
    from edgeattn.kernels import chunk_delta_rule_triton

    def ours(q, k, v, beta, g=None):
        return chunk_delta_rule_triton(q, k, v, beta, g, scale=q.shape[-1] ** -0.5)[0]

    impls = {"delta-triton": ours}
    try:
        from edgeattn.ops import delta_rule

        impls["delta-torch"] = lambda q, k, v, beta, g=None: delta_rule(
            q, k, v, beta, g, mode="chunk", backend="torch"
        )[0]
    except ImportError:
        impls["delta-torch"] = "edgeattn.ops.delta_rule is not in this tree"
    try:
        if gate == "none":
            from fla.ops.delta_rule import chunk_delta_rule

            def fla_fn(q, k, v, beta, g=None):
                r = v.shape[2] // q.shape[2]  # fla's DeltaNet kernel has no value-head groups
                q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
                return chunk_delta_rule(q, k, v, beta)[0]

        elif gate == "head":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            def fla_fn(q, k, v, beta, g=None):
                return chunk_gated_delta_rule(q, k, v, g, beta)[0]

        else:
            from fla.ops.kda import chunk_kda

            def fla_fn(q, k, v, beta, g=None):
                return chunk_kda(q, k, v, g, beta)[0]

        impls["delta-fla"] = fla_fn
    except ImportError as e:
        impls["delta-fla"] = f"fla not installed ({e.name}); pip install flash-linear-attention"
    return impls


def delta_inputs(B, T, H, HV, K, V, gate: str, seed: int = 0, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q = rnd(B, T, H, K).to(torch.bfloat16)
    k = F.normalize(rnd(B, T, H, K), dim=-1).to(torch.bfloat16)
    v = rnd(B, T, HV, V).to(torch.bfloat16)
    beta = torch.sigmoid(rnd(B, T, HV)).to(torch.bfloat16)
    if gate == "none":
        return q, k, v, beta
    shape = (B, T, HV) if gate == "head" else (B, T, HV, K)
    return q, k, v, beta, F.logsigmoid(rnd(*shape) + 4) / 4  # decays of about 0.996


def delta_rows(args, lengths) -> tuple[list[dict], dict[str, dict[str, float]], list[str]]:
    """The delta-rule rows, their checks against the PyTorch chunk form (or fla) and notes."""
    B, H, K = args.batch, args.heads, args.head_dim
    HV = H * args.delta_v_ratio
    rows, checks, notes = [], {}, []
    for gate in args.delta_gates.split(","):
        impls = delta_impls(gate)
        notes += [f"{n} ({gate}): {why}" for n, why in impls.items() if isinstance(why, str)]
        runnable = {n: fn for n, fn in impls.items() if callable(fn)}
        ref_name = "delta-torch" if "delta-torch" in runnable else "delta-fla"
        small = delta_inputs(1, 300, 2, 2 * args.delta_v_ratio, 64, 64, gate, seed=1)
        if ref_name in runnable:
            ref = runnable[ref_name](*small).float()
            checks[gate] = {}
            for n, fn in runnable.items():
                if n != ref_name:
                    out = fn(*small).float()
                    checks[gate][n + " vs " + ref_name] = (
                        (out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
                    ).item()
        for T in lengths:
            inputs = delta_inputs(B, T, H, HV, K, K, gate)
            for impl, fn in runnable.items():
                row = {"impl": impl, "gate": gate, "T": T}
                try:
                    row["ms"] = time_fwd_bwd_any(fn, inputs)
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of memory"
                rows.append(row)
                torch.cuda.empty_cache()
            del inputs
    return rows, checks, notes


def main() -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gates", default="key,head")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--flash-qk-dim", type=int, default=128, help="FLASH rows: S of q_*, k_*")
    ap.add_argument("--flash-value-dim", type=int, default=1024, help="FLASH rows: E of v")
    ap.add_argument("--flash-chunk", type=int, default=64, help="FLASH rows: chunk_size")
    ap.add_argument("--skip-aft-flash", action="store_true", help="only the gated recurrence rows")
    ap.add_argument("--skip-delta", action="store_true", help="no delta-rule rows")
    ap.add_argument("--only-delta", action="store_true", help="only the delta-rule rows")
    ap.add_argument("--delta-gates", default="none,head,key", help="delta rows: gate kinds")
    ap.add_argument(
        "--delta-v-ratio", type=int, default=2, help="delta rows: HV / H (value heads per key head)"
    )
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py: no CUDA device here; the Triton training kernels are timed on a GPU only."
        )
        print(json.dumps(with_cpu({"skipped": "no CUDA device"})))
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks/kernels.py: triton is not installed (pip install 'edgeattn[train]').")
        print(json.dumps(with_cpu({"skipped": "triton not installed"})))
        return 0

    torch.backends.cuda.matmul.allow_tf32 = False
    B, H, K = args.batch, args.heads, args.head_dim
    V = K
    lengths = [int(x) for x in args.lengths.split(",")]
    name = torch.cuda.get_device_name()
    peak_tf, peak_gb = device_peaks(name, args.peak_tflops, args.peak_gbs)
    print(
        f"{name}: forward + backward, B={B}, H={H}, K=V={K}, bfloat16 (float32 gates), median of CUDA events"
    )
    print(f"peaks: {peak_tf or '?'} TFLOP/s bf16 dense, {peak_gb or '?'} GB/s")

    rows, notes, checks = [], [], {}
    for gate in [] if args.only_delta else args.gates.split(","):
        impls = implementations(gate)
        notes += [f"{n}: {why}" for n, why in impls.items() if isinstance(why, str)]
        checks[gate] = check(impls, gate)
        for T in lengths:
            q, k, v, g = make_inputs(B, T, H, K, V, gate)
            for impl, fn in impls.items():
                if isinstance(fn, str) or (impl == "sdpa" and gate != "key"):
                    continue  # sdpa has no gate: timed once
                row = {"impl": impl, "gate": gate if impl != "sdpa" else "-", "T": T}
                try:
                    ms = time_fwd_bwd(fn, q, k, v, g)
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of memory"
                    torch.cuda.empty_cache()
                    rows.append(row)
                    continue
                flops = (flops_sdpa if impl == "sdpa" else flops_linear)(B, T, H, K, V)
                nbytes = bytes_moved(B, T, H, K, V, "none" if impl == "sdpa" else gate)
                row.update(ms=ms, tflops=flops / ms / 1e9, gbs=nbytes / ms / 1e6)
                if peak_tf:
                    row["tflops_pct_peak"] = 100 * row["tflops"] / peak_tf
                if peak_gb:
                    row["gbs_pct_peak"] = 100 * row["gbs"] / peak_gb
                rows.append(row)
            del q, k, v, g
            torch.cuda.empty_cache()

    other_checks = {}
    if not (args.skip_aft_flash or args.only_delta):
        other, other_checks = other_rows(args, lengths)
        rows += other
    delta_checks = {}
    if not args.skip_delta:
        delta, delta_checks, delta_notes = delta_rows(args, lengths)
        rows += delta
        notes += delta_notes

    print(f"{'impl':<13}{'gate':<6}{'T':>6}{'ms':>10}{'TFLOP/s':>10}{'%peak':>7}{'GB/s':>9}{'%peak':>7}")
    for r in rows:
        head = f"{r['impl']:<13}{r['gate']:<6}{r['T']:>6}"
        if "error" in r:
            print(head + f"  {r['error']}")
            continue
        pt = f"{r['tflops_pct_peak']:>6.1f}%" if "tflops_pct_peak" in r else f"{'-':>7}"
        pg = f"{r['gbs_pct_peak']:>6.1f}%" if "gbs_pct_peak" in r else f"{'-':>7}"
        if "tflops" not in r:  # AFT / FLASH / delta rows: times only
            print(head + f"{r['ms']:>10.2f}")
            continue
        print(head + f"{r['ms']:>10.2f}{r['tflops']:>10.1f}{pt}{r['gbs']:>9.0f}{pg}")
    for gate, errs in checks.items():
        print(
            f"check ({gate} gate, B=1 T=512 H=2 K=V=64), relative RMS error vs the PyTorch chunk form: "
            + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
        )
    for op, e in other_checks.items():
        print(
            f"check ({op}, B=1 T=300), relative RMS error of the Triton kernels vs the PyTorch chunk form: "
            f"{e:.1e}"
        )
    for gate, errs in delta_checks.items():
        print(
            f"check (delta rule, {gate} gate, B=1 T=300 H=2 K=V=64), relative RMS error: "
            + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
        )
    for n in notes:
        print("note:", n)
    result = {
        "device": name,
        "shape": {"B": B, "H": H, "K": K, "V": V, "dtype": "bfloat16"},
        "peak_tflops": peak_tf,
        "peak_gbs": peak_gb,
        "results": rows,
        "check_rel_rms_vs_torch": {**checks, **other_checks},
        "check_delta_rel_rms": delta_checks,
        "delta_v_heads": H * args.delta_v_ratio,
        "aft_flash_shape": {
            "D": H * K,
            "S": args.flash_qk_dim,
            "E": args.flash_value_dim,
            "C": args.flash_chunk,
        },
        "notes": notes,
    }
    print(json.dumps(with_cpu(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
