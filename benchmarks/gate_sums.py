"""The price of keeping the cumulative gates as float32 sums (``EDGEATTN_GATE_SUM=float32``, fla's form)
instead of the shipped exact float32 pairs (issue 36): edgeattn's Triton chunk kernels in both forms against
fla's recurrent references, an independent implementation (``naive_recurrent_gla``,
``naive_recurrent_simple_gla``, ``naive_recurrent_gated_delta_rule``, ``naive_recurrent_kda``; float64
leaves, computed in float32 by fla), with typical gates (logsigmoid(N(2, 1)), about -0.15 a step) and with a
fifth of the steps at -1e4 (a state wiped), where float32 sums near 1e4 keep their differences only to 1e-3.

Per op, gate strength and form: the relative RMS error (||got - ref|| / ||ref||) of the output, the final
state and every gradient (a fixed random projection of both as the loss), and the worst of them. Runs in
Triton's interpreter without a GPU (float32 inputs), compiled on one.

    python benchmarks/gate_sums.py [--T 70] [--K 16] [--heads 2]

Prints the table, then ONE JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgeattn.bench.args import ArgumentParser  # noqa: E402
from edgeattn.bench.machine import with_cpu  # noqa: E402

OPS = ("gla", "simple_gla", "gated_delta", "kda")


def inputs(op: str, T: int, H: int, K: int, strong: bool, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen))
    x["v"] = torch.randn(1, T, H, K, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, K if op in ("gla", "kda") else 1, generator=gen) + 2)
    if strong:
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.2, torch.full_like(g, -1e4), g)
    x["g"] = g
    if op in ("gated_delta", "kda"):
        x["k"] = F.normalize(x["k"], dim=-1)
        x["beta"] = torch.rand(1, T, H, generator=gen)
    x["S0"] = torch.randn(1, H, K, K, generator=gen)
    return x


def ours(op: str, x: dict):
    from edgeattn.kernels import chunk_delta_rule_triton, chunk_gated_recurrence_kernel

    K = x["q"].shape[-1]
    if op in ("gla", "simple_gla"):  # unscaled: o = q S; fla's references scale q by K ** -0.5
        return chunk_gated_recurrence_kernel(x["q"] * K**-0.5, x["k"], x["v"], x["g"], initial_state=x["S0"])
    return chunk_delta_rule_triton(
        x["q"], x["k"], x["v"], x["beta"], x["g"].squeeze(-1) if op == "gated_delta" else x["g"],
        scale=K**-0.5, initial_state=x["S0"],
    )  # fmt: skip


def reference(op: str, x: dict):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.kda.naive import naive_recurrent_kda
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, g, S0 = x["q"], x["k"], x["v"], x["g"], x["S0"]
    K = q.shape[-1]
    if op == "gla":
        return naive_recurrent_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    if op == "simple_gla":
        return naive_recurrent_simple_gla(q, k, v, g.squeeze(-1), initial_state=S0, output_final_state=True)
    if op == "gated_delta":
        return naive_recurrent_gated_delta_rule(
            q, k, v, x["beta"], g.squeeze(-1), scale=K**-0.5, initial_state=S0, output_final_state=True
        )
    return naive_recurrent_kda(
        q, k, v, g, x["beta"], scale=K**-0.5, initial_state=S0, output_final_state=True
    )


def errors(op: str, x: dict, form: str) -> dict:
    """Relative RMS of ours (gate sums ``form``) against fla's reference: output, final state, gradients."""
    import torch

    from edgeattn.kernels import delta_chunk, utils

    def run(fn, dtype):
        leaves = {n: t.to(dtype).clone().requires_grad_() for n, t in x.items()}
        o, S = fn(op, leaves)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen).to(o.dtype)).sum()
        loss = loss + (S * torch.randn(S.shape, generator=gen).to(S.dtype)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return {"o": o, "S": S, **{f"d{n}": gr for n, gr in zip(leaves, grads)}}

    saved = utils.GATE_SUM, delta_chunk.WY
    utils.GATE_SUM = form
    try:
        got = run(ours, torch.float32)
    finally:
        utils.GATE_SUM, delta_chunk.WY = saved
    ref = run(reference, torch.float64)
    out = {}
    for name, r in ref.items():
        a, r = got[name].double(), r.double()
        out[name] = ((a - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30)).item()
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="gate_sums", description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=70, help="tokens (default 70: a chunk of 64 and a partial one)")
    ap.add_argument("--K", type=int, default=16, help="head size K = V (default 16)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--ops", default=",".join(OPS), help="some of " + ",".join(OPS))
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    if not ops or set(ops) - set(OPS):
        ap.error(f"--ops: expected some of {', '.join(OPS)}, got {args.ops!r}")
    if args.T < 1 or args.K < 1 or args.K > 256 or args.heads < 1:
        ap.error("--T and --heads must be positive, --K within 1..256")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("no CUDA device and TRITON_INTERPRET is not 1")
    rows = []
    print(f"| op | gates | gate sums | output | final state | worst gradient |  (T={args.T}, K=V={args.K})")
    print("|---|---|---|---|---|---|")
    for op in ops:
        for strong in (False, True):
            x = inputs(op, args.T, args.heads, args.K, strong)
            for form in ("pair", "float32"):
                e = errors(op, x, form)
                worst = max(v for n, v in e.items() if n.startswith("d"))
                gates = "a fifth at -1e4" if strong else "typical"
                rows.append(dict(op=op, gates=gates, form=form, errors=e, worst_gradient=worst))
                print(f"| {op} | {gates} | {form} | {e['o']:.1e} | {e['S']:.1e} | {worst:.1e} |", flush=True)
    print(
        json.dumps(
            with_cpu({"bench": "gate_sums", "T": args.T, "K": args.K, "heads": args.heads, "rows": rows})
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
