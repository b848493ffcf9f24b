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
   8 query / 2 KV heads of 256, 64 rotary dims), each over its own buffers, at each ``--contexts``; and the
   floor: the same int8 bytes (2 x ``--layers`` buffers of context x 512) read once, widened and summed, by
   ``--threads`` threads (``edgeattn_read_ms`` in the library), computing nothing else.
4. With ``--artifact DIR`` (an ``edgeattn export --kv-dtype int8`` artifact): a copy of it whose
   GroupQueryAttention nodes are the prototype's, both decoding in one process, alternating rounds of 8
   steps at each context (the state placed at that position before each round: random KV slots and
   recurrent states, the timing does not depend on their values); ms a token and the ratio to the first
   context.

    python benchmarks/kv_int8_kernel.py [--contexts 128,16384] [--layers 6] [--threads 2] [--rounds 10] \
        [--artifact DIR]

Prints the checks and a table (median ms a step of all layers, and the range over rounds), then ONE JSON line.
"""

from __future__ import annotations

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

from edgeattn.bench.args import ArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernel import place_state  # noqa: E402  (random KV slots and states up to a position)
from ort_ops import _session  # noqa: E402  (a one-graph CPU session, the custom-op library registered)

from edgeattn.bench.machine import with_cpu

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
    res = subprocess.run(
        [*cmd, f"-I{inc}", str(SOURCE), "-o", str(lib), "-lpthread"], capture_output=True, text=True
    )
    if res.returncode != 0:
        sys.exit(
            f"kv_int8_kernel: g++ failed: {res.stderr.strip().splitlines()[-1] if res.stderr else res.returncode}"
        )
    return lib


def session(lib: Path | None, H: int, Hkv: int, D: int, L: int, R: int, threads: int):
    """One attention node: ours (``lib``) or ONNX Runtime's GroupQueryAttention (None)."""
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
    return _session([node], inputs, outputs, [], threads, library=lib)


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


def read_floor(lib: Path, context: int, layers: int, threads: int, rounds: int) -> tuple[float, float, float]:
    import ctypes

    so = ctypes.CDLL(str(lib))
    so.edgeattn_read_ms.restype = ctypes.c_double
    so.edgeattn_read_ms.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    n = context * 2 * 256  # one KV buffer's filled slots: 2 KV heads of 256
    bufs = [np.random.default_rng(i).integers(-127, 128, n, dtype=np.int8) for i in range(2 * layers)]
    ptrs = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
    ms = [so.edgeattn_read_ms(ptrs, len(bufs), n, threads) for _ in range(rounds + 1)][1:]
    return statistics.median(ms), min(ms), max(ms)


