"""ONNX Runtime's CPU kernels for the choices the Qwen3.5 int4 export makes, each against its alternative, on
this machine: one-op graphs at Qwen3.5-0.8B's sizes, the variants of a row run alternately (rounds), the
median ms of each and its ratio to the row's first.

- ``gqa``: GroupQueryAttention decode step (8 query / 2 KV heads of 256, 64 rotary dims, q/k/v float32) at
  ``--context`` tokens over a KV buffer of float32 (the export's default), float16 (``--kv-dtype
  float16``), int8 with one scale per channel (``--kv-dtype int8``) and one scale per tensor, and 4 bits
  per channel (ONNX Runtime's quantized cache, ``k_quant_type``/``v_quant_type``, ``kv_cache_bit_width``); and the same attention as plain ops over
  the float32 buffer viewed as [B, Hkv, group, D] (Slice of the filled slots, FusedMatMul with transposed
  keys, Softmax, MatMul: each KV head read once for its group of query heads, where the CPU kernel reads it
  once per query head), the query already rotated and the new token not written (the read side only), and
  those ops over a buffer of exactly the filled slots (no Slice: what a bound view of them would read); the
  same over the filled slots of the int8 per-channel buffers with integer ops (MatMulInteger for both
  products, the query and the probabilities quantized per call); and the floor: those int8 slots read once by
  numpy, computing nothing; relative output error against float32.
- ``gated_norm``: GatedRMSNorm (16 heads of 128, silu gate) against SimplifiedLayerNormalization per head
  times silu(gate) (``optimize.unfuse_gated_norms``), at 1, 64 and 256 tokens.
- ``conv``: CausalConvWithState (6144 channels, width 4, silu) against Concat + grouped Conv + silu + Slice,
  at 1, 64 and 256 tokens.
- ``matmulnbits``: an int4 MLP projection (1024 x 3584) at block 32 and 128, accuracy level 4 (int8
  activations) and 0 (float32), at 1 and 256 tokens.

    python benchmarks/ort_ops.py [--threads 2] [--rounds 10] [--context 16384] [--only gqa,conv]

Prints a table per benchmark, then ONE JSON line.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import numpy as np

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu


def _session(nodes, inputs, outputs, inits, threads: int, library=None):
    """A CPU session of a graph of ``nodes``; ``library``: a custom-op library (domain ``edgeattn``) to register."""
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    if library is not None:
        opsets.append(helper.make_opsetid("edgeattn", 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    if library is not None:
        so.register_custom_ops_library(str(library))
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


def _gqa_plain(H: int, Hkv: int, D: int, L: int, threads: int, sliced: bool = True):
    """Decode attention of one query token over slots 0 .. n-1 of a float32 buffer [1, Hkv, L, D] (n the
    input ``n``) as plain ops over [1, Hkv, group, D]: each KV head is read once for its group of queries.
    ``sliced=False``: the buffer holds exactly the n filled slots (no Slice, so no copy of them)."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    G = H // Hkv
    consts = {
        "qshape": np.array([1, Hkv, G, D], np.int64),
        "oshape": np.array([1, 1, H * D], np.int64),
        "zero": np.array([0], np.int64),
        "axis": np.array([2], np.int64),
    }
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    nodes = [
        helper.make_node("Reshape", ["q", "qshape"], ["qg"]),  # [1, Hkv, G, D]
        helper.make_node("Slice", ["pk", "zero", "n", "axis"], ["kn"]),  # [1, Hkv, n, D]
        helper.make_node("Slice", ["pv", "zero", "n", "axis"], ["vn"]),
        helper.make_node(
            "FusedMatMul", ["qg", "kn"], ["s"], domain="com.microsoft", transB=1, alpha=D**-0.5
        ),  # [1, Hkv, G, n]
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vn"], ["og"]),  # [1, Hkv, G, D]
        helper.make_node("Reshape", ["og", "oshape"], ["o"]),
    ]
    if not sliced:
        nodes = [n for n in nodes if n.op_type != "Slice"]
        nodes[1].input[1], nodes[3].input[1] = "pk", "pv"
    f32 = TP.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f32, [1, 1, H * D]),
        helper.make_tensor_value_info("pk", f32, [1, Hkv, L, D]),
        helper.make_tensor_value_info("pv", f32, [1, Hkv, L, D]),
        helper.make_tensor_value_info("n", TP.INT64, [1]),
    ][: 4 if sliced else 3]
    return _session(nodes, inputs, [helper.make_tensor_value_info("o", f32, None)], inits, threads)


