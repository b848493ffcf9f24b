"""Per-token overhead of the Python session, and decode speed of the optimized graph against the unoptimized.

What it measures, for a `gla` model of each size (random weights: speed does not depend on them), exported
twice to the onnxruntime target (``optimize=True``, the default, and ``optimize=False``):

- ``session``: ms/token of ``OnnxRuntimeSession.step`` (token id in, logits copied out);
- ``bare``: ms/token of ONNX Runtime alone on the same ``InferenceSession``: ``run_with_iobinding`` on the
  session's preallocated bindings, nothing else (the floor any Python driver can reach);
- ``overhead`` = session / bare - 1 (target < 5%), and ``speedup`` = unoptimized / optimized session time.

Session and bare calls alternate token by token, and the two graphs alternate round by round, in one
process; every figure is the median of the per-token times. The machine may be shared: compare figures
from one run only.

    python benchmarks/overhead.py [--sizes small,full] [--threads 1,2] [--tokens 200] [--rounds 7]

``full`` is the 92.5M-parameter model of benchmarks/peers.py (d_model 768, 12 layers, 12 heads,
vocabulary 256). Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

SIZES = {
    "small": dict(d_model=256, n_layers=4, n_heads=4),
    "full": dict(d_model=768, n_layers=12, n_heads=12),
}


def build(root: Path, size: str) -> tuple[dict[bool, Path], int]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    model = EdgeLM(EdgeConfig(vocab_size=256, mixer="gla", **SIZES[size]))
    params = model.num_parameters()
    ckpt = model.save(root / f"{size}-ckpt")
    arts = {
        opt: export_model(ckpt, root / f"{size}-{opt}", optimize=opt, include_checkpoint=False, force=True)
        for opt in (True, False)
    }
    return arts, params


def time_pair(sess, tokens: int, bare_first: bool) -> tuple[list[float], list[float]]:
    """Per-token ms of ``sess.step`` and of ONNX Runtime alone, alternating token by token so that a busy
    machine slows both alike. Bare: the session's own InferenceSession and preallocated bindings, nothing
    else (the floor any Python driver can reach); it advances the state as a step would."""
    import numpy as np

    ids = np.zeros((1, 1), np.int64)
    ort_sess, bindings = sess.sessions["step"], sess._bindings["step"]
    clock = time.perf_counter
    session, bare = [], []
    for i in range(tokens):
        for which in (1, 0) if bare_first ^ (i & 1) else (0, 1):
            t = clock()
            if which:
                ort_sess.run_with_iobinding(bindings[sess._cur])
                sess._cur = 1 - sess._cur
                bare.append(clock() - t)
            else:
                sess.step(ids)
                session.append(clock() - t)
    return [1e3 * x for x in session], [1e3 * x for x in bare]


def measure(arts: dict[bool, Path], threads: int, tokens: int, rounds: int) -> dict:
    from edgeattn.runtimes import open_session

    sessions = {opt: open_session(path, threads=threads) for opt, path in arts.items()}
    runs: dict[tuple, list[float]] = {}
    for s in sessions.values():  # warm-up: first runs allocate
        time_pair(s, 10, False)
    for r in range(rounds):
        for opt in sorted(sessions, reverse=bool(r % 2)):
            session, bare = time_pair(sessions[opt], tokens, bool(r % 2))
            runs.setdefault((opt, "session"), []).extend(session)
            runs.setdefault((opt, "bare"), []).extend(bare)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "optimized": {"session_ms": med[(True, "session")], "bare_ms": med[(True, "bare")]},
        "unoptimized": {"session_ms": med[(False, "session")], "bare_ms": med[(False, "bare")]},
        "overhead": med[(True, "session")] / med[(True, "bare")] - 1,
        "speedup": med[(False, "session")] / med[(True, "session")],
    }


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: s.split(","), default=["small", "full"])
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if unknown := set(args.sizes) - set(SIZES):
        print(f"error: unknown size {sorted(unknown)}; choose from {sorted(SIZES)}", file=sys.stderr)
        sys.exit(2)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            arts, params = build(Path(tmp), size)
            for threads in args.threads:
                res = measure(arts, threads, args.tokens, args.rounds)
                results.append({"size": size, "params": params, "threads": threads, **res})
    print(
        "| model | threads | unoptimized ms/token | optimized ms/token | speedup | bare ORT ms/token | session overhead |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| gla {r['params'] / 1e6:.1f}M | {r['threads']} | {r['unoptimized']['session_ms']:.3f} "
            f"| {r['optimized']['session_ms']:.3f} | {r['speedup']:.2f}x | {r['optimized']['bare_ms']:.3f} "
            f"| {100 * r['overhead']:+.1f}% |"
        )
    print(
        json.dumps(
            with_cpu(
                {"benchmark": "overhead", "tokens": args.tokens, "rounds": args.rounds, "results": results}
            )
        )
    )


if __name__ == "__main__":
    main()
