"""Decode and prefill speed and memory of exported artifacts (issue 4's targets), on this CPU.

What it measures, for a GLA model with d_model 512, 8 layers, 8 heads (random weights: speed and memory
do not depend on them) and a softmax KV-cache baseline of the same size:
- per-token decode latency through the ONNX Runtime session (IOBinding, fused target) and the torch
  session, and the memory floor: weight bytes read per token / this machine's read bandwidth (measured);
- prefill throughput of the fused `onnxruntime` target against `portable`, and decode of both;
- prompt tokens/s through prefill.onnx against single steps;
- resident memory at token 512 and at token --long (default 16384) of step-by-step decoding, each model in a
  fresh process, so the growth is the state's (constant) or the KV cache's (linear);
- int8 against fp32: decode speed, and bits per byte on Python source with a trained checkpoint
  (--trained CKPT, e.g. from `edgeattn train`; skipped without it).
Each timing is the median of --repeats runs after warm-up; configurations alternate between runs.

    python benchmarks/export.py [--threads 2] [--long 16384] [--trained runs/demo/gla]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

HERE = Path(__file__).resolve().parent


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (numpy sum over a large float32 array), best of N."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def make_artifacts(root: Path, threads: int) -> dict[str, Path]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    arts = {}
    for mixer in ("gla", "softmax"):
        cfg = EdgeConfig(d_model=512, n_layers=8, n_heads=8, mixer=mixer, max_seq_len=20000)
        ckpt = EdgeLM(cfg).save(root / f"{mixer}_ckpt")
        for target, precision in (("onnxruntime", "fp32"), ("portable", "fp32"), ("onnxruntime", "int8")):
            if mixer == "softmax" and (target, precision) != ("onnxruntime", "fp32"):
                continue
            name = f"{mixer}_{target}_{precision}"
            arts[name] = export_model(ckpt, root / name, target=target, precision=precision)
    return arts


def weight_bytes(art: Path) -> int:
    """Bytes of initializers in the step graph: what a decode step reads."""
    import onnx

    m = onnx.load(str(art / "step.onnx"))
    return sum(onnx.numpy_helper.to_array(i).nbytes for i in m.graph.initializer)


def time_decode(sess, n: int) -> float:
    sess.reset()
    sess.prefill(np.arange(64, dtype=np.int64)[None] % 256)
    t0 = time.perf_counter()
    for i in range(n):
        sess.step(np.array([[i % 256]], dtype=np.int64))
    return (time.perf_counter() - t0) / n


def time_prefill(sess, tokens: int, via_steps: bool) -> float:
    ids = (np.arange(tokens, dtype=np.int64) % 256)[None]
    sess.reset()
    t0 = time.perf_counter()
    if via_steps:
        for t in range(tokens):
            sess.step(ids[:, t : t + 1])
    else:
        sess.prefill(ids)
    return tokens / (time.perf_counter() - t0)


MEMORY_WORKER = r"""
import json, resource, sys
import numpy as np
from edgeattn.runtimes import open_session
art, threads, marks = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
sess = open_session(art, threads=threads)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
out = {}
for t in range(max(marks)):
    sess.step(np.array([[t % 256]], dtype=np.int64))
    if t + 1 in marks:
        out[t + 1] = rss()
