"""Where one-token decode (or a prefill call) spends its time: ONNX Runtime's profiler, kernel time summed
by op type and by layer.

    python benchmarks/profile_ops.py GRAPH.onnx [GRAPH.onnx ...] [--threads 1] [--steps 30]
        [--context C --kv-length L] [--tokens T]

Each graph (an edgeattn artifact's step.onnx, or an onnxruntime-genai model.onnx) is run at one token
from a zero state (genai's attention_mask [1, 1] and position_ids ones; dynamic dimensions 1) with
``ORT_ENABLE_ALL``, profiling on; prints, per graph, the wall time per run, the profiled model_run time,
the kernel total, the nodes run, and the top op types by time; then one JSON line.

``--context C``: the step runs as the C+1-th token of a KV-buffer model (GroupQueryAttention layers):
every ``past_key_values.*.key`` / ``.value`` is a zero buffer of ``--kv-length`` slots bound as both the
past input and the present output (as edgeattn's session and onnxruntime-genai's share one buffer), the
positions (edgeattn's ``position`` state, genai's ``position_ids``) are C and genai's attention_mask
covers C+1 tokens. genai's symbolic head size is read from the genai_config.json beside its graph.

``--tokens T``: each run is one call of T tokens from a zero state (a prefill chunk: a graph with a
dynamic token axis; the KV buffers of ``--kv-length`` slots, T by default plus one). Layers: the number
after ``blocks.`` (edgeattn) or ``layers.`` (genai) in a node's name; the rest is ``other`` (the
embedding, the final norm, the head). An edgeattn graph (an edgeattn.json beside it) also gets a table by
layer kind (each layer's mixer from the manifest) and op type.
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile
import time

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

LAYER = re.compile(r"(?:blocks|layers)\.(\d+)[./]")


def _context_binding(sess, path: str, context: int, kv_length: int, tokens: int = 1):
    """An IOBinding for one call of ``tokens`` tokens at ``context`` tokens with shared KV buffers (see the
    module docstring), and the arrays behind it (they must outlive the binding)."""
    import numpy as np
    import onnxruntime as ort

    conf = os.path.join(os.path.dirname(path), "genai_config.json")
    head = None
    if os.path.isfile(conf):  # genai's graph: its head size is symbolic, genai_config.json names it
        with open(conf) as f:
            head = json.load(f)["model"]["decoder"]["head_size"]
    io, keep, values = sess.io_binding(), [], {}
    for i in sess.get_inputs():
        n, shape = i.name, [d if isinstance(d, int) else 1 for d in i.shape]
        if n == "input_ids" and not isinstance(i.shape[1], int):
            shape[1] = tokens
        if n.endswith((".key", ".value")):  # [B, Hkv, L, D]
            L = i.shape[2] if isinstance(i.shape[2], int) else kv_length  # edgeattn: static, genai: symbolic
            shape = [1, i.shape[1], L, i.shape[3] if isinstance(i.shape[3], int) else head]
            a = np.zeros(shape, np.float32)
        elif n == "attention_mask":
            a = np.ones([1, context + tokens], np.int64)
        elif n == "position_ids":
            pos = np.arange(context, context + tokens, dtype=np.int64)
            a = np.broadcast_to(pos, [3, 1, tokens] if len(i.shape) == 3 else [1, tokens]).copy()
        elif n.endswith(".position"):
            a = np.full(shape, context, np.float32)
        else:
            a = np.ones(shape, np.int64) if "int64" in i.type else np.zeros(shape, np.float32)
        values[n] = ort.OrtValue.ortvalue_from_numpy(a)
        keep.append(a)
        io.bind_ortvalue_input(n, values[n])
    for o in sess.get_outputs():
        past = o.name.replace("present.", "past_key_values.", 1)
        if o.name.endswith((".key", ".value")) and past in values:
            io.bind_ortvalue_output(o.name, values[past])  # one buffer: written in place
        else:
            io.bind_output(o.name)
    return io, keep


def profile(
    path: str, threads: int, steps: int, context: int = 0, kv_length: int = 0, tokens: int = 1
) -> dict:
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
        if tokens > 1 and i.name in ("input_ids", "attention_mask") and not isinstance(i.shape[1], int):
            shape[1] = tokens  # a prefill chunk
        if i.name == "position_ids" and len(shape) == 3:  # Qwen3.5's multimodal rotary positions
            shape = [3, 1, 1]
        if "int64" in i.type:
            feeds[i.name] = np.ones(shape, np.int64)
        else:
            feeds[i.name] = np.zeros(shape, np.float32)
    if context or tokens > 1:
        io, _keep = _context_binding(sess, path, context, kv_length or context + tokens + 1, tokens)

        def run():
            sess.run_with_iobinding(io)
    else:

        def run():
            sess.run(None, feeds)

    warm = 5
    for _ in range(warm):
        run()
    t = time.perf_counter()
    for _ in range(steps):
        run()
    wall = (time.perf_counter() - t) / steps * 1e3
    prof = sess.end_profiling()
    with open(prof) as f:
        events = json.load(f)
    os.remove(prof)
    by, count, run = collections.Counter(), collections.Counter(), 0.0
    layers, kinds = collections.Counter(), collections.Counter()
    mixers = _mixers(path)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            by[op] += e["dur"]
            count[op] += 1
            m = LAYER.search(e["name"])
            layers[int(m.group(1)) if m else "other"] += e["dur"]
            if mixers:
                kinds[mixers[int(m.group(1))] if m else "other", op] += e["dur"]
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
        "layers": {
            str(k): d / n / 1e3 for k, d in sorted(layers.items(), key=lambda kv: str(kv[0]).zfill(5))
        },
        "kinds": [{"kind": k, "op": op, "ms": d / n / 1e3} for (k, op), d in kinds.most_common()],
    }


def _mixers(path: str) -> list[str] | None:
    """Each layer's mixer from the edgeattn.json beside an edgeattn graph (None for other graphs)."""
    manifest = os.path.join(os.path.dirname(path), "edgeattn.json")
    if not os.path.isfile(manifest):
        return None
    with open(manifest) as f:
        model = json.load(f)["model"]
    mixer = model["mixer"]  # a list, "a,b,..." (one per layer) or one name (EdgeConfig.mixers)
    if isinstance(mixer, list):
        return mixer
    return [m.strip() for m in mixer.split(",")] if "," in mixer else [mixer] * model["n_layers"]


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--context", type=int, default=0, help="tokens already in the KV buffers (0: none)")
    ap.add_argument("--kv-length", type=int, default=0, help="slots of each KV buffer (with --context)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per call (a prefill chunk)")
    args = ap.parse_args()
    if args.context and args.kv_length <= args.context:
        ap.error("--context needs --kv-length above it (the KV buffers' slots)")
    if args.tokens < 1:
        ap.error("--tokens must be at least 1")
    results = [
        profile(g, args.threads, args.steps, args.context, args.kv_length, args.tokens) for g in args.graphs
    ]
    for r in results:
        print(
            f"\n{r['graph']}: {r['wall_ms']:.2f} ms/run, model_run {r['model_run_ms']:.2f} ms, "
            f"kernels {r['kernel_ms']:.2f} ms, {r['nodes']} nodes"
        )
        print("| op | ms/run | nodes | share of kernel time |\n|---|---|---|---|")
        for op, v in list(r["ops"].items())[: args.top]:
            print(f"| {op} | {v['ms']:.3f} | {v['count']} | {100 * v['ms'] / r['kernel_ms']:.1f}% |")
        print("\nper layer: " + ", ".join(f"{k} {v:.2f}" for k, v in r["layers"].items()) + " ms/run")
        if r["kinds"]:  # an edgeattn graph: by the layer's mixer ("other": embedding, final norm, head)
            print("\n| layer kind | op | ms/run | share of kernel time |\n|---|---|---|---|")
            for x in r["kinds"][: 2 * args.top]:
                print(f"| {x['kind']} | {x['op']} | {x['ms']:.3f} | {100 * x['ms'] / r['kernel_ms']:.1f}% |")
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "profile_ops",
                    "threads": args.threads,
                    "context": args.context,
                    "tokens": args.tokens,
                    "results": results,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
