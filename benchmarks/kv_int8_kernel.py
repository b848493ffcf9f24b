"""A prototype kernel for issue 25's last speed target (decode at 16384 tokens within 1.25x of decode at 128):
``benchmarks/kv_int8_kernel.cc``, an ONNX Runtime custom-op library (``edgeattn.GroupQueryAttentionInt8``),
against ONNX Runtime's own CPU GroupQueryAttention over the same int8 per-channel KV buffer. Not used by
edgeattn's runtimes or exports.

1. Builds the library with g++ (``-O3 -march=native``) against the ONNX Runtime headers that
   ``scripts/fetch_onnxruntime_headers.sh`` unpacks into ``.third_party`` (or ``$ONNXRUNTIME_ROOT/include``).
2. Checks it against GroupQueryAttention (``k_quant_type``/``v_quant_type`` PER_CHANNEL, 8 bits,
   ``do_rotary``), the cache bound as past and present: decode, chunked prefill over a past, a first prompt,
   two rows at different positions, other head counts and sizes. The attention output within 1e-5 (relative
   to its largest value) and every byte of the cache equal, or it exits 1.
3. Races the two, interleaved round by round: one decode step of ``--layers`` attention layers (Qwen3.5-0.8B's:
   8 query / 2 KV heads of 256, 64 rotary dims), each over its own buffers, at each ``--contexts``.

    python benchmarks/kv_int8_kernel.py [--contexts 128,16384] [--layers 6] [--threads 2] [--rounds 10]

Prints the checks and a table (median ms a step of all layers, and the range over rounds), then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).with_suffix(".cc")
# (B, S, H, Hkv, D, L, R, past per row)
CASES = [
    (1, 1, 8, 2, 256, 64, 64, [40]),
    (1, 16, 8, 2, 256, 64, 64, [20]),
    (1, 24, 8, 2, 256, 64, 64, [0]),
    (2, 1, 8, 2, 256, 64, 64, [5, 33]),
    (1, 3, 4, 2, 16, 32, 16, [7]),
    (2, 3, 4, 2, 16, 32, 16, [0, 0]),
    (1, 5, 6, 2, 32, 40, 32, [9]),
]


def headers() -> Path | None:
    for d in (
        Path(os.environ.get("ONNXRUNTIME_ROOT", "/nonexistent")) / "include",
        ROOT / ".third_party" / "debian" / "usr" / "include" / "onnxruntime",
    ):
        if (d / "onnxruntime_lite_custom_op.h").is_file():
            return d
    return None


def build(out: Path) -> Path:
    inc, gxx = headers(), shutil.which("g++")
    if inc is None or gxx is None:
        sys.exit(
            "kv_int8_kernel: needs g++ and the ONNX Runtime headers (bash scripts/fetch_onnxruntime_headers.sh)"
        )
    lib = out / "libedgeattn_kv_int8.so"
    cmd = [gxx, "-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-shared", "-std=c++17"]
    res = subprocess.run([*cmd, f"-I{inc}", str(SOURCE), "-o", str(lib)], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(
            f"kv_int8_kernel: g++ failed: {res.stderr.strip().splitlines()[-1] if res.stderr else res.returncode}"
        )
    return lib


def session(lib: Path | None, H: int, Hkv: int, D: int, L: int, R: int, threads: int):
    """One attention node: ours (``lib``) or ONNX Runtime's GroupQueryAttention (None)."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper

    ins = ["q", "k", "v", "pk", "pv", "sk", "tot", "cos", "sin"]
    common = dict(num_heads=H, kv_num_heads=Hkv, scale=D**-0.5)
    if lib is not None:
        node = helper.make_node(
            "GroupQueryAttentionInt8", [*ins, "ks", "vs"], ["o", "ok", "ov"], domain="edgeattn", **common
        )
    else:
        node = helper.make_node(
            "GroupQueryAttention", [*ins, "", "", "", "ks", "vs"], ["o", "ok", "ov"], domain="com.microsoft",
            do_rotary=1, rotary_interleaved=0, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
            kv_cache_bit_width=8, **common,
        )  # fmt: skip
    f, vi = TP.FLOAT, helper.make_tensor_value_info
    inputs = [
        vi("q", f, ["B", "S", H * D]), vi("k", f, ["B", "S", Hkv * D]), vi("v", f, ["B", "S", Hkv * D]),
        vi("pk", TP.INT8, ["B", Hkv, L, D]), vi("pv", TP.INT8, ["B", Hkv, L, D]), vi("sk", TP.INT32, ["B"]),
        vi("tot", TP.INT32, []), vi("cos", f, [L, R // 2]), vi("sin", f, [L, R // 2]),
        vi("ks", f, [1, Hkv, 1, D]), vi("vs", f, [1, Hkv, 1, D]),
    ]  # fmt: skip
    outputs = [vi("o", f, None), vi("ok", TP.INT8, None), vi("ov", TP.INT8, None)]
    opsets = [helper.make_opsetid(d, v) for d, v in (("", 21), ("com.microsoft", 1), ("edgeattn", 1))]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs), opset_imports=opsets)
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    if lib is not None:
        so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def inputs(B, S, H, Hkv, D, L, R, past, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    pos = np.arange(L)[:, None] * (1e7 ** (-np.arange(R // 2) / (R // 2)))[None]
    sk = np.array(past, np.int32) + S - 1
    return {
        "q": rng.standard_normal((B, S, H * D)).astype(np.float32),
        "k": (rng.standard_normal((B, S, Hkv * D)) * 0.5).astype(np.float32),
        "v": (rng.standard_normal((B, S, Hkv * D)) * 0.5).astype(np.float32),
        "pk": rng.integers(-127, 128, (B, Hkv, L, D), dtype=np.int8),
        "pv": rng.integers(-127, 128, (B, Hkv, L, D), dtype=np.int8),
        "sk": sk.astype(np.int32),
        "tot": np.array(int(sk.max()) + 1, np.int32),
        "cos": np.cos(pos).astype(np.float32),
        "sin": np.sin(pos).astype(np.float32),
        "ks": (rng.random((1, Hkv, 1, D)) * 0.02 + 0.01).astype(np.float32),
        "vs": (rng.random((1, Hkv, 1, D)) * 0.02 + 0.01).astype(np.float32),
    }


def bound(sess, feeds: dict):
    """An IO binding with the caches bound as both past and present (written in place), and the run."""
    import onnxruntime as ort

    io, vals = sess.io_binding(), {}
    for n, a in feeds.items():
        vals[n] = ort.OrtValue.ortvalue_from_numpy(a)
        io.bind_ortvalue_input(n, vals[n])
    io.bind_output("o")
    io.bind_ortvalue_output("ok", vals["pk"])
    io.bind_ortvalue_output("ov", vals["pv"])
    return io, vals


def check(lib: Path, threads: int) -> list[dict]:
    rows = []
    for case in CASES:
        B, S, H, Hkv, D, L, R, past = case
        outs = []
        for which in (None, lib):
            feeds = {k: v.copy() for k, v in inputs(*case).items()}
            sess = session(which, H, Hkv, D, L, R, threads)
            io, _ = bound(sess, feeds)
            sess.run_with_iobinding(io)
            outs.append((io.copy_outputs_to_cpu()[0], feeds["pk"], feeds["pv"]))
        (o1, k1, v1), (o2, k2, v2) = outs
        err = float(np.abs(o1 - o2).max() / np.abs(o1).max())
        differ = int((k1 != k2).sum() + (v1 != v2).sum())
        rows.append(
            {
                "case": f"B{B} S{S} H{H}/{Hkv} D{D} past {past}",
                "rel_err": err,
                "cache_bytes_differing": differ,
            }
        )
    return rows


def race(lib: Path, context: int, layers: int, threads: int, rounds: int) -> dict:
    H, Hkv, D, R = 8, 2, 256, 64
    L = context + 40
    runs, keep = {}, []
    for name, which in (("GroupQueryAttention int8", None), ("prototype", lib)):
        sess = session(which, H, Hkv, D, L, R, threads)
        binds = [bound(sess, inputs(1, 1, H, Hkv, D, L, R, [context], seed=i)) for i in range(layers)]
        keep.append(binds)
        runs[name] = lambda sess=sess, binds=binds: [sess.run_with_iobinding(io) for io, _ in binds]
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(rounds):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(1e3 * (time.perf_counter() - t))
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,16384")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if not contexts or min(contexts) < 1 or args.layers < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--contexts, --layers, --rounds and --threads must be positive")
    with tempfile.TemporaryDirectory(prefix="edgeattn-kv8-") as tmp:
        lib = build(Path(tmp))
        checks = check(lib, args.threads)
        for r in checks:
            print(
                f"check {r['case']}: output rel err {r['rel_err']:.1e}, cache bytes differing {r['cache_bytes_differing']}"
            )
        if any(r["rel_err"] > 1e-5 or r["cache_bytes_differing"] for r in checks):
            print("the prototype does not compute what GroupQueryAttention computes", file=sys.stderr)
            sys.exit(1)
        results = {c: race(lib, c, args.layers, args.threads, args.rounds) for c in contexts}
    print(f"\none decode step of {args.layers} attention layers, {args.threads} threads: median ms [range]\n")
    print("| context | GroupQueryAttention int8 | prototype | prototype / GQA |")
    print("|---|---|---|---|")
    for c, r in results.items():
        (g, gl, gh), (p, pl, ph) = r["GroupQueryAttention int8"], r["prototype"]
        print(f"| {c} | {g:.2f} [{gl:.2f}-{gh:.2f}] | {p:.2f} [{pl:.2f}-{ph:.2f}] | {p / g:.2f} |")
    print(
        json.dumps(
            {
                "benchmark": "kv_int8_kernel",
                "layers": args.layers,
                "threads": args.threads,
                "checks": checks,
                "ms": {str(c): {k: v[0] for k, v in r.items()} for c, r in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
