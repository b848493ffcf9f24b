"""One copy of the weights and int4 weights (issue 13, items 1 and 3), on this CPU.

What it measures:
1. Disk and memory of a 92.5M-parameter GLA (d_model 768, 12 layers, 12 heads, vocabulary 256, random
   weights) exported three ways: today's layout (each graph holds its weights, ``shared_weights=False``),
   one shared ``weights.bin``, and int4 (MatMulNBits, block 32, symmetric). Resident memory (psutil RSS)
   of a fresh process after opening the session, a 64-token prefill and 64 decode steps, against
   ``weight bytes + ONNX Runtime's own baseline``: the RSS of a fresh process that imported the same
   modules and ran a one-node (Identity) graph. Target: within 1.15x.
2. Decode ms/token of the three artifacts (median of ``--steps`` single steps per round, rounds
   alternating between them in one process, median over rounds). Target: int4 >= 2x fp32.
3. With ``--trained CKPT`` (an ``edgeattn train`` checkpoint, byte-level): bits per byte of fp32 and int4
   exports (block 32 and 128, symmetric and not) on held-out text, the first ``--eval-bytes`` of the
   training corpus's validation split (the last 2% of the Python standard library's sources: never
   trained on). Target: int4 < 3% above fp32. ``--kv-dtypes int8,float16``: also fp32 and int4 block 128
   with those KV buffers (a model with softmax layers; read in windows of its ``max_length`` - 1 bytes).

    python benchmarks/weights.py [--threads 2] [--trained runs/gla] [--eval-bytes 8192] [--kv-dtypes int8]

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

SIZE = dict(d_model=768, n_layers=12, n_heads=12)
MiB = 2**20

RSS_WORKER = r"""
import json, sys
import numpy as np, onnxruntime as ort, psutil
from edgeattn.runtimes import open_session
art, threads = sys.argv[1], int(sys.argv[2])
if art == "baseline":
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    s = ort.InferenceSession(helper.make_model(g).SerializeToString(), so)
    s.run(None, {"x": np.zeros(1, np.float32)})
else:
    sess = open_session(art, threads=threads)
    sess.prefill(np.arange(64, dtype=np.int64)[None] % 256)
    for i in range(64):
        sess.step(np.array([[i % 256]], dtype=np.int64))
