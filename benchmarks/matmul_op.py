"""One MatMulNBits node on edgeattn's kernel (edgeattn/runtimes/matmul.cc) against ONNX Runtime's own: random
4-bit symmetric weights ([K, N] shapes of Qwen3.5-0.8B's projections by default), accuracy level 4, A of
``--rows`` rows, both sessions in one process with their thread pools not spinning between calls (a spinning
pool of one session would steal the cores of the other), calls alternating, the median of ``--repeats``.

    python benchmarks/matmul_op.py [--shapes 1024x3584,3584x1024] [--blocks 32,128] [--rows 1,4,64,256]
    python -m edgeattn.bench.cpu_as avx2 -- python benchmarks/matmul_op.py     # the kernels an AVX2 CPU gets

Prints a table (ms a call, ratio > 1: edgeattn faster) and ONE JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu


def model(K: int, N: int, bs: int, seed: int = 0) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    B = rng.integers(0, 256, (N, K // bs, bs // 2), dtype=np.uint8)
    S = (rng.random(N * (K // bs), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=K, N=N, bits=4, block_size=bs,
        accuracy_level=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")],
    )
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    m.ir_version = 10
    return m.SerializeToString()


def session(graph: bytes, threads: int, library=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if library is not None:
        so.add_session_config_entry("edgeattn.ops", "MatMulNBits")
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes", default="1024x3584,3584x1024", help="KxN,... (K a multiple of 64 and the block)"
    )
    ap.add_argument("--blocks", default="32,128")
    ap.add_argument("--rows", default="1,4,64,256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from edgeattn.runtimes import attention

    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        blocks, rows = ints(args.blocks), ints(args.rows)
        if any(len(s) != 2 for s in shapes):
            raise ValueError
    except ValueError:
        ap.error("--shapes takes KxN,...; --blocks and --rows comma-separated integers")
    if args.repeats < 1 or args.threads < 1 or not rows or min(rows) < 1:
        ap.error("--repeats, --threads and --rows must be >= 1")
    for (K, N), bs in ((s, b) for s in shapes for b in blocks):
        if N < 1 or bs not in attention.BLOCK_SIZES or K % bs or K % 64:
            ap.error(
                f"{K}x{N} with blocks of {bs}: the kernel takes blocks of {attention.BLOCK_SIZES} dividing K, K of 64s"
            )
    lib, why = attention.library()
    if lib is None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    results = []
    print("| K x N | block | rows | ONNX Runtime ms | edgeattn ms | ratio |\n|---|---|---|---|---|---|")
    for (K, N), bs in ((s, b) for s in shapes for b in blocks):
        graph = model(K, N, bs)
        try:
            ort_s, ours = session(graph, args.threads), session(graph, args.threads, lib)
        except Exception as e:  # onnxruntime's own error types: a library that does not load, a refused node
            print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            return 1
        for m in rows:
            x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
            times = {"onnxruntime": [], "edgeattn": []}
            for _ in range(args.repeats + 1):  # the first call of each warms up
                for name, s in (("onnxruntime", ort_s), ("edgeattn", ours)):
                    t = time.perf_counter()
                    s.run(None, {"x": x})
                    times[name].append((time.perf_counter() - t) * 1e3)
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            ratio = med["onnxruntime"] / med["edgeattn"]
            results.append({"K": K, "N": N, "block": bs, "rows": m, "ms": med, "ratio": ratio})
            print(
                f"| {K} x {N} | {bs} | {m} | {med['onnxruntime']:.3f} | {med['edgeattn']:.3f} | {ratio:.2f}x |"
            )
    print(json.dumps(with_cpu({"benchmark": "matmul_op", "threads": args.threads, "repeats": args.repeats,
                               "results": results})))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
