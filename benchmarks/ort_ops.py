"""ONNX Runtime's CPU kernels for the choices the Qwen3.5 int4 export makes, each against its alternative, on
this machine: one-op graphs at Qwen3.5-0.8B's sizes, the variants of a row run alternately (rounds), the
median ms of each and its ratio to the row's first.

- ``gqa``: GroupQueryAttention decode step (8 query / 2 KV heads of 256, 64 rotary dims, q/k/v float32) at
  ``--context`` tokens over a KV buffer of float32 (the export's default), float16 (``--kv-dtype
  float16``) and int8 with one scale per channel (ONNX Runtime's quantized cache; not exported: its scales
  would need calibrating); relative output error against float32.
- ``gated_norm``: GatedRMSNorm (16 heads of 128, silu gate) against SimplifiedLayerNormalization per head
  times silu(gate) (``optimize.unfuse_gated_norms``), at 1, 64 and 256 tokens.
- ``conv``: CausalConvWithState (6144 channels, width 4, silu) against Concat + grouped Conv + silu + Slice,
  at 1, 64 and 256 tokens.
- ``matmulnbits``: an int4 MLP projection (1024 x 3584) at block 32 and 128, accuracy level 4 (int8
  activations) and 0 (float32), at 1 and 256 tokens.

    python benchmarks/ort_ops.py [--threads 2] [--rounds 10] [--context 16384]

Prints a table per benchmark, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import numpy as np


def _session(nodes, inputs, outputs, inits, threads: int):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _race(runs: dict, rounds: int, per: int = 3) -> dict:
    """Median ms of each callable, run alternately ``rounds`` times ``per`` calls."""
    for f in runs.values():
        f()
    times: dict = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            for _ in range(per):
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def gqa(threads: int, rounds: int, context: int) -> list[dict]:
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    H, Hkv, D, R, L = 8, 2, 256, 64, context + 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n * D)).astype(np.float32) for n in (H, Hkv, Hkv))
    cache = [(rng.standard_normal((1, Hkv, L, D)) * 0.5).astype(np.float32) for _ in range(2)]
    pos = np.arange(L)[:, None] * (1e7 ** (-np.arange(R // 2) / (R // 2)))[None]
    cos, sin = np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)
    step = 0.02  # int8: one scale per channel, the values' range over 127
    variants = {
        "float32": (TP.FLOAT, [c for c in cache], {}),
        "float16": (TP.FLOAT16, [c.astype(np.float16) for c in cache], {}),
        "int8 per channel": (
            TP.INT8,
            [np.clip(np.round(c / step), -127, 127).astype(np.int8) for c in cache],
            {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8},
        ),
    }
    runs, outs, keep = {}, {}, []
    for name, (dtype, (pk, pv), attrs) in variants.items():
        ins = ["q", "k", "v", "pk", "pv", "sk", "tot", "cos", "sin"]
        inits = []
        if attrs:
            ins += ["", "", "", "ks", "vs"]
            inits = [
                numpy_helper.from_array(np.full([1, Hkv, 1, D], step, np.float32), n) for n in ("ks", "vs")
            ]
        node = helper.make_node(
            "GroupQueryAttention", ins, ["o", "ok", "ov"], domain="com.microsoft", num_heads=H, kv_num_heads=Hkv,
            scale=D**-0.5, do_rotary=1, rotary_interleaved=0, **attrs,
        )  # fmt: skip
        f32 = TP.FLOAT
        inputs = [
            helper.make_tensor_value_info("q", f32, [1, 1, H * D]),
            helper.make_tensor_value_info("k", f32, [1, 1, Hkv * D]),
            helper.make_tensor_value_info("v", f32, [1, 1, Hkv * D]),
            helper.make_tensor_value_info("pk", dtype, [1, Hkv, L, D]),
            helper.make_tensor_value_info("pv", dtype, [1, Hkv, L, D]),
            helper.make_tensor_value_info("sk", TP.INT32, [1]),
            helper.make_tensor_value_info("tot", TP.INT32, []),
            helper.make_tensor_value_info("cos", f32, [L, R // 2]),
            helper.make_tensor_value_info("sin", f32, [L, R // 2]),
        ]
        outputs = [
            helper.make_tensor_value_info(n, t, None) for n, t in (("o", f32), ("ok", dtype), ("ov", dtype))
        ]
        sess = _session([node], inputs, outputs, inits, threads)
        io, vals = sess.io_binding(), {}
        feeds = dict(q=q, k=k, v=v, pk=pk, pv=pv, cos=cos, sin=sin)
        feeds |= dict(sk=np.array([context], np.int32), tot=np.array(context + 1, np.int32))
        for n, a in feeds.items():
            vals[n] = ort.OrtValue.ortvalue_from_numpy(a)
            io.bind_ortvalue_input(n, vals[n])
        io.bind_output("o")
        io.bind_ortvalue_output("ok", vals["pk"])  # one buffer: past and present
        io.bind_ortvalue_output("ov", vals["pv"])
        keep.append((sess, io, vals))
        runs[name] = lambda sess=sess, io=io: sess.run_with_iobinding(io)
        runs[name]()
        outs[name] = io.copy_outputs_to_cpu()[0]
    ms = _race(runs, rounds)
    ref = outs["float32"]
    err = {n: float(np.abs(o - ref).max() / np.abs(ref).max()) for n, o in outs.items()}
    return [{"case": f"@{context}", "ms": ms, "rel_err": err}]


def gated_norm(threads: int, rounds: int) -> list[dict]:
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    from edgeattn.export.optimize import unfuse_gated_norms

    C, H = 128, 16
    scale = numpy_helper.from_array(np.random.default_rng(0).standard_normal(C).astype(np.float32), "s")
    node = helper.make_node(
        "GatedRMSNorm", ["x", "s", "g"], ["y"], domain="com.microsoft", activation="silu", epsilon=1e-6
    )
    io = [helper.make_tensor_value_info(n, TP.FLOAT, [1, "T", H * C]) for n in ("x", "g", "y")]
    graph = helper.make_graph([node], "g", io[:2], io[2:], [scale])
    model = helper.make_model(graph)
    unfuse_gated_norms(model)
    sessions = {
        "GatedRMSNorm": _session([node], io[:2], io[2:], [scale], threads),
        "plain ops": _session(list(model.graph.node), io[:2], io[2:], list(model.graph.initializer), threads),
    }
    rows = []
    for T in (1, 64, 256):
        rng = np.random.default_rng(T)
        feeds = {n: rng.standard_normal((1, T, H * C)).astype(np.float32) for n in ("x", "g")}
        runs = {k: (lambda s=s, f=feeds: s.run(None, f)) for k, s in sessions.items()}
        rows.append({"case": f"{T} tokens", "ms": _race(runs, rounds)})
    return rows


def conv(threads: int, rounds: int) -> list[dict]:
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    D, W = 6144, 4
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((D, 1, W)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "b"),
    ]
    ins = [
        helper.make_tensor_value_info("x", TP.FLOAT, [1, D, "T"]),
        helper.make_tensor_value_info("s", TP.FLOAT, [1, D, W - 1]),
    ]
    outs = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("y", "ns")]
    fused = [
        helper.make_node(
            "CausalConvWithState",
            ["x", "w", "b", "s"],
            ["y", "ns"],
            domain="com.microsoft",
            activation="silu",
        )
    ]
    plain = [
        helper.make_node("Concat", ["s", "x"], ["xs"], axis=2),
        helper.make_node("Conv", ["xs", "w", "b"], ["c"], group=D, kernel_shape=[W]),
        helper.make_node("Sigmoid", ["c"], ["sg"]),
        helper.make_node("Mul", ["c", "sg"], ["y"]),
        helper.make_node("Slice", ["xs", "st", "en", "ax"], ["ns"]),
    ]
    cut = [
        numpy_helper.from_array(np.array([v], np.int64), n)
        for n, v in (("st", -(W - 1)), ("en", 2**62), ("ax", 2))
    ]
    sessions = {
        "CausalConvWithState": _session(fused, ins, outs, inits, threads),
        "plain ops": _session(plain, ins, outs, inits + cut, threads),
    }
    rows = []
    for T in (1, 64, 256):
        feeds = {
            "x": rng.standard_normal((1, D, T)).astype(np.float32),
            "s": rng.standard_normal((1, D, W - 1)).astype(np.float32),
        }
        runs = {k: (lambda s=s, f=feeds: s.run(None, f)) for k, s in sessions.items()}
        rows.append({"case": f"{T} tokens", "ms": _race(runs, rounds)})
    return rows


def matmulnbits(threads: int, rounds: int) -> list[dict]:
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    K, N = 1024, 3584
    W = numpy_helper.from_array(
        (np.random.default_rng(0).standard_normal((K, N)) * 0.02).astype(np.float32), "W"
    )
    x_in = helper.make_tensor_value_info("x", TP.FLOAT, [1, "T", K])
    y_out = helper.make_tensor_value_info("y", TP.FLOAT, None)
    sessions = {}
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer logs every node
    for block in (32, 128):
        for acc in (4, 0):
            model = helper.make_model(
                helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x_in], [y_out], [W]),
                opset_imports=[helper.make_opsetid("", 21)],
            )
            q = MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=True, accuracy_level=acc)
            q.process()
            g = q.model.model.graph
            sessions[f"block {block}, accuracy {acc}"] = _session(
                list(g.node), [x_in], [y_out], list(g.initializer), threads
            )
    rows = []
    for T in (1, 256):
        feeds = {"x": np.random.default_rng(T).standard_normal((1, T, K)).astype(np.float32)}
        runs = {k: (lambda s=s, f=feeds: s.run(None, f)) for k, s in sessions.items()}
        rows.append({"case": f"{T} tokens", "ms": _race(runs, rounds)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--context", type=int, default=16384, help="gqa: tokens in the KV buffer")
    args = ap.parse_args()
    if args.threads < 1 or args.rounds < 1 or args.context < 1:
        ap.error("--threads, --rounds and --context must be at least 1")
    results = {
        "gqa": gqa(args.threads, args.rounds, args.context),
        "gated_norm": gated_norm(args.threads, args.rounds),
        "conv": conv(args.threads, args.rounds),
        "matmulnbits": matmulnbits(args.threads, args.rounds),
    }
    for bench, rows in results.items():
        names = list(rows[0]["ms"])
        print(f"\n{bench}, {args.threads} thread(s): median ms (x the first)\n")
        print("| case | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for r in rows:
            base = r["ms"][names[0]]
            cells = [f"{r['ms'][n]:.3f} ({r['ms'][n] / base:.2f}x)" for n in names]
            print(f"| {r['case']} | " + " | ".join(cells) + " |")
        if "rel_err" in rows[0]:
            print(
                "\nrelative output error against float32: "
                + ", ".join(f"{k} {v:.2g}" for k, v in rows[0]["rel_err"].items())
            )
    print(
        json.dumps(
            {"benchmark": "ort_ops", "threads": args.threads, "rounds": args.rounds, "results": results}
        )
    )


if __name__ == "__main__":
    main()