print(json.dumps(out))
"""


def memory_growth(art: Path, threads: int, marks: list[int]) -> dict[int, int]:
    res = subprocess.run(
        [sys.executable, "-c", MEMORY_WORKER, str(art), str(threads), ",".join(map(str, marks))],
        capture_output=True,
        text=True,
        check=True,
    )
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def int8_bpb(trained: Path, root: Path) -> dict[str, float]:
    from edgeattn.export import export_model
    from edgeattn.export.check import check_artifact

    text = Path(os.__file__).read_bytes()[:2001]
    out = {}
    for precision in ("fp32", "int8"):
        art = export_model(trained, root / f"trained_{precision}", precision=precision, force=True)
        out[precision] = check_artifact(art, tokens=2000, text=text).bpb["artifact"]
    return out


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="decode steps per timing")
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--trained", type=Path, default=None, help="a trained checkpoint for the int8 bpb figure")
    args = ap.parse_args()
    if args.trained is not None:
        ap.check_source(args.trained, "--trained", ("checkpoint",))

    from edgeattn.runtimes import open_session

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        arts = make_artifacts(root, args.threads)
        bandwidth = measure_bandwidth()
        sessions = {
            "ort_fused": open_session(arts["gla_onnxruntime_fp32"], threads=args.threads),
            "ort_portable": open_session(arts["gla_portable_fp32"], threads=args.threads),
            "ort_int8": open_session(arts["gla_onnxruntime_int8"], threads=args.threads),
            "torch": open_session(arts["gla_onnxruntime_fp32"], backend="torch", threads=args.threads),
        }
        decode = {k: [] for k in sessions}
        prefill = {k: [] for k in ("fused_prefill", "portable_prefill", "fused_steps")}
        for s in sessions.values():  # warm-up
            time_decode(s, 5)
        for _ in range(args.repeats):
            for k, s in sessions.items():
                decode[k].append(time_decode(s, args.steps))
            prefill["fused_prefill"].append(time_prefill(sessions["ort_fused"], 1024, via_steps=False))
            prefill["portable_prefill"].append(time_prefill(sessions["ort_portable"], 1024, via_steps=False))
            prefill["fused_steps"].append(time_prefill(sessions["ort_fused"], 256, via_steps=True))
        dec = {k: statistics.median(v) for k, v in decode.items()}
        pre = {k: statistics.median(v) for k, v in prefill.items()}
        wbytes = weight_bytes(arts["gla_onnxruntime_fp32"])
        floor = wbytes / bandwidth
        marks = [512, args.long]
        mem = {
            m: memory_growth(arts[a], args.threads, marks)
            for m, a in (("gla", "gla_onnxruntime_fp32"), ("softmax", "softmax_onnxruntime_fp32"))
        }
        bpb = int8_bpb(args.trained, root) if args.trained else None

    per_token = {m: (mem[m][marks[1]] - mem[m][marks[0]]) / (marks[1] - marks[0]) for m in mem}
    kv_bytes_per_token = 2 * 8 * 512 * 4  # softmax: key + value, 8 layers, d_model 512, float32
    print(
        f"GLA d_model 512, 8 layers, 8 heads; {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(f"weights read per token {wbytes / 2**20:.1f} MiB -> memory floor {floor * 1e3:.2f} ms/token")
    print(f"{'decode (ms/token)':<28}{'ms':>8}{'x floor':>9}")
    for k, v in dec.items():
        print(f"  {k:<26}{v * 1e3:>8.2f}{v / floor:>9.2f}")
    print(f"{'prefill (tokens/s)':<28}")
    for k, v in pre.items():
        print(f"  {k:<26}{v:>8.0f}")
    print(f"{'resident memory':<28}{'@512 MiB':>10}{'@' + str(args.long) + ' MiB':>12}{'bytes/token':>13}")
    for m in mem:
        print(
            f"  {m:<26}{mem[m][marks[0]] / 2**20:>10.1f}{mem[m][marks[1]] / 2**20:>12.1f}{per_token[m]:>13.0f}"
        )
    if bpb:
        print(f"bits per byte (trained checkpoint): fp32 {bpb['fp32']:.4f}, int8 {bpb['int8']:.4f}")
    result = {
        "threads": args.threads,
        "bandwidth_gbps": bandwidth / 1e9,
        "weight_mib": wbytes / 2**20,
        "floor_ms": floor * 1e3,
        "decode_ms": {k: v * 1e3 for k, v in dec.items()},
        "prefill_tokens_per_s": pre,
        "ort_vs_torch_decode": dec["torch"] / dec["ort_fused"],
        "ort_decode_vs_floor": dec["ort_fused"] / floor,
        "fused_vs_portable_prefill": pre["fused_prefill"] / pre["portable_prefill"],
        "fused_vs_portable_decode": dec["ort_portable"] / dec["ort_fused"],
        "prefill_vs_steps": pre["fused_prefill"] / pre["fused_steps"],
        "rss_bytes": {m: {str(k): v for k, v in mem[m].items()} for m in mem},
        "rss_growth_mib": {m: (mem[m][marks[1]] - mem[m][marks[0]]) / 2**20 for m in mem},
        "bytes_per_token": per_token,
        "softmax_kv_bytes_per_token": kv_bytes_per_token,
        "int8_vs_fp32_decode": dec["ort_fused"] / dec["ort_int8"],
        "bpb": bpb,
        "int8_bpb_increase": (bpb["int8"] / bpb["fp32"] - 1) if bpb else None,
    }
    print(json.dumps(with_cpu(result)))


if __name__ == "__main__":
    main()