def with_prototype(art: Path, out: Path) -> Path:
    """A copy of artifact ``art`` whose int8 GroupQueryAttention nodes are edgeattn.GroupQueryAttentionInt8."""
    import onnx

    from edgeattn.artifact.manifest import MANIFEST, sha256_file

    out.mkdir()
    for f in art.iterdir():
        if f.name not in ("step.onnx", MANIFEST) and f.is_file():
            shutil.copyfile(f, out / f.name)  # the weights beside the graph (ONNX Runtime keeps them there)
    model = onnx.load(str(art / "step.onnx"), load_external_data=False)
    replaced = 0
    for n in model.graph.node:
        if n.op_type != "GroupQueryAttention":
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        if (a.get("k_quant_type"), a.get("do_rotary"), a.get("rotary_interleaved", 0)) != (
            b"PER_CHANNEL",
            1,
            0,
        ):
            sys.exit(
                f"kv_int8_kernel: {art} is not an --kv-dtype int8 export with GroupQueryAttention's rotary"
            )
        ins = list(n.input)
        new = onnx.helper.make_node(
            "GroupQueryAttentionInt8", ins[:9] + ins[12:14], list(n.output), name=n.name, domain="edgeattn",
            num_heads=a["num_heads"], kv_num_heads=a["kv_num_heads"], scale=a["scale"],
        )  # fmt: skip
        n.CopyFrom(new)
        replaced += 1
    if not replaced:
        sys.exit(f"kv_int8_kernel: {art} has no GroupQueryAttention node")
    model.opset_import.append(onnx.helper.make_opsetid("edgeattn", 1))
    onnx.save(model, str(out / "step.onnx"))
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["files"]["step.onnx"] = {
        "sha256": sha256_file(out / "step.onnx"),
        "bytes": (out / "step.onnx").stat().st_size,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def decode(art: Path, lib: Path, contexts: list[int], threads: int, rounds: int) -> dict:
    import onnxruntime as ort

    from edgeattn.runtimes import open_session

    plain = ort.SessionOptions

    class WithLibrary(plain):  # the runtime makes its own SessionOptions: register the library in them
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.register_custom_ops_library(str(lib))

    with tempfile.TemporaryDirectory(prefix="edgeattn-kv8-art-") as tmp:
        sessions = {"GroupQueryAttention int8": open_session(art, threads=threads)}
        ort.SessionOptions = WithLibrary
        try:
            sessions["prototype"] = open_session(with_prototype(art, Path(tmp) / "art"), threads=threads)
        finally:
            ort.SessionOptions = plain
        rng = np.random.default_rng(0)

        def place(sess, p: int) -> None:
            place_state(sess, p, rng)

        out = {}
        for c in contexts:
            times = {k: [] for k in sessions}
            for _ in range(rounds):
                for k, sess in sessions.items():
                    place(sess, c)
                    steps = []
                    for _ in range(8):
                        t = time.perf_counter()
                        sess.step(np.array([[7]], np.int64))
                        steps.append(1e3 * (time.perf_counter() - t))
                    times[k].append(statistics.median(steps))
            out[c] = {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}
        return out


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,16384")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--artifact", type=Path, default=None, help="an --kv-dtype int8 artifact to decode with both"
    )
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if not contexts or min(contexts) < 1 or args.layers < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--contexts, --layers, --rounds and --threads must be positive")
    if args.artifact is not None and not (args.artifact / "edgeattn.json").is_file():
        ap.error(f"--artifact {args.artifact}: not an edgeattn artifact (no edgeattn.json)")
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
        floors = {c: read_floor(lib, c, args.layers, args.threads, args.rounds) for c in contexts}
        decoded = (
            decode(args.artifact, lib, contexts, args.threads, max(2, args.rounds // 2))
            if args.artifact
            else {}
        )
    print(f"\none decode step of {args.layers} attention layers, {args.threads} threads: median ms [range]\n")
    print(
        "| context | GroupQueryAttention int8 | prototype | prototype / GQA | read the int8 bytes once (floor) |"
    )
    print("|---|---|---|---|---|")
    for c, r in results.items():
        (g, gl, gh), (p, pl, ph), (f, fl, fh) = r["GroupQueryAttention int8"], r["prototype"], floors[c]
        print(
            f"| {c} | {g:.2f} [{gl:.2f}-{gh:.2f}] | {p:.2f} [{pl:.2f}-{ph:.2f}] | {p / g:.2f} | {f:.2f} [{fl:.2f}-{fh:.2f}] |"
        )
    if decoded:
        first = contexts[0]
        print(f"\n{args.artifact}, decode ms a token [range over rounds] (x the decode at {first}):\n")
        print("| context | " + " | ".join(decoded[first]) + " |")
        print("|---|" + "---|" * len(decoded[first]))
        for c, r in decoded.items():
            cells = [
                f"{m:.2f} [{lo:.2f}-{hi:.2f}] ({m / decoded[first][k][0]:.2f}x)"
                for k, (m, lo, hi) in r.items()
            ]
            print(f"| {c} | " + " | ".join(cells) + " |")
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "kv_int8_kernel",
                    "layers": args.layers,
                    "threads": args.threads,
                    "checks": checks,
                    "ms": {str(c): {k: v[0] for k, v in r.items()} for c, r in results.items()},
                    "read_floor_ms": {str(c): v[0] for c, v in floors.items()},
                    "decode_ms": {str(c): {k: v[0] for k, v in r.items()} for c, r in decoded.items()},
                }
            )
        )
    )


if __name__ == "__main__":
    main()
