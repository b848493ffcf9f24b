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

Builds the example with the README's recipe (build/cpp) unless --binary is given. About 6 minutes on a busy
2-core machine (mostly the large model's 10000-token runs). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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


def build(binary: Path | None) -> Path:
    if binary is not None:
        return binary
    for cmd in (
        ["bash", "scripts/fetch_onnxruntime_headers.sh"],
        ["cmake", "-S", "edgeattn/runtimes/cpp", "-B", "build/cpp", f"-DEDGEATTN_PYTHON={sys.executable}"],
        ["cmake", "--build", "build/cpp", "-j2"],
    ):
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return REPO / "build" / "cpp" / "generate"


def make_artifact(root: Path, name: str) -> tuple[Path, int]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    model = EdgeLM(EdgeConfig(mixer="gla", **MODELS[name][0]))
    params = sum(p.numel() for p in model.parameters())
    ckpt = model.save(root / f"{name}_ckpt")
    return export_model(ckpt, root / name, target="onnxruntime"), params


def run_cpp(binary: Path, art: Path, n: int, threads: int) -> dict:
    # stdout to a file, not a pipe: the example flushes every token, and waking a pipe's reader each time
    # would be timed too (about 30 us/token on a busy 2-core machine)
    with tempfile.TemporaryFile() as out:
        proc = subprocess.run(
            [str(binary), str(art), "--prompt", PROMPT, "-n", str(n), "--threads", str(threads)],
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


def measure(binary: Path, art: Path, n: int, threads: int, repeats: int, rss_tokens: int) -> dict:
    cpp, py = [], []
    for r in range(repeats):
        order = ("cpp", "py") if r % 2 == 0 else ("py", "cpp")
        for side in order:
            if side == "cpp":
                cpp.append(run_cpp(binary, art, n, threads))
            else:
                py.append(run_python(art, n, threads))
    cpp_mem = run_cpp(binary, art, rss_tokens, threads)
    py_mem = run_python(art, rss_tokens, threads)
    cpp_us = statistics.median(x["us_per_token"] for x in cpp)
    py_us = statistics.median(x["us_per_token"] for x in py)
    return {
        "tokens": n,
        "cpp_us_per_token": cpp_us,
        "python_us_per_token": py_us,
        "speedup": py_us / cpp_us,
        "cpp_us_all": [round(x["us_per_token"], 1) for x in cpp],
        "python_us_all": [round(x["us_per_token"], 1) for x in py],
        "same_tokens": len({x["tokens_sha256"] for x in cpp + py}) == 1
        and cpp_mem["tokens_sha256"] == py_mem["tokens_sha256"],
        "rss_tokens": rss_tokens,
        "cpp_rss_bytes_start": cpp_mem["rss_bytes_start"],
        "cpp_rss_bytes_last": cpp_mem["rss_bytes_last"],
        "cpp_peak_arena_bytes_at_128": cpp_mem["peak_bytes_at_128"],
        "cpp_peak_arena_bytes_at_last": cpp_mem["peak_bytes_at_last"],
        "python_rss_bytes_start": py_mem["rss_bytes_start"],
        "python_rss_bytes_last": py_mem["rss_bytes_last"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads, both sides")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rss-tokens", type=int, default=10000)
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--binary", type=Path, default=None, help="a built generate (default: build build/cpp)")
    args = ap.parse_args()

    binary = build(args.binary)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            art, params = make_artifact(Path(tmp), name)
            n = MODELS[name][1]
            results[name] = {
                "config": MODELS[name][0],
                "params": params,
                **measure(binary, art, n, args.threads, args.repeats, args.rss_tokens),
            }

    print(
        f"GLA, onnxruntime target, fp32; {args.threads} intra-op thread(s), both sides; {args.repeats} runs"
    )
    at = "@" + str(args.rss_tokens)
    print(
        f"{'model':<26}{'C++ us/tok':>11}{'Py us/tok':>10}{'Py/C++':>8}{'C++ RSS MiB':>12}{at:>8}"
        f"{'arena MiB @128':>15}{at:>8}{'Py RSS MiB':>11}{at:>8}"
    )
    for name, r in results.items():
        c = r["config"]
        label = f"{name} d{c['d_model']} L{c['n_layers']} ({r['params'] / 1e6:.1f}M)"
        print(
            f"{label:<26}{r['cpp_us_per_token']:>11.1f}{r['python_us_per_token']:>10.1f}{r['speedup']:>7.2f}x"
            f"{r['cpp_rss_bytes_start'] / MiB:>12.1f}{r['cpp_rss_bytes_last'] / MiB:>8.1f}"
            f"{r['cpp_peak_arena_bytes_at_128'] / MiB:>15.2f}{r['cpp_peak_arena_bytes_at_last'] / MiB:>8.2f}"
            f"{r['python_rss_bytes_start'] / MiB:>11.1f}{r['python_rss_bytes_last'] / MiB:>8.1f}"
        )
    for name, r in results.items():
        if not r["same_tokens"]:
            print(f"warning: {name}: C++ and Python generated different tokens")
    met = results["small"]["speedup"] >= TARGET_SPEEDUP if "small" in results else None
    if met is not None:
        print(f"target: C++ >= {TARGET_SPEEDUP}x faster on the small model: {'met' if met else 'NOT met'}")
    print(
        json.dumps({"threads": args.threads, "repeats": args.repeats, "models": results, "target_met": met})
    )


if __name__ == "__main__":
    main()
