"""Where one-token decode spends its time: ONNX Runtime's profiler, kernel time summed by op type.

    python benchmarks/profile_ops.py GRAPH.onnx [GRAPH.onnx ...] [--threads 1] [--steps 30]

Each graph (an edgeattn artifact's step.onnx, or an onnxruntime-genai model.onnx) is run at one token
from a zero state (genai's attention_mask [1, 1] and position_ids ones; dynamic dimensions 1) with
``ORT_ENABLE_ALL``, profiling on; prints, per graph, the wall time per run, the profiled model_run time,
the kernel total, the nodes run, and the top op types by time; then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time


def profile(path: str, threads: int, steps: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.profile_file_prefix = os.path.join(tempfile.gettempdir(), "edgeattn_profile")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if i.name == "position_ids" and len(shape) == 3:  # Qwen3.5's multimodal rotary positions
            shape = [3, 1, 1]
        if "int64" in i.type:
            feeds[i.name] = np.ones(shape, np.int64)
        else:
            feeds[i.name] = np.zeros(shape, np.float32)
    warm = 5
    for _ in range(warm):
        sess.run(None, feeds)
    t = time.perf_counter()
    for _ in range(steps):
        sess.run(None, feeds)
    wall = (time.perf_counter() - t) / steps * 1e3
    prof = sess.end_profiling()
    with open(prof) as f:
        events = json.load(f)
    os.remove(prof)
    by, count, run = collections.Counter(), collections.Counter(), 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            by[op] += e["dur"]
            count[op] += 1
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            run += e["dur"]
    n = warm + steps  # the profile holds every run, the warm-up's too
    return {
        "graph": path,
        "wall_ms": wall,
        "model_run_ms": run / n / 1e3,
        "kernel_ms": sum(by.values()) / n / 1e3,
        "nodes": sum(count.values()) // n,
        "ops": {op: {"ms": d / n / 1e3, "count": count[op] // n} for op, d in by.most_common()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    results = [profile(g, args.threads, args.steps) for g in args.graphs]
    for r in results:
        print(
            f"\n{r['graph']}: {r['wall_ms']:.2f} ms/run, model_run {r['model_run_ms']:.2f} ms, "
            f"kernels {r['kernel_ms']:.2f} ms, {r['nodes']} nodes"
        )
        print("| op | ms/run | nodes | share of kernel time |\n|---|---|---|---|")
        for op, v in list(r["ops"].items())[: args.top]:
            print(f"| {op} | {v['ms']:.3f} | {v['count']} | {100 * v['ms'] / r['kernel_ms']:.1f}% |")
    print(json.dumps({"benchmark": "profile_ops", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