print(json.dumps({"rss": psutil.Process().memory_info().rss}))
"""


def rss_of(art: str, threads: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", RSS_WORKER, art, str(threads)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["rss"]


def dir_bytes(path: Path, skip: str | None = None) -> int:
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and (skip is None or skip not in p.parts)
    )


def weight_bytes(art: Path) -> int:
    """Initializer bytes the graphs hold, each stored tensor once (the shared file, or step.onnx's own)."""
    data = json.loads((art / "edgeattn.json").read_text())
    if data.get("weights"):
        return sum(t["length"] for t in data["weights"]["tensors"])
    import onnx

    model = onnx.load(str(art / "step.onnx"))
    return sum(onnx.numpy_helper.to_array(i).nbytes for i in model.graph.initializer)


def time_decode(sessions: dict, steps: int, rounds: int) -> dict[str, float]:
    times = {k: [] for k in sessions}
    for s in sessions.values():
        s.reset()
        s.prefill(np.arange(64, dtype=np.int64)[None] % 256)
    for r in range(rounds):
        names = list(sessions)
        for k in names[r % len(names) :] + names[: r % len(names)]:
            s = sessions[k]
            s.step(np.array([[1]], dtype=np.int64))
            t = []
            for i in range(steps):
                t0 = time.perf_counter()
                s.step(np.array([[i % 256]], dtype=np.int64))
                t.append(time.perf_counter() - t0)
            times[k].append(statistics.median(t))
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def held_out(n: int) -> np.ndarray:
    from edgeattn.train.data import load_corpus

    return np.asarray(load_corpus(None).val[: n + 1], dtype=np.int64)


def eval_bpb(trained: Path, root: Path, n: int, threads: int, kv_dtypes: tuple = ()) -> dict:
    """Bits per byte of each export on the first ``n`` held-out bytes. A model with KV buffers (softmax
    layers) reads them in windows of its ``max_length`` - 1 bytes, each from an empty state; ``kv_dtypes``
    adds fp32 and int4 block 128 exports with that KV buffer (``--kv-dtype``)."""
    from edgeattn.export import export_model
    from edgeattn.export.check import bits_per_byte, run_logits
    from edgeattn.runtimes import open_session

    ids = held_out(n)[None]
    variants = {
        "fp32": ("fp32", None, None),
        "int4 b32 sym": ("int4", {"block_size": 32, "symmetric": True}, None),
        "int4 b32 asym": ("int4", {"block_size": 32, "symmetric": False}, None),
        "int4 b128 sym": ("int4", {"block_size": 128, "symmetric": True}, None),
        "int4 b128 asym": ("int4", {"block_size": 128, "symmetric": False}, None),
    }
    for kv in kv_dtypes:
        variants[f"fp32 kv {kv}"] = ("fp32", None, kv)
        variants[f"int4 b128 sym kv {kv}"] = ("int4", {"block_size": 128, "symmetric": True}, kv)
    out = {}
    for name, (precision, q, kv) in variants.items():
        art = export_model(
            trained,
            root / f"trained-{name.replace(' ', '-')}",
            precision=precision,
            quantization=q,
            force=True,
            **({"kv_dtype": kv} if kv else {}),
        )
        sess = open_session(art, threads=threads)
        window = min(n, (sess.manifest.max_length or n + 1) - 1)
        bits, count = 0.0, 0
        for s in range(0, n, window):
            seg = ids[:, s : s + window + 1]
            got = run_logits(sess, seg[:, :-1])
            targets = seg[0, 1:]
            bits += bits_per_byte(got["logits"][0], targets) * len(targets)
            count += len(targets)
        out[name] = bits / count
    return out


def print_bpb(bpb: dict, args) -> None:
    print(f"bits per byte on {args.eval_bytes} held-out bytes ({args.trained}):")
    for k, v in bpb.items():
        print(f"  {k:<24}{v:.4f}  ({(v / bpb['fp32'] - 1) * 100:+.2f}%)")


def kv_dtypes(args) -> tuple:
    return tuple(k.strip() for k in args.kv_dtypes.split(",") if k.strip())


def check_kv_dtypes(ap, args) -> None:
    from edgeattn.artifact.manifest import KV_DTYPES

    bad = [k for k in kv_dtypes(args) if k not in KV_DTYPES]
    if bad:
        ap.error(f"--kv-dtypes takes {', '.join(KV_DTYPES)}, got {', '.join(bad)}")


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rss-repeats", type=int, default=3)
    ap.add_argument("--trained", type=Path, default=None)
    ap.add_argument("--eval-bytes", type=int, default=8192)
    ap.add_argument("--bpb-only", action="store_true", help="only the bits per byte of --trained")
    ap.add_argument(
        "--kv-dtypes",
        default="",
        help="with --trained: also fp32 and int4 b128 with these KV buffers (int8,float16)",
    )
    args = ap.parse_args()
    if args.trained is not None:
        ap.check_source(args.trained, "--trained", ("checkpoint",))
    check_kv_dtypes(ap, args)
    if args.bpb_only:
        if args.trained is None:
            ap.error("--bpb-only needs --trained CKPT")
        with tempfile.TemporaryDirectory(prefix="edgeattn-weights-") as tmp:
            bpb = eval_bpb(args.trained, Path(tmp), args.eval_bytes, args.threads, kv_dtypes(args))
        print_bpb(bpb, args)
        print(
            json.dumps(
                with_cpu({"bpb": bpb, "int4_bpb_increase": {k: v / bpb["fp32"] - 1 for k, v in bpb.items()}})
            )
        )
        return

    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM
    from edgeattn.runtimes import open_session

    with tempfile.TemporaryDirectory(prefix="edgeattn-weights-") as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        model = EdgeLM(EdgeConfig(vocab_size=256, mixer="gla", **SIZE))
        params = sum(p.numel() for p in model.parameters())
        ckpt = model.save(root / "ckpt")
        del model
        arts = {
            "fp32 today (two copies)": export_model(ckpt, root / "legacy", shared_weights=False),
            "fp32 shared": export_model(ckpt, root / "shared"),
            "int4 (b32 sym)": export_model(
                ckpt, root / "int4", precision="int4", quantization={"block_size": 32}
            ),
        }
        disk = {
            k: {"total": dir_bytes(a), "without_checkpoint": dir_bytes(a, "checkpoint")}
            for k, a in arts.items()
        }
        wbytes = {k: weight_bytes(a) for k, a in arts.items()}
        rss = {k: [] for k in ["baseline", *arts]}
        for _ in range(args.rss_repeats):  # fresh processes, alternating
            rss["baseline"].append(rss_of("baseline", args.threads))
            for k, a in arts.items():
                rss[k].append(rss_of(str(a), args.threads))
        rss = {k: statistics.median(v) for k, v in rss.items()}
        sessions = {k: open_session(a, threads=args.threads) for k, a in arts.items()}
        decode = time_decode(sessions, args.steps, args.rounds)
        del sessions
        bpb = (
            eval_bpb(args.trained, root, args.eval_bytes, args.threads, kv_dtypes(args))
            if args.trained
            else None
        )

    base = rss["baseline"]
    print(f"GLA {params / 1e6:.1f}M params (d_model 768, 12 layers, 12 heads), {args.threads} threads")
    print(f"ONNX Runtime baseline (Identity graph, same imports): {base / MiB:.0f} MiB")
    print(
        "| artifact | on disk MiB (w/o checkpoint) | weight MiB | RSS MiB | RSS / (weights + baseline) | decode ms/token |"
    )
    print("|---|---|---|---|---|---|")
    ratio = {}
    for k in arts:
        ratio[k] = rss[k] / (wbytes[k] + base)
        print(
            f"| {k} | {disk[k]['total'] / MiB:.0f} ({disk[k]['without_checkpoint'] / MiB:.0f}) | {wbytes[k] / MiB:.0f} "
            f"| {rss[k] / MiB:.0f} | {ratio[k]:.2f}x | {decode[k]:.2f} |"
        )
    speedup = decode["fp32 shared"] / decode["int4 (b32 sym)"]
    print(
        f"int4 decode vs fp32 shared: {speedup:.2f}x; vs fp32 today: {decode['fp32 today (two copies)'] / decode['int4 (b32 sym)']:.2f}x"
    )
    if bpb:
        print_bpb(bpb, args)
    print(
        json.dumps(
            with_cpu(
                {
                    "params": params,
                    "threads": args.threads,
                    "baseline_rss_mib": base / MiB,
                    "disk_bytes": disk,
                    "weight_bytes": wbytes,
                    "rss_mib": {k: v / MiB for k, v in rss.items()},
                    "rss_over_weights_plus_baseline": ratio,
                    "decode_ms": decode,
                    "int4_decode_speedup_vs_fp32_shared": speedup,
                    "bpb": bpb,
                    "int4_bpb_increase": {k: v / bpb["fp32"] - 1 for k, v in bpb.items() if k != "fp32"}
                    if bpb
                    else None,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