def _gqa_int8_plain(H: int, Hkv: int, D: int, threads: int):
    """Decode attention of one query token over exactly the filled slots of int8 buffers [1, Hkv, n, D]
    (per-channel scales ``ks``/``vs`` [1, Hkv, 1, D]) as integer ops, each KV head read once for its group:
    q times the key scales, quantized per tensor (DynamicQuantizeLinear), MatMulInteger with the int8 keys
    ([Hkv, n, D] x [Hkv, D, G]: the keys untransposed), Softmax over n, the probabilities quantized per tensor
    (uint8) and MatMulInteger with the int8 values, times the value scales. What a bound view of an int8
    buffer's filled slots could run with ONNX Runtime's stock CPU ops; no Slice."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    G = H // Hkv
    consts = {
        "qshape": np.array([Hkv, G, D], np.int64),
        "oshape": np.array([1, 1, H * D], np.int64),
        "alpha": np.array(D**-0.5, np.float32),
        "axis0": np.array([0], np.int64),
    }
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]

    def squeeze(x: str, y: str):  # [1, Hkv, ., D] -> [Hkv, ., D]
        return helper.make_node("Squeeze", [x, "axis0"], [y])

    nodes = [
        helper.make_node("Reshape", ["q", "qshape"], ["qg"]),  # [Hkv, G, D]
        squeeze("ks", "ks3"),
        helper.make_node("Mul", ["qg", "ks3"], ["qs"]),
        helper.make_node("Transpose", ["qs"], ["qt"], perm=[0, 2, 1]),  # [Hkv, D, G]
        helper.make_node("DynamicQuantizeLinear", ["qt"], ["q8", "qsc", "qzp"]),
        squeeze("pk", "k3"),
        helper.make_node("MatMulInteger", ["k3", "q8", "", "qzp"], ["si"]),  # [Hkv, n, G] int32
        helper.make_node("Cast", ["si"], ["sf"], to=TP.FLOAT),
        helper.make_node("Mul", ["qsc", "alpha"], ["sc"]),
        # Div by the reciprocal, not Mul: ONNX Runtime would fuse MatMulInteger-Cast-Mul into
        # MatMulIntegerToFloat, whose CPU kernel takes a uint8 A only (the keys here are int8)
        helper.make_node("Reciprocal", ["sc"], ["isc"]),
        helper.make_node("Div", ["sf", "isc"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=1),
        helper.make_node("Transpose", ["p"], ["pt"], perm=[0, 2, 1]),  # [Hkv, G, n]
        helper.make_node("DynamicQuantizeLinear", ["pt"], ["p8", "psc", "pzp"]),
        squeeze("pv", "v3"),
        helper.make_node("MatMulInteger", ["p8", "v3", "pzp"], ["oi"]),  # [Hkv, G, D] int32
        helper.make_node("Cast", ["oi"], ["of"], to=TP.FLOAT),
        squeeze("vs", "vs3"),
        helper.make_node("Mul", ["of", "vs3"], ["ov"]),
        helper.make_node("Mul", ["ov", "psc"], ["og"]),
        helper.make_node("Reshape", ["og", "oshape"], ["o"]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", TP.FLOAT, [1, 1, H * D]),
        helper.make_tensor_value_info("pk", TP.INT8, [1, Hkv, "n", D]),
        helper.make_tensor_value_info("pv", TP.INT8, [1, Hkv, "n", D]),
        helper.make_tensor_value_info("ks", TP.FLOAT, [1, Hkv, 1, D]),
        helper.make_tensor_value_info("vs", TP.FLOAT, [1, Hkv, 1, D]),
    ]
    return _session(nodes, inputs, [helper.make_tensor_value_info("o", TP.FLOAT, None)], inits, threads)


def gqa(threads: int, rounds: int, context: int) -> list[dict]:
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    H, Hkv, D, R, L = 8, 2, 256, 64, context + 16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, H * D)).astype(np.float32)
    k, v = ((rng.standard_normal((1, 1, Hkv * D)) * 0.5).astype(np.float32) for _ in range(2))
    cache = [(rng.standard_normal((1, Hkv, L, D)) * 0.5).astype(np.float32) for _ in range(2)]
    pos = np.arange(L)[:, None] * (1e7 ** (-np.arange(R // 2) / (R // 2)))[None]
    cos, sin = np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)
    # int8: scales from the values' absolute maximum (per channel, or over the whole tensor) over 127
    per_channel = [np.abs(c).max(axis=2, keepdims=True) / 127 for c in cache]  # [1, Hkv, 1, D]
    per_tensor = [np.abs(c).max().reshape(1) / 127 for c in cache]  # [1]

    def quantized(kind: str, scales: list[np.ndarray]):
        q8 = [np.clip(np.rint(c / s), -128, 127).astype(np.int8) for c, s in zip(cache, scales)]
        attrs = {"k_quant_type": kind, "v_quant_type": kind, "kv_cache_bit_width": 8}
        return TP.INT8, q8, attrs, [s.astype(np.float32) for s in scales]

    def packed4(scales: list[np.ndarray]):
        """4 bits per channel: clip(rint(x / scale), -8, 7) + 8, two a byte (the even channel in the low
        nibble), the cache [1, Hkv, L, D/2] uint8 (ONNX Runtime's layout, read back from its own writes)."""
        q4 = [(np.clip(np.rint(c / s), -8, 7) + 8).astype(np.uint8) for c, s in zip(cache, scales)]
        packed = [q[..., 0::2] | (q[..., 1::2] << 4) for q in q4]
        attrs = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 4}
        return TP.UINT8, packed, attrs, [s.astype(np.float32) for s in scales]

    variants = {
        "float32": (TP.FLOAT, [c for c in cache], {}, None),
        "float16": (TP.FLOAT16, [c.astype(np.float16) for c in cache], {}, None),
        "int8 per channel": quantized("PER_CHANNEL", per_channel),
        "int8 per tensor": quantized("PER_TENSOR", per_tensor),
        "int4 per channel": packed4([m * 127 / 7 for m in per_channel]),
    }
    runs, outs, keep = {}, {}, []
    for name, (dtype, (pk, pv), attrs, scales) in variants.items():
        ins = ["q", "k", "v", "pk", "pv", "sk", "tot", "cos", "sin"]
        inits = []
        if attrs:
            ins += ["", "", "", "ks", "vs"]
            inits = [numpy_helper.from_array(s, n) for s, n in zip(scales, ("ks", "vs"))]
        node = helper.make_node(
            "GroupQueryAttention", ins, ["o", "ok", "ov"], domain="com.microsoft", num_heads=H, kv_num_heads=Hkv,
            scale=D**-0.5, do_rotary=1, rotary_interleaved=0, **attrs,
        )  # fmt: skip
        f32 = TP.FLOAT
        inputs = [
            helper.make_tensor_value_info("q", f32, [1, 1, H * D]),
            helper.make_tensor_value_info("k", f32, [1, 1, Hkv * D]),
            helper.make_tensor_value_info("v", f32, [1, 1, Hkv * D]),
            helper.make_tensor_value_info("pk", dtype, list(pk.shape)),
            helper.make_tensor_value_info("pv", dtype, list(pv.shape)),
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
    # The plain form reads what the float32 GQA call left: the new token written at slot ``context`` and q
    # rotated at that position (rotate-half over the first R dims), so its output is comparable
    qr = q.reshape(H, D).copy()
    c, s_ = cos[context], sin[context]
    x1, x2 = qr[:, : R // 2].copy(), qr[:, R // 2 : R].copy()
    qr[:, : R // 2], qr[:, R // 2 : R] = x1 * c - x2 * s_, x2 * c + x1 * s_
    plain = _gqa_plain(H, Hkv, D, L, threads)
    pk32, pv32 = variants["float32"][1]  # written in place by the float32 call
    pfeeds = {"q": qr.reshape(1, 1, H * D), "pk": pk32, "pv": pv32, "n": np.array([context + 1], np.int64)}
    runs["plain ops [Hkv, group, D]"] = lambda: plain.run(None, pfeeds)
    outs["plain ops [Hkv, group, D]"] = plain.run(None, pfeeds)[0]
    # the same over a buffer of exactly the filled slots: what binding a view of them would read (a
    # slot-major buffer's prefix is contiguous); not a form the export has
    exact = _gqa_plain(H, Hkv, D, context + 1, threads, sliced=False)
    efeeds = {
        "q": pfeeds["q"],
        "pk": pk32[:, :, : context + 1].copy(),
        "pv": pv32[:, :, : context + 1].copy(),
    }
    runs["plain ops, filled slots only"] = lambda: exact.run(None, efeeds)
    outs["plain ops, filled slots only"] = exact.run(None, efeeds)[0]
    # int8 integer ops over the filled slots of the per-channel int8 buffers (as the GQA call left them)
    int8 = _gqa_int8_plain(H, Hkv, D, threads)
    pk8, pv8 = variants["int8 per channel"][1]
    ifeeds = {
        "q": pfeeds["q"],
        "pk": pk8[:, :, : context + 1].copy(),
        "pv": pv8[:, :, : context + 1].copy(),
        "ks": per_channel[0].astype(np.float32),
        "vs": per_channel[1].astype(np.float32),
    }
    runs["int8 integer ops, filled slots only"] = lambda: int8.run(None, ifeeds)
    # the floor: the filled int8 slots read once, nothing computed (numpy's sum of them as int64 words, 1 thread)
    words = [ifeeds["pk"].view(np.int64), ifeeds["pv"].view(np.int64)]
    runs["read the int8 slots once (numpy)"] = lambda: [w.sum() for w in words]
    outs["int8 integer ops, filled slots only"] = int8.run(None, ifeeds)[0]
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
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--context", type=int, default=16384, help="gqa: tokens in the KV buffer")
    ap.add_argument("--only", default="", help="comma-separated benchmarks to run (default: all)")
    args = ap.parse_args()
    if args.threads < 1 or args.rounds < 1 or args.context < 1:
        ap.error("--threads, --rounds and --context must be at least 1")
    benches = {
        "gqa": lambda: gqa(args.threads, args.rounds, args.context),
        "gated_norm": lambda: gated_norm(args.threads, args.rounds),
        "conv": lambda: conv(args.threads, args.rounds),
        "matmulnbits": lambda: matmulnbits(args.threads, args.rounds),
    }
    only = args.only.split(",") if args.only else list(benches)
    unknown = sorted(set(only) - set(benches))
    if unknown:
        ap.error(f"--only takes {','.join(benches)}; got {unknown[0]!r}")
    results = {b: benches[b]() for b in only}
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
            with_cpu(
                {"benchmark": "ort_ops", "threads": args.threads, "rounds": args.rounds, "results": results}
            )
        )
    )


if __name__ == "__main__":
    main()
