"""edgeattn's CPU GroupQueryAttention kernel (edgeattn/runtimes/attention.cc) against ONNX Runtime's own, on one
artifact with float32 KV buffers (issue 39), or with ``--op matmul`` its MatMulNBits kernel (matmul.cc) on an
int4 artifact: fresh processes alternating the two (``EDGEATTN_ATTENTION`` / ``EDGEATTN_MATMUL``), each
measuring decode at every ``--contexts`` (the state placed at that context: random KV slots and recurrent
states, the timing does not depend on their values; the median of ``--steps`` steps) and prefill (``--prefill``
tokens from an empty state, and ``--chunk`` tokens on top of each ``--depths`` context).

    python benchmarks/attention_kernel.py --artifact DIR [--contexts 128,4096,16384] [--depths 8000,16000] \
        [--rounds 3] [--threads 2]
    python -m edgeattn.bench.cpu_as avx2 -- python benchmarks/attention_kernel.py --artifact DIR   # AVX2 kernels
    python -m edgeattn.bench.cpu_as avx2 -- python benchmarks/attention_kernel.py --op matmul --artifact DIR

Prints a table (median over rounds [min-max]; decode ms a token, prefill tokens/s) and ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

KERNELS = ("edgeattn", "onnxruntime")
OPS = {"attention": "EDGEATTN_ATTENTION", "matmul": "EDGEATTN_MATMUL"}  # --op: the session attribute, its env


def place_state(sess, p: int, rng: np.random.Generator) -> None:
    """Put ``sess`` at position ``p``: random values in its KV buffers' first ``p`` slots and in its recurrent
    states (a decode step's time does not depend on them)."""
    state = sess.get_state()
    for e in sess.manifest.state:
        a = state[e.input]
        if e.name == "position":
            a[...] = p
        elif e.shared:  # a KV buffer [B, Hkv, L, D]: its first p slots
            a[:, :, :p] = rng.standard_normal((*a.shape[:2], p, a.shape[3])).astype(np.float32) * 0.5
        else:
            a[...] = rng.standard_normal(a.shape).astype(np.float32) * 0.01
    sess.set_state(state, position=p)


def measure(cfg: dict) -> dict:
    """One process: the artifact's session on the kernels $EDGEATTN_ATTENTION and $EDGEATTN_MATMUL chose."""
    from edgeattn.runtimes import open_session

    sess = open_session(cfg["artifact"], threads=cfg["threads"])
    rng = np.random.default_rng(0)

    def place(p: int) -> None:
        place_state(sess, p, rng)

    token = np.array([[7]], np.int64)
    out = {"attention": sess.attention, "matmul": sess.matmul, "decode_ms": {}, "prefill_tps": {}}
    for c in cfg["contexts"]:
        place(c)
        sess.step(token)  # untimed
        times = []
        for _ in range(cfg["steps"]):
            t = time.perf_counter()
            sess.step(token)
            times.append(1e3 * (time.perf_counter() - t))
        out["decode_ms"][str(c)] = statistics.median(times)
    ids = rng.integers(0, min(sess.manifest.vocab_size, 1000), (1, max(cfg["prefill"], cfg["chunk"])))
    sess.reset()
    t = time.perf_counter()
    sess.prefill(ids[:, : cfg["prefill"]])
    out["prefill_tps"]["0"] = cfg["prefill"] / (time.perf_counter() - t)
    for d in cfg["depths"]:
        place(d)
        t = time.perf_counter()
        sess.prefill(ids[:, : cfg["chunk"]])
        out["prefill_tps"][str(d)] = cfg["chunk"] / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--artifact",
        type=Path,
        default=None,
        help="an edgeattn artifact: with float32 KV buffers (--op attention), int4 (--op matmul)",
    )
    ap.add_argument("--contexts", default="128,4096,16384")
    ap.add_argument("--depths", default="8000,16000", help="contexts a --chunk-token prefill is measured on")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens of the prefill from an empty state")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--op", choices=sorted(OPS), default="attention", help="whose two kernels race")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one measuring process
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        depths = [int(c) for c in args.depths.split(",") if c.strip()]
    except ValueError:
        ap.error("--contexts and --depths must be comma-separated integers")
    if (
        min([*contexts, *depths, args.prefill, args.chunk, args.steps, args.rounds, args.threads], default=0)
        < 1
    ):
        ap.error("--contexts, --depths, --prefill, --chunk, --steps, --rounds and --threads must be positive")
    if args.artifact is None or not (args.artifact / "edgeattn.json").is_file():
        ap.error(f"--artifact {args.artifact}: not an edgeattn artifact (no edgeattn.json)")
    cfg = {"artifact": str(args.artifact), "threads": args.threads, "contexts": contexts, "depths": depths}
    cfg.update(prefill=args.prefill, chunk=args.chunk, steps=args.steps)
    runs: dict[str, list[dict]] = {k: [] for k in KERNELS}
    for r in range(args.rounds):
        for kernel in KERNELS:  # alternating, a fresh process each
            env = {**os.environ, OPS[args.op]: kernel}
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(cfg)],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                sys.exit(f"attention_kernel: the {kernel} worker failed: {last}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            if res[args.op]["kernel"] != kernel:
                sys.exit(f"attention_kernel: asked for {kernel} {args.op}, the session ran {res[args.op]}")
            runs[kernel].append(res)
            print(f"round {r + 1} {kernel}: {res['decode_ms']} {res['prefill_tps']}", file=sys.stderr)

    def cell(kernel: str, key: str, col: str) -> tuple[float, float, float]:
        xs = [run[key][col] for run in runs[kernel]]
        return statistics.median(xs), min(xs), max(xs)

    cols = [("decode_ms", str(c), f"decode ms @{c}") for c in contexts]
    cols += [("prefill_tps", "0", f"prefill {args.prefill} tok/s")]
    cols += [("prefill_tps", str(d), f"{args.chunk} on {d} tok/s") for d in depths]
    print(f"\n{args.artifact}, {args.op}, {args.threads} threads, {args.rounds} rounds: median [min-max]\n")
    print(f"| {args.op} kernel | " + " | ".join(c[2] for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for kernel in KERNELS:
        cells = [cell(kernel, k, c) for k, c, _ in cols]
        print(f"| {kernel} | " + " | ".join(f"{m:.1f} [{lo:.1f}-{hi:.1f}]" for m, lo, hi in cells) + " |")
    ratios = {}
    for key, col, name in cols:
        ours, theirs = cell("edgeattn", key, col)[0], cell("onnxruntime", key, col)[0]
        ratios[name] = theirs / ours if key == "decode_ms" else ours / theirs  # > 1: edgeattn's faster
    print(
        "\nedgeattn's kernel against ONNX Runtime's (> 1: faster): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    )
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "attention_kernel",
                    "op": args.op,
                    **cfg,
                    "rounds": args.rounds,
                    "runs": runs,
                    "ratios": ratios,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
