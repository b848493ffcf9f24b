"""Decode latency and resident memory: the C++ example (examples/cpp/generate.cpp) against the Python session.

Why: the C++ runtime (edgeattn/runtimes/cpp) exists to embed a model in an app without Python. Both sides run
the same ONNX Runtime library on the same graphs with IoBinding and double-buffered state, so what differs is
the work around each Run (Python: argument checks, OrtValue updates, numpy copies and sampling in the
interpreter) and the memory of the process around the model. That overhead shows on small models and vanishes
on large ones; the target is C++ at least 1.2x faster per token on the small model.

What it measures, on one artifact per model (GLA with random weights, which speed and memory do not depend on;
target onnxruntime, fp32) with the same intra-op thread count on both sides:

- models: small (d_model 128, 2 layers, 2 heads) and large (d_model 512, 8 layers, 8 heads);
- per-token decode latency, greedy, after the same prompt: `generate ART --prompt P -n N --threads T` (the
  us_per_token of its JSON line: prefill excluded, sampling and stepping included; stdout to a file) against
  `open_session(ART, threads=T).generate_ids(P, N, temperature=0)` timed from its first token to its last.
  Every run is a fresh process on both sides (session creation and prefill not timed); the median of
  --repeats runs, the order alternating between repeats;
- resident memory (VmRSS from /proc) of the C++ process before its first generated token and after
  --rss-tokens (default 10000), with ONNX Runtime's arena peak at token 128 and at the last; the Python
  process's VmRSS at the same points for comparison;
- that both sides generate the same tokens.

    nice python benchmarks/cpp_vs_python.py [--threads 1] [--repeats 7] [--binary build/cpp/generate]
        [--artifact DIR] [--own-weights] [--skip-python]

--artifact measures an exported artifact instead of the built-in models (e.g. the 92.5M GLA of issue 13:
d_model 768, 12 layers, 12 heads). --own-weights also runs the C++ example with --no-share-weights (each
of its two ONNX Runtime sessions loads and prepacks its own copy of the weights), interleaved with the
default (weights.bin mapped once, one prepacked-weights container for both sessions). --skip-python
leaves the Python session out.

Builds the example with the README's recipe (build/cpp) unless --binary is given. About 6 minutes on a busy
2-core machine (mostly the large model's 10000-token runs). Prints a table, then one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a"
MODELS = {  # name -> (EdgeConfig kwargs, decode tokens per timed run)
    "small": (dict(d_model=128, n_layers=2, n_heads=2), 2000),
    "large": (dict(d_model=512, n_layers=8, n_heads=8), 300),
}
TARGET_SPEEDUP = 1.2
MiB = 2**20

PY_WORKER = r"""
import hashlib, json, sys, time
from edgeattn.runtimes import open_session

art, prompt, n, threads = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

sess = open_session(art, threads=threads)
gen = sess.generate_ids(prompt, n, temperature=0)
tokens = [next(gen)]  # prefill + the first token
rss_start = rss()
t0 = time.perf_counter()
tokens += gen  # n - 1 more tokens, each generated token stepped
dt = time.perf_counter() - t0
print(json.dumps({"us_per_token": 1e6 * dt / n, "rss_bytes_start": rss_start, "rss_bytes_last": rss(),
                  "tokens_sha256": hashlib.sha256(bytes(tokens)).hexdigest()}))
