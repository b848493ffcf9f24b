"""How fast ONNX Runtime could run a model at best on this CPU: the floor under edgeattn's decode and prefill,
against llama.cpp on the same weights (issue 32 item 6: "decode and prefill at least 1.2x the faster peer").

For each ONNX model (an edgeattn artifact's ``step.onnx``, an onnxruntime-genai ``model.onnx``) a fresh
process times, besides the whole model (benchmarks/peers.py's runners: decode ms/token at ``--context``
tokens, prefill tokens/s of ``--prefill`` random tokens from an empty state):

- ``weights only``: a graph of the model's weight products and nothing else: every ``MatMulNBits`` node
  and every ``MatMul`` whose second input is an initializer of at least 64k values (the projections and
  the head; not edgeattn's block-offset products, [K, K/32] and [K/32, N]), each fed a fresh input
  [1, T, K] (no attention, no norms, no embedding, no copies), run by the same ONNX Runtime build with the
  session options edgeattn uses (``ORT_ENABLE_ALL``, ``--threads`` intra-op threads, one inter-op). At
  T = 1 this is the least time a token can take in ONNX Runtime with these weights and this kernel; at
  T = ``--prefill`` the least time of a prefill of that length in one call;
- ``with block offsets`` (edgeattn's int4 from a GGUF, ``edgeattn.export.precision.offset_blocks``): the
  same with the block-offset products too, wired as the artifact wires them (what its weights cost);
- ``attention alone``: a graph of the model's ``GroupQueryAttention`` nodes only (``attention_nodes``: as
  the model configures them, fed fresh q/k/v, each over its own KV buffers bound as past and present, as the
  sessions bind them): ms for one token at ``--context`` tokens, and ms for a prefill of ``--prefill``
  tokens from an empty buffer in the model's own calls (an edgeattn artifact's prefill tokens per call;
  genai one call); ONNX Runtime's CPU attention multiplies the whole query x key matrix, the masked half
  too. ``products + attention`` adds it to the products as the export runs them (with its block offsets):
  the least a token or a prefill can take with ONNX Runtime's kernels, before norms, rotary, embedding and
  copies;
- ``empty nodes``: a chain of as many one-element ``Add`` nodes as the model's optimized graph has nodes
  (``ORT_ENABLE_ALL``, counted on the graph ONNX Runtime saves): ONNX Runtime's cost per node alone.

llama.cpp (``--llama GGUF``, in the interpreter ``--llama-python`` of an environment with llama-cpp-python:
see benchmarks/imported.py) is timed by the same runner as in the race (f16 KV cache, last-token logits).
Every model is measured once per round in a fresh process, the order rotated by round; each figure is the
median over ``--rounds`` rounds with its min-max. The verdict compares the floor with the target the issue
sets: the faster llama.cpp figure divided (decode ms) or multiplied (prefill tokens/s) by 1.2.

    python benchmarks/decode_floor.py --model ART_OR_GENAI_DIR [--model ...] \\
        [--llama GGUF --llama-python PY] [--threads 2] [--rounds 3] [--context 128] [--prefill 512] \\
        [--log FILE.jsonl]
    python benchmarks/decode_floor.py --report FILE.jsonl   # the table and verdict of a logged run

The verdict is per precision class, told by the model's name (``precision_class``): int4 (``int4``, a
llama.cpp ``q4`` type) and the rest (fp32, edgeattn's int8, llama.cpp Q8_0).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # peers.py's workers, also where this module is loaded from a file path
MIN_WEIGHT = 65536  # a MatMul's initializer of at least this many values is a weight product
HEAD_N = 8192  # a product with this many outputs or more is the vocabulary head


def graph_path(model: str) -> Path:
    """The ONNX graph of a model folder: an edgeattn artifact's step.onnx or a genai folder's model.onnx."""
    p = Path(model)
    for name in ("step.onnx", "model.onnx"):
        if (p / name).is_file():
            return p / name
    raise ValueError(f"{model} holds neither step.onnx (edgeattn) nor model.onnx (onnxruntime-genai)")


def weight_products(path: Path, offsets: bool = False):
    """A model of ``path``'s weight products only (see the module docstring), the number of products, their
    weight bytes, and its inputs: ``x{K}`` [1, T, K] for each width K, and ``head{K}`` [1, 1, K] for a
    product of at least ``HEAD_N`` outputs (the vocabulary head: a prefill computes its last token's logits
    only). ``offsets``: edgeattn's block-offset products too (MatMuls of initializers named ``*_offsets``,
    and the products of their results), run as the graph runs them."""
    import onnx
    from onnx import TensorProto, helper

    from edgeattn.export.graph import OFFSET_SUFFIX

    m = onnx.load(str(path))  # with its external data
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    keep, inputs, nbytes = [], {}, 0
    renamed: dict[str, str] = {}  # an offset product's first output -> its name here
    for n in g.node:
        if n.op_type not in ("MatMulNBits", "MatMul"):
            continue
        used = [x for x in n.input[1:] if x]
        is_offset = any(x.endswith(OFFSET_SUFFIX) for x in used)
        if is_offset and not offsets:
            continue
        if n.op_type == "MatMulNBits":
            K = next(a.i for a in n.attribute if a.name == "K")
            N = next(a.i for a in n.attribute if a.name == "N")
        elif used and used[0] in inits and len(inits[used[0]].dims) == 2:
            K, N = inits[used[0]].dims
            if K * N < MIN_WEIGHT and not is_offset:
                continue
        else:
            continue
        if any(x not in inits for x in used):
            continue  # a product of two activations (attention), not a weight's
        src = n.input[0]
        if src in renamed:  # the second offset product reads the first's block sums
            x = renamed[src]
        else:
            x = f"head{K}" if N >= HEAD_N else f"x{K}"
            inputs[x] = [1, 1 if x.startswith("head") else "T", K]
        out = f"y{len(keep)}"
        new = helper.make_node(n.op_type, [x, *n.input[1:]], [out], domain=n.domain, name=f"w{len(keep)}")
        new.attribute.extend(n.attribute)
        keep.append(new)
        renamed[n.output[0]] = out
        nbytes += sum(len(inits[x].raw_data) or _tensor_bytes(inits[x]) for x in used)
    if not keep:
        raise ValueError(f"{path} has no weight products (MatMulNBits, or MatMul of a 2-D initializer)")
    names = {x for n in keep for x in n.input[1:] if x}
    ins = [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape) for x, shape in sorted(inputs.items())]
    outputs = [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in keep]
    graph = helper.make_graph(keep, "weights_only", ins, outputs, [inits[x] for x in sorted(names)])
    out = helper.make_model(graph, opset_imports=list(m.opset_import))
    out.ir_version = m.ir_version
    return out, len(keep), nbytes, inputs


def _tensor_bytes(t) -> int:
    from onnx import numpy_helper

    return int(numpy_helper.to_array(t).nbytes)


def _session(model_bytes: bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def optimized_node_count(path: Path, threads: int) -> int:
    """Nodes of ``path`` after ONNX Runtime's optimizations (the graph it saves at ORT_ENABLE_ALL)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="edgeattn-floor-") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.log_severity_level = 3
        so.optimized_model_filepath = os.path.join(tmp, "opt.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return len(onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node)


def attention_nodes(path: Path, length: int):
    """A model of ``path``'s GroupQueryAttention nodes only (ONNX Runtime's CPU attention, as the graph
    configures it): all read the same inputs ``q``, ``k``, ``v`` [1, T, width] (``qkv`` where the graph
    feeds them packed), ``seqlens_k`` [1] and ``total_sequence_length`` (int32), each its own KV buffers
    ``past{i}.key``/``.value`` -> ``present{i}.key``/``.value`` (bound to one buffer each, as the sessions
    bind them) of ``[1, kv_heads, L, head]`` (L the graph's own buffer length, else ``length``), and its
    rotary caches as initializers. Returns the model, the buffer shapes and the inputs' widths; None where the
    graph has no GroupQueryAttention, its head size is neither fixed nor told by a whole-head rotary cache, or
    a node takes inputs past the rotary caches (an int8 KV buffer's scales: not rebuilt here)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    shapes = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in g.input}
    consts = {
        n.output[0]: next(a.t for a in n.attribute if a.name == "value")
        for n in g.node
        if n.op_type == "Constant" and any(a.name == "value" for a in n.attribute)
    }
    inits = {i.name: i for i in g.initializer}
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    if not gqa:
        return None
    nodes, ins, outs, tensors, buffers, widths = [], [], [], [], {}, {}
    for i, n in enumerate(gqa):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if any(n.input[9:]):
            return None
        shape = shapes.get(n.input[3])
        if not shape or len(shape) != 4:
            return None
        head = shape[3] if isinstance(shape[3], int) and shape[3] else None
        cos = consts.get(n.input[7]) or inits.get(n.input[7]) if len(n.input) > 7 and n.input[7] else None
        if head is None and attrs.get("do_rotary") and cos is not None:
            head = 2 * cos.dims[1]  # genai's symbolic head size: its rotary cache covers the whole head
        if head is None:
            return None
        heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
        L = shape[2] if isinstance(shape[2], int) and shape[2] else length
        packed = len(n.input) < 3 or not n.input[1]
        if packed:
            widths["qkv"] = (heads + 2 * kv_heads) * head
            qkv = ["qkv", "", ""]
        else:
            widths.update(q=heads * head, k=kv_heads * head, v=kv_heads * head)
            qkv = ["q", "k", "v"]
        caches = []
        for j, x in enumerate(n.input[7:9]):
            if not x:
                caches.append("")
                continue
            t = consts.get(x) or inits.get(x)
            if t is None:
                return None  # a rotary cache computed in the graph: not rebuilt here
            arr = numpy_helper.to_array(t, base_dir=str(path.parent))  # an initializer may be external
            tensors.append(numpy_helper.from_array(arr, f"cache{i}_{j}"))
            caches.append(f"cache{i}_{j}")
        names = [f"past{i}.key", f"past{i}.value"]
        new = helper.make_node(
            "GroupQueryAttention",
            [*qkv, *names, "seqlens_k", "total_sequence_length", *caches],
            [f"out{i}", f"present{i}.key", f"present{i}.value"],
            domain=n.domain,
            name=f"gqa{i}",
        )
        new.attribute.extend(n.attribute)
        nodes.append(new)
        for x in names:
            buffers[x] = [1, kv_heads, L, head]
            ins.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, kv_heads, L, head]))
        outs += [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None)]
        outs += [
            helper.make_tensor_value_info(
                x.replace("past", "present"), TensorProto.FLOAT, [1, kv_heads, L, head]
            )
            for x in names
        ]
    ins += [
        helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, "T", w]) for x, w in sorted(widths.items())
    ]
    ins += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, None),
    ]
    graph = helper.make_graph(nodes, "attention_only", ins, outs, tensors)
    out = helper.make_model(graph, opset_imports=list(m.opset_import))
    out.ir_version = m.ir_version
    return out, buffers, widths


def _time_attention(path: Path, threads: int, steps: int, P: int, context: int, chunk: int) -> dict | None:
    """The attention-only graph's ms for one token at ``context`` tokens, and its seconds for a prefill of
    ``P`` tokens from an empty buffer in calls of ``chunk`` (the model's own prefill calls)."""
    import numpy as np
    import onnxruntime as ort

    built = attention_nodes(path, max(context + 1, P) + 16)
    if built is None:
        return None
    model, buffers, widths = built
    sess = _session(model.SerializeToString(), threads)
    count = len(model.graph.node)
    del model
    rng = np.random.default_rng(0)
    kv = {x: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for x, shape in buffers.items()}
    feeds = {
        T: {x: rng.standard_normal([1, T, w]).astype(np.float32) for x, w in widths.items()}
        for T in (1, chunk)
    }

    outs = [o.name for o in sess.get_outputs() if o.name.startswith("out")]
    bindings: dict[tuple[int, int], tuple] = {}  # (T, start) -> its binding, made once (not timed)

    def binding(T: int, start: int):
        b = sess.io_binding()
        keep = {x: np.ascontiguousarray(v[:, :T]) for x, v in feeds[T].items()}  # kept alive with b
        keep.update(
            seqlens_k=np.array([start + T - 1], np.int32), total_sequence_length=np.array(start + T, np.int32)
        )
        for x, v in keep.items():
            b.bind_cpu_input(x, v)
        for x, v in kv.items():
            b.bind_ortvalue_input(x, v)
            b.bind_ortvalue_output(x.replace("past", "present"), v)
        for o in outs:
            b.bind_output(o)
        return b, keep

    def call(T: int, start: int) -> None:
        if (T, start) not in bindings:
            bindings[T, start] = binding(T, start)
        sess.run_with_iobinding(bindings[T, start][0])

    def prefill() -> None:
        for start in range(0, P, chunk):
            call(min(chunk, P - start), start)

    for _ in range(2):  # warm-up: kernels and the arena
        prefill()
        call(1, context)
    one = _median_ms(lambda: call(1, context), steps)
    many = _median_ms(prefill, 3)
    return {"nodes": count, "ms_1": one, "prefill_ms": many, "chunk": chunk}


def empty_chain(n: int):
    """``n`` chained one-element Add nodes: ONNX Runtime's per-node cost with no work."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Add", [f"a{i}", "one"], [f"a{i + 1}"], name=f"add{i}") for i in range(n)]
    graph = helper.make_graph(
        nodes,
        "empty_nodes",
        [helper.make_tensor_value_info("a0", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(f"a{n}", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _median_ms(run, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _time_products(path: Path, threads: int, steps: int, P: int, offsets: bool) -> dict:
    """The weights-only graph's ms at one token and tokens/s at ``P`` (the head on one token)."""
    import numpy as np

    model, count, nbytes, inputs = weight_products(path, offsets)
    sess = _session(model.SerializeToString(), threads)
    del model
    rng = np.random.default_rng(0)
    feeds = {
        T: {
            x: rng.standard_normal([T if d == "T" else d for d in shape]).astype(np.float32)
            for x, shape in inputs.items()
        }
        for T in (1, P)
    }
    for _ in range(5):  # warm-up: the first calls pick kernels and fill the arena
        sess.run(None, feeds[1])
    sess.run(None, feeds[P])
    one = _median_ms(lambda: sess.run(None, feeds[1]), steps)
    many = _median_ms(lambda: sess.run(None, feeds[P]), 3)
    return {"products": count, "weight_bytes": nbytes, "ms_1": one, "tps_prefill": P / (many / 1e3)}


def floor_worker(cfg: dict) -> dict:
    """One process: the weights-only graph of ``cfg["path"]`` at 1 and ``prefill`` tokens (and with its
    block-offset products, where it has any), and the empty chain of its optimized node count."""
    import numpy as np

    from edgeattn.export.graph import OFFSET_SUFFIX

    path = graph_path(cfg["path"])
    threads, steps, P = cfg["threads"], cfg["steps"], cfg["prefill"]
    out = {"weights": _time_products(path, threads, steps, P, offsets=False)}
    import onnx

    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.initializer]
    if any(x.endswith(OFFSET_SUFFIX) for x in names):
        out["with_offsets"] = _time_products(path, threads, steps, P, offsets=True)
    chunk = P
    if path.name == "step.onnx":  # edgeattn prefills in calls of its prefill graph's tokens
        from edgeattn.artifact.manifest import Manifest

        chunk = min(P, Manifest.load(path.parent, verify=False).prefill_tokens)
    out["attention"] = _time_attention(path, threads, steps, P, cfg.get("context", 128), chunk)
    nodes = optimized_node_count(path, threads)
    chain = _session(empty_chain(nodes).SerializeToString(), threads)
    x = {"a0": np.zeros(1, np.float32)}
    for _ in range(5):
        chain.run(None, x)
    out.update(nodes=nodes, empty_nodes_ms=_median_ms(lambda: chain.run(None, x), steps))
    return out


def whole_cfg(name: str, path: str, args, python: str | None = None) -> dict:
    """benchmarks/peers.py's worker configuration: the whole model at one context and one prefill."""
    cfg = {
        "model": name,
        "path": path,
        "threads": args.threads,
        "contexts": [args.context],
        "steps": args.steps,
        "prefill": [args.prefill],
        "max_len": max(args.context + args.steps, args.prefill) + 16 if name.startswith("llama-") else None,
    }
    if python:
        cfg["python"] = python
    return cfg


def measure(item: dict, args) -> dict:
    """One round of one model: the whole model (peers.py's worker), then for an ONNX model its floors."""
    from peers import run_json, run_worker

    whole = run_worker(item["whole"], args.timeout)
    out = {"whole": whole}
    if "error" not in whole:
        ctx = whole["contexts"][str(args.context)]
        out.update(decode_ms=ctx["ms"], prefill_tps=whole["prefills"][str(args.prefill)]["tps"])
        out["other"] = max(ctx["other"], whole["prefill_other"])
    if item["onnx"]:
        fcfg = {
            "path": item["path"],
            "threads": args.threads,
            "steps": args.steps,
            "prefill": args.prefill,
            "context": args.context,
        }
        floor = run_json(
            [sys.executable, str(Path(__file__).resolve()), "--floor-worker", json.dumps(fcfg)], args.timeout
        )
        out["floor"] = floor
    return out


def spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(s: dict | None, digits: int = 2) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floor-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", action="append", default=[], help="an edgeattn artifact or a genai folder")
    ap.add_argument("--llama", action="append", default=[], help="a GGUF for llama.cpp (--llama-python)")
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="timed single steps per figure")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per process")
    ap.add_argument("--log", type=Path, default=None, help="append each round's results here (JSON lines)")
    ap.add_argument("--report", type=Path, default=None, help="only print the table of a --log file")
    args = ap.parse_args(argv)
    if args.floor_worker:
        try:
            print(json.dumps(floor_worker(json.loads(args.floor_worker))))
        except Exception as e:  # one line for the parent
            print(
                f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}",
                file=sys.stderr,
            )
            return 2
        return 0
    if args.report:
        try:
            lines = [json.loads(x) for x in args.report.read_text().splitlines() if x.strip()]
            results = {}
            for x in lines:
                results.setdefault(x["model"], []).append(x["result"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--report {args.report}: not a log of this script ({type(e).__name__})")
        report(results, args)
        return 0
    if not args.model:
        ap.error("give at least one --model (an edgeattn artifact or an onnxruntime-genai folder)")
    if args.llama and not args.llama_python:
        ap.error("--llama needs --llama-python (an interpreter with llama-cpp-python)")
    if args.log is not None and not (args.log.parent.is_dir() and os.access(args.log.parent, os.W_OK)):
        ap.error(f"--log {args.log}: its folder does not exist or is not writable")
    if min(args.rounds, args.steps, args.threads) < 1 or args.context < 1 or args.prefill < 2:
        ap.error("--rounds, --steps and --threads must be at least 1, --context 1 and --prefill 2")
    items = []
    for m in args.model:
        try:
            path = graph_path(m)
        except ValueError as e:
            ap.error(str(e))
        kind = "edgeattn" if path.name == "step.onnx" else "genai"
        base = Path(m).resolve().name
        name = base if base.startswith(f"{kind}-") else f"{kind}-{base}"
        items.append({"name": name, "path": m, "onnx": True, "whole": whole_cfg(name, m, args)})
    for g in args.llama:
        if not Path(g).is_file():
            ap.error(f"--llama {g}: no such file")
        name = Path(g).stem if Path(g).stem.startswith("llama-") else f"llama-{Path(g).stem}"
        items.append(
            {"name": name, "path": g, "onnx": False, "whole": whole_cfg(name, g, args, args.llama_python)}
        )
    results: dict[str, list[dict]] = {it["name"]: [] for it in items}
    for r in range(args.rounds):
        k = r % len(items)
        for it in items[k:] + items[:k]:
            res = measure(it, args)
            results[it["name"]].append(res)
            if args.log:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"model": it["name"], "round": r, "result": res}) + "\n")
            bad = res["whole"].get("error") or res.get("floor", {}).get("error")
            got = bad or " ".join(
                f"{key} {res[key]:.2f}" for key in ("decode_ms", "prefill_tps") if key in res
            ) + (f" floor {res['floor']['weights']['ms_1']:.2f} ms" if res.get("floor") else "")
            print(f"[round {r + 1}/{args.rounds}] {it['name']}: {got}", file=sys.stderr, flush=True)
    report(results, args)
    return 0


