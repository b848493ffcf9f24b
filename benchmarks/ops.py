"""Forward + backward time of each family's chunk form against its naive loop and against softmax.

What it measures: wall time of one forward and one backward pass (sum of outputs as the loss) on CPU,
batch 1, 4 heads of 64 (d = 256), at T = 512, 2048, 8192; the median of --repeats runs after one
warm-up, the configurations interleaved so that machine drift does not favour one. Why: the chunkwise
form is what training and prefill use; it must beat the per-token loop by a wide margin and grow
linearly in T, while softmax attention grows quadratically.

Targets (issue 2): the gated recurrence's chunk form is >= 5x faster than its naive loop at T = 2048,
and its time grows linearly in T while softmax grows quadratically. Issue 10: the same for the gated
delta rule (family `gated_deltanet`; `deltanet` and `kda` are the other gate kinds of ``delta_rule``).

    python benchmarks/ops.py [--lengths 512,2048,8192] [--repeats 3] [--threads 2] [--families gated_deltanet]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

B, H, K = 1, 4, 64
D = H * K
NAIVE_MAX_T = 2048  # per-token loops beyond this take minutes; they are reported as skipped


def make_case(family: str, T: int):
    """Returns (fn(mode) -> output, modes) for one family at length T, inputs requiring grad."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    if family in ("gla", "retnet", "linear"):
        from edgeattn.ops import gated_linear_attention

        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K)
        if family == "gla":
            gate = (F.logsigmoid(torch.randn(B, T, H, K, generator=g)) / 16).requires_grad_()
            kw = {}
        elif family == "retnet":
            gate = torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(H, dtype=torch.float32)))
            kw = {}
        else:
            gate, kw = None, {"normalize": True}

        def fn(mode):
            qq, kk = (F.elu(q) + 1, F.elu(k) + 1) if family == "linear" else (q, k)
            return gated_linear_attention(qq, kk, v, gate, mode=mode, **kw)[0]

        return fn
    if family == "aft":
        from edgeattn.ops import aft

        q, k, v = rnd(B, T, D), rnd(B, T, D, scale=0.5), rnd(B, T, D)
        decay = (-torch.rand(D, generator=g) * 0.1).requires_grad_()
        return lambda mode: aft(q, k, v, decay=decay, mode=mode)[0]
    if family == "flash":
        from edgeattn.ops import mixed_chunk_attention

        S, E = 128, 2 * D
        qq, kq, ql, kl = (rnd(B, T, S, scale=0.3) for _ in range(4))
        v = rnd(B, T, E)
        return lambda mode: mixed_chunk_attention(qq, kq, ql, kl, v, chunk_size=64, mode=mode)[0]
    if family in ("deltanet", "gated_deltanet", "kda"):
        from edgeattn.ops import delta_rule

        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K)
        beta = rnd(B, T, H)
        gate = {
            "deltanet": None,
            "gated_deltanet": (F.logsigmoid(torch.randn(B, T, H, generator=g)) / 16).requires_grad_(),
            "kda": (F.logsigmoid(torch.randn(B, T, H, K, generator=g)) / 16).requires_grad_(),
        }[family]

        def fn(mode):  # unit keys and beta in (0, 1), as the layers feed the op
            return delta_rule(q, F.normalize(k, dim=-1), v, torch.sigmoid(beta), gate, mode=mode)[0]

        return fn
    if family in ("softmax", "swa"):
        from edgeattn.ops import softmax_attention

        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K)
        kw = {"window": 64, "sink": 4} if family == "swa" else {}
        return lambda mode: softmax_attention(q, k, v, mode=mode, **kw)[0]
    raise ValueError(family)


def time_once(fn, mode) -> float:
    t0 = time.perf_counter()
    out = fn(mode)
    out.float().sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument(
        "--families", default="gla,retnet,linear,aft,flash,swa,softmax,deltanet,gated_deltanet,kda"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    families = args.families.split(",")

    configs, missing = [], []
    for fam in families:
        for T in lengths:
            try:
                fn = make_case(fam, T)
            except ImportError:
                missing.append(fam)
                break
            configs.append((fam, T, "chunk", fn))
            if T <= NAIVE_MAX_T and fam != "softmax":
                configs.append((fam, T, "naive", fn))
    times: dict[tuple, list[float]] = {}
    for _fam, _T, mode, fn in configs:  # warm-up
        time_once(fn, mode)
    for _ in range(args.repeats):  # interleaved repeats
        for fam, T, mode, fn in configs:
            times.setdefault((fam, T, mode), []).append(time_once(fn, mode))
    med = {key: statistics.median(v) for key, v in times.items()}

    print(f"forward+backward, B={B}, H={H}, K=V={K}, {args.threads} threads, median of {args.repeats}")
    print(
        f"{'family':<15}{'T':>7}{'chunk ms':>11}{'naive ms':>11}{'speedup':>9}{'softmax ms':>12}{'vs softmax':>12}"
    )
    for fam in families:
        if fam in missing:
            print(f"{fam:<15}  (not available)")
            continue
        for T in lengths:
            c = med.get((fam, T, "chunk"))
            n = med.get((fam, T, "naive"))
            s = med.get(("softmax", T, "chunk"))
            print(
                f"{fam:<15}{T:>7}{c * 1e3:>11.1f}"
                + (f"{n * 1e3:>11.1f}{n / c:>8.1f}x" if n else f"{'-':>11}{'-':>9}")
                + (f"{s * 1e3:>12.1f}{s / c:>11.1f}x" if s else f"{'-':>12}{'-':>12}")
            )
    result = {"threads": args.threads, "lengths": lengths, "missing": missing}
    for fam in families:
        if fam in missing:
            continue
        result[fam] = {
            str(T): {m: med.get((fam, T, m)) for m in ("chunk", "naive") if (fam, T, m) in med}
            for T in lengths
        }
    for fam in families:
        if (fam, 2048, "naive") in med:
            result[f"{fam}_chunk_speedup_vs_naive_T2048"] = (
                med[(fam, 2048, "naive")] / med[(fam, 2048, "chunk")]
            )
    lo, hi = min(lengths), max(lengths)
    for fam in families:
        if (fam, lo, "chunk") in med and (fam, hi, "chunk") in med:
            result[f"{fam}_growth_{lo}_to_{hi}"] = med[(fam, hi, "chunk")] / med[(fam, lo, "chunk")]
    result["length_ratio"] = hi / lo
    print(json.dumps(with_cpu(result)))


if __name__ == "__main__":
    main()
