"""Training quality on a small CPU budget: validation bits per byte after a fixed wall-clock time.

What it measures: for each mixer given (default gla retnet linear softmax), `edgeattn train` with the
default small model (edgeattn.cli.train.DEFAULT_MODEL) and default training options on the default
corpus (the Python standard library's source) for --time-budget seconds; then the steps done, training
throughput (tokens/s), the final validation loss in bits per byte, and a sample from the checkpoint.
Why: the README's claim that a GLA model learns Python-like text in 10 minutes on a laptop-class CPU,
and how the other mixers compare under the same budget (same data, same schedule, same seed).

    .venv/bin/python benchmarks/train_quality.py gla retnet --time-budget 600 --threads 2

Equivalent CLI per mixer: edgeattn train --mixer M --time-budget 600 --out OUT/M, then
edgeattn sample OUT/M --prompt 'def ' --max-new-tokens 300 --temperature 0.8 --top-k 50 --seed 0.
Prints a table for people and ends with one JSON line for programs.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

# On a machine shared with other jobs, OpenMP threads that spin while waiting for a descheduled peer make
# every step many times slower (measured here: 2 spinning threads ran 10x slower than 1). Sleeping
# waiters keep a busy machine usable; it must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_one(mixer: str, args) -> dict:
    from edgeattn.cli.train import DEFAULT_MODEL
    from edgeattn.layers import MIXER_REGISTRY
    from edgeattn.models import EdgeConfig, EdgeLM
    from edgeattn.train import TrainConfig, generate, train

    if mixer not in MIXER_REGISTRY:
        return {"mixer": mixer, "status": "not registered (layer not written yet)"}
    model_cfg = EdgeConfig.from_dict({**DEFAULT_MODEL, "mixer": mixer})
    out = Path(args.out) / mixer
    t, cpu = time.perf_counter(), time.process_time()
    result = train(
        model_cfg, TrainConfig(time_budget=args.time_budget, seed=args.seed), out=out, overwrite=True
    )
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    load = os.getloadavg()[0]  # other processes on the machine slow a wall-clock budget down
    model = EdgeLM.load(out)
    prompt = list(args.prompt.encode())
    ids = list(generate(model, prompt, args.sample_tokens, temperature=0.8, top_k=50, seed=args.seed))
    return {
        "mixer": mixer,
        "status": "ok",
        "steps": result.step,
        "tokens": result.tokens,
        "tokens_per_s": round(result.tokens_per_s, 1),
        "train_s": round(result.elapsed, 1),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_avg_1m_at_end": round(load, 2),
        "val_loss": round(result.val_loss, 4),
        "val_bpb": round(result.val_bpb, 4),
        "history": [(h["step"], round(h["elapsed"], 1), round(h["val_bpb"], 4)) for h in result.history],
        "sample": bytes(prompt + ids).decode("utf-8", errors="replace"),
        "checkpoint": str(out),
    }


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mixers", nargs="*", default=["gla", "retnet", "linear", "softmax"])
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds of training per mixer")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default=None, help="checkpoint root [default: a temp dir]")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.out = args.out or tempfile.mkdtemp(prefix="edgeattn-quality-")
    rows = []
    for mixer in args.mixers:
        row = run_one(mixer, args)
        rows.append(row)
        print(json.dumps(with_cpu({k: v for k, v in row.items() if k != "history"})), flush=True)

    print(f"\n{'mixer':<10}{'steps':>7}{'tok/s':>9}{'val bpb':>9}{'cpu s':>8}{'load':>6}  status")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['mixer']:<10}{'-':>7}{'-':>9}{'-':>9}{'-':>8}{'-':>6}  {r['status']}")
        else:
            print(
                f"{r['mixer']:<10}{r['steps']:>7}{r['tokens_per_s']:>9.0f}{r['val_bpb']:>9.3f}"
                f"{r['cpu_s']:>8.0f}{r['load_avg_1m_at_end']:>6.1f}  ok"
            )
    for r in rows:
        if r["status"] == "ok":
            print(f"\n--- {r['mixer']} sample ---\n{r['sample']}")
    print(
        json.dumps(
            with_cpu({"benchmark": "train_quality", "time_budget_s": args.time_budget, "results": rows})
        )
    )


if __name__ == "__main__":
    main()
