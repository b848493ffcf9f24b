"""One graph for step and prefill against today's two graphs: decode ms/token and prefill tokens/s.

Builds a `gla` model (``--size full``: 92.5M parameters, d_model 768, 12 layers, 12 heads; ``small``:
3.6M), exports it twice to the onnxruntime target (``one_graph=True``: one ``step.onnx`` with a dynamic
token axis, one prepacked session; ``one_graph=False``: step.onnx + prefill.onnx) and times, in one
process, alternating by round:

- ``one``: the one-graph session (``OnnxRuntimeSession``);
- ``two-shared``: the two-graph session sharing one unpacked copy of the weights (the default before);
- ``two-prepacked``: the two-graph session with ``share_weights=False`` (each graph its own packed copy);
- prefill of 1024 random tokens: each session's ``prefill`` (the one graph: long calls; the two graphs:
  64-token chunks), and the one graph run directly in calls of 64, 256 and 1024 tokens.

    python benchmarks/one_graph.py [--size full] [--threads 1] [--rounds 4] [--workdir DIR]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

SIZES = {
    "small": dict(d_model=256, n_layers=4, n_heads=4),
    "full": dict(d_model=768, n_layers=12, n_heads=12),
}
PROMPT = 1024


def build(root: Path, size: str) -> dict[str, Path]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    arts = {one: root / f"{size}-{'one' if one else 'two'}" for one in (True, False)}
    if all((a / "edgeattn.json").is_file() for a in arts.values()):
        return arts
    torch.manual_seed(0)
    ckpt = EdgeLM(EdgeConfig(vocab_size=256, mixer="gla", **SIZES[size])).save(root / f"{size}-ckpt")
    for one, art in arts.items():
        export_model(ckpt, art, include_checkpoint=False, force=True, one_graph=one)
    return arts


def main() -> None:
    import numpy as np

    from edgeattn.artifact.manifest import Manifest
    from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) the exported artifacts here")
    args = ap.parse_args()
    tmp = None if args.workdir else tempfile.TemporaryDirectory()
    root = args.workdir or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    arts = build(root, args.size)
    one, two = Manifest.load(arts[True]), Manifest.load(arts[False])
    th = args.threads
    sessions = {
        "one": OnnxRuntimeSession(one, threads=th),
        "two-shared": OnnxRuntimeSession(two, threads=th),
        "two-prepacked": OnnxRuntimeSession(two, threads=th, share_weights=False),
    }
    ids1 = np.zeros((1, 1), np.int64)
    prompt = np.random.default_rng(0).integers(0, 256, (1, PROMPT))

    def direct(n: int) -> None:  # the one graph alone, n tokens per call
        sess = sessions["one"].sessions["step"]
        state = {e.input: np.zeros(e.shape, np.float32) for e in one.state}
        for c in range(0, PROMPT, n):
            out = sess.run(None, {"input_ids": prompt[:, c : c + n], **state})
            state = {e.input: v for e, v in zip(one.state, out[1:])}

    decode: dict[str, list[float]] = {k: [] for k in sessions}
    prefill: dict[str, list[float]] = {}
    for s in sessions.values():
        for _ in range(5):
            s.step(ids1)
    for r in range(args.rounds):
        for k in list(sessions) if r % 2 == 0 else list(sessions)[::-1]:
            s = sessions[k]
            for _ in range(args.steps):
                t = time.perf_counter()
                s.step(ids1)
                decode[k].append(time.perf_counter() - t)
            s.reset()
            t = time.perf_counter()
            s.prefill(prompt)
            prefill.setdefault(f"{k} session", []).append(PROMPT / (time.perf_counter() - t))
        for n in (64, 256, 1024):
            t = time.perf_counter()
            direct(n)
            prefill.setdefault(f"one graph, {n} tokens/call", []).append(PROMPT / (time.perf_counter() - t))
    res = {
        "decode_ms": {k: 1e3 * statistics.median(v) for k, v in decode.items()},
        "prefill_tps": {k: statistics.median(v) for k, v in prefill.items()},
    }
    print(f"| {args.size} gla, {th} thread(s) | decode ms/token | vs one graph |")
    print("|---|---|---|")
    for k, v in res["decode_ms"].items():
        print(f"| {k} | {v:.3f} | {v / res['decode_ms']['one']:.2f}x |")
    print(f"\n| prefill of {PROMPT} tokens | tokens/s |\n|---|---|")
    for k, v in res["prefill_tps"].items():
        print(f"| {k} | {v:,.0f} |")
    print(
        json.dumps(
            with_cpu(
                {"benchmark": "one_graph", "size": args.size, "threads": th, "rounds": args.rounds, **res}
            )
        )
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
