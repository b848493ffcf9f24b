"""Prefill speed against the tokens per graph call: one ONNX Runtime session of a one-graph artifact (a
dynamic token axis, e.g. the Qwen3.5 int4 export) prefills the same random prompt from an empty state in
calls of each length, the lengths (and the artifacts, one session each) interleaved round by round (the
order rotated each round), so a machine's load falls on all of them alike.

    python benchmarks/prefill_chunks.py ARTIFACT [ARTIFACT ...] [--tokens 1024] \
        [--chunks 64,128,256,512,1024] [--rounds 3] [--threads 2]

Each measurement is ``Session.prefill(ids, chunk=C)``, what the session does with C as the artifact's
``--prefill-chunk``: the prompt in calls of C tokens, the last call the rest (the figures include its
bindings and the logits it returns). ``other``: the CPU other processes took while a figure
was timed, in cores (``peers.disturbance``). Prints, per length, the median tok/s over rounds and its
range, then ONE JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import _cpu_ticks, disturbance  # noqa: E402

from edgeattn.bench.machine import with_cpu


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", help="one or more artifacts (each one session, interleaved too)")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    ap.add_argument("--chunks", default="64,128,256,512,1024", help="tokens per call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--chunks must be comma-separated integers, got {args.chunks!r}")
    if not chunks or min(chunks) < 1 or args.tokens < 1 or args.rounds < 1:
        ap.error("--chunks, --tokens and --rounds must be positive")

    sessions = {}
    for a in args.artifacts:
        sessions[a] = ap.open_session(a, threads=args.threads)
        if not getattr(sessions[a], "any_tokens", False):
            ap.error(f"{a}: not a one-graph artifact with a dynamic token axis (CPU)")
    vocab = min(s.manifest.vocab_size for s in sessions.values())
    ids = np.random.default_rng(args.seed).integers(2, vocab, size=(1, args.tokens), dtype=np.int64)
    variants = [(a, c) for a in args.artifacts for c in chunks]
    first = {}
    for a, c in variants:  # untimed: every call length once (ONNX Runtime sizes its arena per shape)
        sessions[a].reset()
        first[a, c] = sessions[a].prefill(ids, chunk=c)
    # the lengths must agree (int8 activations of accuracy-level-4 MatMulNBits round differently when another
    # kernel path changes a float by an ulp, so int4 graphs differ by more than float32 ones)
    diff = {(a, c): float(np.abs(first[a, c] - first[a, chunks[0]]).max()) for a, c in variants}
    runs: dict = {v: [] for v in variants}
    for r in range(args.rounds):
        for a, c in variants[r % len(variants) :] + variants[: r % len(variants)]:
            sessions[a].reset()
            t, ticks = time.perf_counter(), _cpu_ticks()
            sessions[a].prefill(ids, chunk=c)
            dt = time.perf_counter() - t
            runs[a, c].append({"tps": args.tokens / dt, "other": disturbance(ticks, _cpu_ticks(), dt)})
    print(f"{args.tokens} tokens, {args.threads} threads, {args.rounds} rounds")
    print(
        "| artifact | tokens per call | tok/s median | range | other (max, cores) | max logit diff vs first |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for a, c in variants:
        tps = [x["tps"] for x in runs[a, c]]
        row = {
            "artifact": a,
            "chunk": c,
            "tps": statistics.median(tps),
            "min": min(tps),
            "max": max(tps),
            "other": max(x["other"] for x in runs[a, c]),
            "diff": diff[a, c],
            "runs": runs[a, c],
        }
        rows.append(row)
        print(
            f"| {a} | {c} | {row['tps']:.1f} | {row['min']:.1f}-{row['max']:.1f} | {row['other']:.2f} | "
            f"{row['diff']:.1e} |"
        )
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "prefill_chunks",
                    "tokens": args.tokens,
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "results": rows,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
