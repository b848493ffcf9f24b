"""Aggregate decode throughput of the C++ Streams (examples/cpp/streams.cpp) against the number of streams.

Why: issue 13 item 5. N streams stepped together make one step-graph call at batch N per token; the weights
are read once per call instead of N times, so aggregate tokens/s should grow with N while the memory per
stream is its state alone.

What it measures, on one GLA artifact exported with --dynamic-batch (random weights, target onnxruntime,
fp32), with the same intra-op thread count throughout:

- for N in --streams (default 1,2,4,8,16): `streams ART --prompt P_1 ... --prompt P_N -n TOKENS` (greedy),
  aggregate tokens/s over the decode steps (prefill excluded) and the process's VmRSS after decoding; the
  median of --repeats fresh processes, N values interleaved;
- the baseline: one stream through a plain Session (`--separate` with one prompt);
- the state bytes per stream the runtime reports (the memory a stream adds, nothing more).

    nice python benchmarks/cpp_streams.py [--threads 1] [--repeats 3] [--tokens 100] [--artifact DIR]
        [--binary build/cpp/streams] [--d-model 512 --layers 8 --heads 8]

Builds the example with the README's recipe (build/cpp) unless --binary is given. Prints a table, then one
JSON line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpp_vs_python import build  # noqa: E402  (the same CMake build)

from edgeattn.bench.machine import with_cpu

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away,",
    "def main():\n    return 0",
    "It was a dark and stormy night",
]
MiB = 2**20


def make_artifact(root: Path, d_model: int, layers: int, heads: int) -> Path:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    model = EdgeLM(EdgeConfig(mixer="gla", d_model=d_model, n_layers=layers, n_heads=heads))
    ckpt = model.save(root / "ckpt")
    return export_model(ckpt, root / "art", target="onnxruntime", dynamic_batch=True)


def run(binary: Path, art: Path, n: int, tokens: int, threads: int, separate: bool = False) -> dict:
    cmd = [str(binary), str(art), "-n", str(tokens), "--threads", str(threads)]
    for i in range(n):
        cmd += ["--prompt", PROMPTS[i % len(PROMPTS)]]
    if separate:
        cmd.append("--separate")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--artifact", type=Path, default=None, help="an artifact exported with --dynamic-batch")
    ap.add_argument("--binary", type=Path, default=None, help="a built streams (default: build build/cpp)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()

    binary = build(args.binary, "streams")
    counts = [int(x) for x in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        art = args.artifact or make_artifact(Path(tmp), args.d_model, args.layers, args.heads)
        runs: dict[str, list[dict]] = {"session": [], **{str(n): [] for n in counts}}
        for r in range(args.repeats):
            order = ["session", *map(str, counts)]
            for key in order if r % 2 == 0 else order[::-1]:
                if key == "session":
                    runs[key].append(run(binary, art, 1, args.tokens, args.threads, separate=True))
                else:
                    runs[key].append(run(binary, art, int(key), args.tokens, args.threads))
        model = json.loads((art / "edgeattn.json").read_text())["model"]

    rows = {}
    for key, rs in runs.items():
        rows[key] = {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
            "us_per_step": statistics.median(x["us_per_step"] for x in rs),
            "rss_bytes": statistics.median(x["rss_bytes"] for x in rs),
            "tokens_per_s_all": [round(x["tokens_per_s"], 1) for x in rs],
        }
    state_bytes = runs[str(counts[0])][0]["state_bytes_per_stream"]
    base = rows["session"]["tokens_per_s"]
    print(
        f"GLA d{model['d_model']} L{model['n_layers']} H{model['n_heads']}, fp32, --dynamic-batch; "
        f"{args.threads} thread(s); {args.tokens} tokens per stream; median of {args.repeats}"
    )
    print(f"state per stream: {state_bytes} bytes ({state_bytes / MiB:.2f} MiB)")
    print(f"{'streams':<12}{'tok/s (all)':>12}{'us/step':>10}{'x Session':>11}{'RSS MiB':>10}")
    for key, r in rows.items():
        label = "Session" if key == "session" else key
        print(
            f"{label:<12}{r['tokens_per_s']:>12.1f}{r['us_per_step']:>10.1f}{r['tokens_per_s'] / base:>10.2f}x"
            f"{r['rss_bytes'] / MiB:>10.1f}"
        )
    print(
        json.dumps(
            with_cpu(
                {
                    "model": {k: model[k] for k in ("d_model", "n_layers", "n_heads")},
                    "threads": args.threads,
                    "tokens": args.tokens,
                    "repeats": args.repeats,
                    "state_bytes_per_stream": state_bytes,
                    "rows": rows,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