def precision_class(name: str) -> str:
    """The issue's precision classes: int4 (edgeattn and genai int4, llama.cpp's 4-bit types) and fp32
    (edgeattn and genai fp32, llama.cpp Q8_0), told by the model's name."""
    n = name.lower()
    return "int4" if "int4" in n or "-q4" in n else "fp32"


def report(results: dict[str, list[dict]], args) -> None:
    """The table, the verdict per precision class and the JSON line, from each model's rounds."""
    P = args.prefill
    rows = []
    for name, runs in results.items():
        rs = [x for x in runs if "error" not in x["whole"]]
        fl = [x["floor"] for x in runs if x.get("floor") and "error" not in x["floor"]]
        errors = [x["whole"].get("error") or x.get("floor", {}).get("error") for x in runs]
        rows.append(
            {
                "model": name,
                "class": precision_class(name),
                "decode_ms": spread([x.get("decode_ms") for x in rs]),
                "prefill_tps": spread([x.get("prefill_tps") for x in rs]),
                "other_cores_max": max((x.get("other", 0) for x in rs), default=None),
                "weights_ms_1": spread([f["weights"]["ms_1"] for f in fl]),
                "weights_tps_prefill": spread([f["weights"]["tps_prefill"] for f in fl]),
                "offsets_ms_1": spread([f["with_offsets"]["ms_1"] for f in fl if "with_offsets" in f]),
                "offsets_tps_prefill": spread(
                    [f["with_offsets"]["tps_prefill"] for f in fl if "with_offsets" in f]
                ),
                "attention_ms_1": spread([f["attention"]["ms_1"] for f in fl if f.get("attention")]),
                "attention_prefill_ms": spread(
                    [f["attention"]["prefill_ms"] for f in fl if f.get("attention")]
                ),
                # the products as the export runs them (with its block offsets) plus its attention, per round
                "floor_ms_1": spread(
                    [
                        (f.get("with_offsets") or f["weights"])["ms_1"] + f["attention"]["ms_1"]
                        for f in fl
                        if f.get("attention")
                    ]
                ),
                "floor_tps_prefill": spread(
                    [
                        P
                        / (
                            P / (f.get("with_offsets") or f["weights"])["tps_prefill"]
                            + f["attention"]["prefill_ms"] / 1e3
                        )
                        for f in fl
                        if f.get("attention")
                    ]
                ),
                "empty_nodes_ms": spread([f["empty_nodes_ms"] for f in fl]),
                "products": fl[0]["weights"]["products"] if fl else None,
                "weight_mb": fl[0]["weights"]["weight_bytes"] / 2**20 if fl else None,
                "nodes": fl[0]["nodes"] if fl else None,
                "errors": [e for e in errors if e],
            }
        )
    C, P = args.context, args.prefill
    rounds = max((len(v) for v in results.values()), default=0)
    print(
        f"\n{args.threads} threads, {rounds} rounds, median [min-max]; decode at {C} tokens, prefill of {P}\n"
    )
    print(
        f"| model | decode ms @{C} | prefill tok/s @{P} | weights only: ms/token | weights only: tok/s @{P} "
        f"| with block offsets: ms/token | with block offsets: tok/s @{P} | attention alone: ms/token "
        f"| attention alone: ms @{P} | products + attention: ms/token | products + attention: tok/s @{P} "
        "| products (MiB) | graph nodes | empty nodes: ms | other CPU (cores, max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        prods = f"{row['products']} ({row['weight_mb']:.0f})" if row["products"] else "-"
        other = f"{row['other_cores_max']:.2f}" if row["other_cores_max"] is not None else "-"
        cells = [
            row["model"],
            fmt(row["decode_ms"]),
            fmt(row["prefill_tps"], 0),
            fmt(row["weights_ms_1"]),
            fmt(row["weights_tps_prefill"], 0),
            fmt(row["offsets_ms_1"]),
            fmt(row["offsets_tps_prefill"], 0),
            fmt(row["attention_ms_1"]),
            fmt(row["attention_prefill_ms"], 1),
            fmt(row["floor_ms_1"]),
            fmt(row["floor_tps_prefill"], 0),
            prods,
            str(row["nodes"] or "-"),
            fmt(row["empty_nodes_ms"]),
            other,
        ]
        print("| " + " | ".join(cells) + " |")
        for e in row["errors"]:
            print(f"  {row['model']}: {e}")
    verdict = {}
    for cls in ("int4", "fp32"):
        peers = [
            r
            for r in rows
            if r["class"] == cls and r["model"].startswith("llama-") and r["decode_ms"] and r["prefill_tps"]
        ]
        if not peers:
            continue
        best_ms = min(r["decode_ms"]["median"] for r in peers)
        best_tps = max(r["prefill_tps"]["median"] for r in peers)
        v = verdict[cls] = {
            "decode_target_ms": best_ms / 1.2,
            "prefill_target_tps": best_tps * 1.2,
            "models": {},
        }
        print(
            f"\n{cls}: the target (1.2x the faster llama.cpp of the class): decode at most {best_ms / 1.2:.2f} "
            f"ms/token, prefill at least {best_tps * 1.2:.0f} tok/s"
        )
        for row in rows:
            if row["class"] != cls or not row["weights_ms_1"]:
                continue
            d_ok = row["weights_ms_1"]["median"] <= best_ms / 1.2
            p_ok = row["weights_tps_prefill"]["median"] >= best_tps * 1.2
            v["models"][row["model"]] = {"decode_floor_under_target": d_ok, "prefill_floor_over_target": p_ok}
            if row["offsets_ms_1"]:  # the products as the export runs them: with its block offsets
                o_ok = row["offsets_ms_1"]["median"] <= best_ms / 1.2
                v["models"][row["model"]]["decode_floor_with_offsets_under_target"] = o_ok
            if row["floor_ms_1"]:  # and with ONNX Runtime's attention kernel on top
                a_d = row["floor_ms_1"]["median"] <= best_ms / 1.2
                a_p = row["floor_tps_prefill"]["median"] >= best_tps * 1.2
                v["models"][row["model"]].update(
                    decode_floor_with_attention_under_target=a_d, prefill_floor_with_attention_over_target=a_p
                )
            print(
                f"- {row['model']}: its weight products alone {row['weights_ms_1']['median']:.2f} ms/token "
                f"({'within' if d_ok else 'above'} the target), {row['weights_tps_prefill']['median']:.0f} tok/s "
                f"at {P} ({'reaches' if p_ok else 'below'} the target)"
                + (
                    f"; with its block offsets {row['offsets_ms_1']['median']:.2f} ms/token "
                    f"({'within' if o_ok else 'above'} the target)"
                    if row["offsets_ms_1"]
                    else ""
                )
                + (
                    f"; with its attention {row['floor_ms_1']['median']:.2f} ms/token "
                    f"({'within' if a_d else 'above'} the target), {row['floor_tps_prefill']['median']:.0f} "
                    f"tok/s ({'reaches' if a_p else 'below'} the target)"
                    if row["floor_ms_1"]
                    else ""
                )
            )
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "decode_floor",
                    "threads": args.threads,
                    "rounds": rounds,
                    "context": C,
                    "prefill": P,
                    "rows": rows,
                    "verdict": verdict,
                }
            )
        )
    )


if __name__ == "__main__":
    sys.exit(main())