"""


def build(binary: Path | None, program: str = "generate") -> Path:
    """``binary`` if given, else the C++ runtime and its examples built into build/cpp: that ``program``."""
    if binary is not None:
        return binary
    for cmd in (
        ["bash", "scripts/fetch_onnxruntime_headers.sh"],
        ["cmake", "-S", "edgeattn/runtimes/cpp", "-B", "build/cpp", f"-DEDGEATTN_PYTHON={sys.executable}"],
        ["cmake", "--build", "build/cpp", "-j2"],
    ):
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return REPO / "build" / "cpp" / program


def make_artifact(root: Path, name: str) -> tuple[Path, int]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    model = EdgeLM(EdgeConfig(mixer="gla", **MODELS[name][0]))
    params = sum(p.numel() for p in model.parameters())
    ckpt = model.save(root / f"{name}_ckpt")
    return export_model(ckpt, root / name, target="onnxruntime"), params


def run_cpp(binary: Path, art: Path, n: int, threads: int, extra: tuple = ()) -> dict:
    # stdout to a file, not a pipe: the example flushes every token, and waking a pipe's reader each time
    # would be timed too (about 30 us/token on a busy 2-core machine)
    with tempfile.TemporaryFile() as out:
        proc = subprocess.run(
            [str(binary), str(art), "--prompt", PROMPT, "-n", str(n), "--threads", str(threads), *extra],
            stdout=out,
            stderr=subprocess.PIPE,
            check=True,
        )
        out.seek(0)
        text = out.read()
    report = json.loads(proc.stderr.decode().strip().splitlines()[-1])
    report["tokens_sha256"] = hashlib.sha256(text[len(PROMPT.encode()) : -1]).hexdigest()
    return report


def run_python(art: Path, n: int, threads: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PY_WORKER, str(art), PROMPT, str(n), str(threads)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


OWN = ("--no-share-weights",)


def measure(
    binary: Path,
    art: Path,
    n: int,
    threads: int,
    repeats: int,
    rss_tokens: int,
    own_weights: bool = False,
    python: bool = True,
) -> dict:
    sides = ["cpp", *(["cpp_own"] if own_weights else []), *(["py"] if python else [])]
    runs = {side: [] for side in sides}

    def run(side: str, tokens: int) -> dict:
        if side == "py":
            return run_python(art, tokens, threads)
        return run_cpp(binary, art, tokens, threads, OWN if side == "cpp_own" else ())

    for r in range(repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            runs[side].append(run(side, n))
    mem = {side: run(side, rss_tokens) for side in sides}
    us = {side: statistics.median(x["us_per_token"] for x in runs[side]) for side in sides}
    out = {
        "tokens": n,
        "cpp_us_per_token": us["cpp"],
        "cpp_us_all": [round(x["us_per_token"], 1) for x in runs["cpp"]],
        "same_tokens": len({x["tokens_sha256"] for side in sides for x in runs[side]}) == 1
        and len({mem[side]["tokens_sha256"] for side in sides}) == 1,
        "rss_tokens": rss_tokens,
        "cpp_rss_bytes_start": mem["cpp"]["rss_bytes_start"],
        "cpp_rss_bytes_last": mem["cpp"]["rss_bytes_last"],
        "cpp_peak_arena_bytes_at_128": mem["cpp"]["peak_bytes_at_128"],
        "cpp_peak_arena_bytes_at_last": mem["cpp"]["peak_bytes_at_last"],
    }
    if python:
        out |= {
            "python_us_per_token": us["py"],
            "speedup": us["py"] / us["cpp"],
            "python_us_all": [round(x["us_per_token"], 1) for x in runs["py"]],
            "python_rss_bytes_start": mem["py"]["rss_bytes_start"],
            "python_rss_bytes_last": mem["py"]["rss_bytes_last"],
        }
    if own_weights:
        out |= {
            "cpp_own_us_per_token": us["cpp_own"],
            "cpp_own_us_all": [round(x["us_per_token"], 1) for x in runs["cpp_own"]],
            "cpp_own_rss_bytes_start": mem["cpp_own"]["rss_bytes_start"],
            "cpp_own_rss_bytes_last": mem["cpp_own"]["rss_bytes_last"],
            "cpp_own_peak_arena_bytes_at_last": mem["cpp_own"]["peak_bytes_at_last"],
        }
    return out


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads, both sides")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rss-tokens", type=int, default=10000)
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--binary", type=Path, default=None, help="a built generate (default: build build/cpp)")
    ap.add_argument("--artifact", type=Path, default=None, help="measure this artifact instead of --models")
    ap.add_argument("--tokens", type=int, default=300, help="decode tokens per timed run of --artifact")
    ap.add_argument("--own-weights", action="store_true", help="also C++ with --no-share-weights")
    ap.add_argument("--skip-python", action="store_true", help="leave the Python session out")
    args = ap.parse_args()
    if args.artifact is not None:
        ap.check_artifact(args.artifact, "--artifact")

    binary = build(args.binary)
    results = {}
    opts = dict(own_weights=args.own_weights, python=not args.skip_python)
    if args.artifact is not None:
        cfg = json.loads((args.artifact / "edgeattn.json").read_text())["model"]
        config = {k: cfg[k] for k in ("d_model", "n_layers", "n_heads")}
        ckpt = args.artifact / "checkpoint" / "model.safetensors"
        params = _safetensors_params(ckpt) if ckpt.is_file() else 0
        results["artifact"] = {
            "config": config,
            "params": params,
            "path": str(args.artifact),
            **measure(
                binary, args.artifact, args.tokens, args.threads, args.repeats, args.rss_tokens, **opts
            ),
        }
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models.split(","):
                art, params = make_artifact(Path(tmp), name)
                n = MODELS[name][1]
                results[name] = {
                    "config": MODELS[name][0],
                    "params": params,
                    **measure(binary, art, n, args.threads, args.repeats, args.rss_tokens, **opts),
                }

    print(f"GLA, fp32; {args.threads} intra-op thread(s), every side; {args.repeats} runs")
    at = "@" + str(args.rss_tokens)
    print(f"{'model':<30}{'side':<22}{'us/tok':>10}{'RSS MiB start':>14}{at:>8}{'arena MiB @last':>16}")
    for name, r in results.items():
        c = r["config"]
        label = f"{name} d{c['d_model']} L{c['n_layers']} ({r['params'] / 1e6:.1f}M)"
        rows = [("C++ (shared weights)", "cpp", r["cpp_peak_arena_bytes_at_last"])]
        if "cpp_own_us_per_token" in r:
            rows.append(("C++ --no-share-weights", "cpp_own", r["cpp_own_peak_arena_bytes_at_last"]))
        if "python_us_per_token" in r:
            rows.append(("Python session", "python", None))
        for side, key, arena in rows:
            arena_txt = f"{arena / MiB:>16.2f}" if arena else f"{'-':>16}"
            print(
                f"{label:<30}{side:<22}{r[f'{key}_us_per_token']:>10.1f}"
                f"{r[f'{key}_rss_bytes_start'] / MiB:>14.1f}{r[f'{key}_rss_bytes_last'] / MiB:>8.1f}{arena_txt}"
            )
            label = ""
        if "speedup" in r:
            print(f"  Python / C++ per token: {r['speedup']:.2f}x")
        if "cpp_own_us_per_token" in r:
            print(
                f"  shared / own weights: {r['cpp_us_per_token'] / r['cpp_own_us_per_token']:.2f}x per token, "
                f"{r['cpp_rss_bytes_last'] / r['cpp_own_rss_bytes_last']:.2f}x RSS {at}"
            )
    for name, r in results.items():
        if not r["same_tokens"]:
            print(f"warning: {name}: the sides generated different tokens")
    met = None
    if "small" in results and "speedup" in results["small"]:
        met = results["small"]["speedup"] >= TARGET_SPEEDUP
        print(f"target: C++ >= {TARGET_SPEEDUP}x faster on the small model: {'met' if met else 'NOT met'}")
    print(
        json.dumps(
            with_cpu({"threads": args.threads, "repeats": args.repeats, "models": results, "target_met": met})
        )
    )


def _safetensors_params(path: Path) -> int:
    """Parameter count from a safetensors header (no torch)."""
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
    return total


if __name__ == "__main__":
    main()
