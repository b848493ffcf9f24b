"""Many streams per step: aggregate decode throughput and memory per stream against the number of streams N.

What it measures: a GLA model (random weights: speed and memory do not depend on them) exported with
``--dynamic-batch``, run through ``edgeattn.runtimes.streams.Streams`` on ONNX Runtime (CPU). For each N
(default 1, 2, 4, 8, 16), in a fresh process: add N streams (16-token prompts, each prefilled alone, each
sampling with its own seed), take ``--warmup`` steps, then time ``--steps`` calls of ``Streams.step()`` (one
step-graph call at batch N plus N samplings each). Reported per N, the median over ``--repeats`` fresh
processes, run interleaved (N = 1, 2, ..., then again):

- aggregate tokens/s (N * steps / time) and its ratio to N = 1, and ms per step call;
- state bytes per stream (the recurrent state one stream holds, from the manifest's shapes);
- process RSS growth per stream: (VmRSS after the timed steps - VmRSS with no stream, measured after one
  probe stream was stepped and dropped so that the weights are resident) / N; it includes what ONNX
  Runtime allocates for batch-N activations, not only the state.

    python benchmarks/streams.py [--d-model 768 --layers 12 --heads 12] [--threads 2] [--repeats 3]
    python benchmarks/streams.py --quick        # a tiny model, N = 1, 2, 4: checks the harness

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

MiB = 2**20


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def worker(args) -> None:
    """One N in this process: print one JSON line."""
    import numpy as np

    from edgeattn.runtimes.streams import Streams

    streams = Streams(args.artifact, threads=args.threads)
    rng = np.random.default_rng(0)
    # The baseline: one probe stream stepped and dropped, so the weights are paged in and the arena has
    # served batch 1; what N streams add on top is then theirs (state and batch-N activations).
    probe = streams.add(rng.integers(0, 256, args.prompt), seed=0, stop_ids=[])
    for _ in range(args.warmup):
        streams.step()
    streams.drop(probe)
    rss_open = rss()
    for i in range(args.n):
        prompt = rng.integers(0, 256, args.prompt)
        streams.add(prompt, temperature=1.0, top_k=0, seed=i, stop_ids=[])
    for _ in range(args.warmup):
        streams.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = streams.step()
        assert len(out) == args.n
    dt = time.perf_counter() - t0
    print(
        json.dumps(
            with_cpu(
                {
                    "n": args.n,
                    "seconds": dt,
                    "steps": args.steps,
                    "tokens_per_s": args.n * args.steps / dt,
                    "ms_per_step": 1e3 * dt / args.steps,
                    "state_bytes_per_stream": streams.state_bytes_per_stream,
                    "rss_open": rss_open,
                    "rss_after": rss(),
                    "rss_growth_per_stream": (rss() - rss_open) / args.n,
                }
            )
        )
    )


def build(args, workdir: Path) -> Path:
    """A random-weight GLA checkpoint exported with a dynamic batch; reused when it exists."""
    art = workdir / f"gla-d{args.d_model}-l{args.layers}-h{args.heads}-dyn"
    if (art / "edgeattn.json").is_file():
        return art
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    cfg = EdgeConfig(
        vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, mixer="gla"
    )
    model = EdgeLM(cfg)
    ckpt = workdir / "ckpt"
    model.save(ckpt)
    export_model(ckpt, art, dynamic_batch=True, include_checkpoint=False, force=True)
    return art


def model_parser(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a benchmark on ``build``'s GLA: its size (92.5M parameters by default) and
    threads; the benchmark adds its own arguments."""
    p = ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    return p


def main(argv=None) -> int:
    p = model_parser(__doc__)
    p.add_argument("--streams", default="1,2,4,8,16", help="comma-separated values of N")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None, help="where the model is built (kept for reuse)")
    p.add_argument("--quick", action="store_true", help="a tiny model, N = 1, 2, 4, few steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--artifact", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.d_model, args.layers, args.heads = 64, 2, 2
        args.streams, args.steps, args.warmup, args.repeats = "1,2,4", 3, 1, 1
    ns = [int(x) for x in args.streams.split(",")]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="edgeattn-streams-"))
    workdir.mkdir(parents=True, exist_ok=True)
    art = build(args, workdir)
    params = json.loads((art / "edgeattn.json").read_text())["model"]
    runs: dict[int, list[dict]] = {n: [] for n in ns}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for _ in range(args.repeats):
        for n in ns:  # interleaved: N = 1, 2, ... then again
            cmd = [sys.executable, __file__, "--worker", "--artifact", str(art), "--n", str(n)]
            cmd += ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--prompt", str(args.prompt)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if res.returncode != 0:
                print(res.stderr[-2000:], file=sys.stderr)
                return 1
            runs[n].append(json.loads(res.stdout.strip().splitlines()[-1]))
    rows = []
    for n in ns:
        r = runs[n]
        rows.append(
            {
                "n": n,
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in r),
                "tokens_per_s_range": [min(x["tokens_per_s"] for x in r), max(x["tokens_per_s"] for x in r)],
                "ms_per_step": statistics.median(x["ms_per_step"] for x in r),
                "state_bytes_per_stream": r[0]["state_bytes_per_stream"],
                "rss_growth_per_stream": statistics.median(x["rss_growth_per_stream"] for x in r),
                "rss_open": statistics.median(x["rss_open"] for x in r),
            }
        )
    base = rows[0]["tokens_per_s"]
    print(
        f"GLA d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab 256, "
        f"{args.threads} threads; median of {args.repeats} fresh processes, {args.steps} timed steps each"
    )
    print()
    print("| N | aggregate tok/s | x N=1 | ms / step call | state / stream | RSS growth / stream |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['tokens_per_s']:.1f} ({r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f})"
            f" | {r['tokens_per_s'] / base:.2f} | {r['ms_per_step']:.2f} | {r['state_bytes_per_stream'] / MiB:.3f} MiB"
            f" | {r['rss_growth_per_stream'] / MiB:.2f} MiB |"
        )
    print(f"\nRSS with the weights resident and no stream: {rows[0]['rss_open'] / MiB:.0f} MiB")
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "streams",
                    "model": {
                        "mixer": "gla",
                        **{k: params[k] for k in ("d_model", "n_layers", "n_heads", "vocab_size")},
                    },
                    "threads": args.threads,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "rows": rows,
                }
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
