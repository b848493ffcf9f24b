"""Per-token decode latency and resident memory at 128 and 8192 generated tokens: an artifact next to a
softmax KV-cache baseline of the same size.

What it measures: each artifact runs in a fresh process (clean memory figures) that first warms up
(WARMUP steps, then a reset to the empty state: ONNX Runtime's first runs allocate, fill caches and start
threads, and once made a cold 128-token figure slower than the 8192-token one), then generates up to the
largest mark one step at a time through the ONNX Runtime session; latency is the median of the 32 steps
ending at each mark (the median: other jobs on a shared machine add outliers), resident memory (RSS) is
read at each mark. The baseline is a softmax model
with the artifact's config (random weights: speed and memory do not depend on them). Why: a linear-
attention model's latency and memory stay flat while the KV cache grows with every token.

    python benchmarks/demo_decode.py ARTIFACT [--tokens 8192] [--marks 128,8192] [--threads 2]

Prints a table, one sentence with the result, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

WARMUP = 128  # untimed steps before the timed run (at most the largest mark)
WINDOW = 32  # timed steps ending at each mark

# The worker process: this file's decode_figures on a fresh session.
WORKER = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from demo_decode import decode_figures
from edgeattn.runtimes import open_session
art, threads, marks = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
print(json.dumps(decode_figures(open_session(art, threads=threads), marks)))
"""


def rss_mib() -> float:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def decode_figures(
    sess, marks: list[int], warmup: int = WARMUP, clock=time.perf_counter, rss=rss_mib
) -> dict:
    """{mark: {"ms_per_token", "rss_mib"}}: ``warmup`` untimed greedy steps, a reset to the empty state, then
    greedy steps up to the largest mark, each timed; the median of the WINDOW steps ending at each mark."""
    import numpy as np

    ids = np.zeros((1, 1), dtype=np.int64)
    for _ in range(min(warmup, max(marks))):
        ids[0, 0] = int(np.argmax(sess.step(ids)[0]))
    sess.reset()
    ids[0, 0] = 0
    times, out = [], {}
    for t in range(1, max(marks) + 1):
        t0 = clock()
        logits = sess.step(ids)
        times.append(clock() - t0)
        ids[0, 0] = int(np.argmax(logits[0]))
        if t in marks:
            out[t] = {"ms_per_token": 1e3 * statistics.median(times[-WINDOW:]), "rss_mib": rss()}
    return out


def softmax_baseline(artifact: Path, root: Path, max_len: int) -> Path:
    from edgeattn.export import Manifest, export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    cfg = dict(Manifest.load(artifact).data["model"])
    cfg.update(mixer="softmax", max_seq_len=max_len)
    ckpt = EdgeLM(EdgeConfig.from_dict(cfg)).save(root / "softmax_ckpt")
    return export_model(ckpt, root / "softmax", prefill_chunk=Manifest.load(artifact).prefill_tokens)


def run(art: Path, threads: int, marks: list[int]) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", WORKER, str(art), str(threads), ",".join(map(str, marks))],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise SystemExit(f"worker failed on {art}: {res.stderr.strip().splitlines()[-1]}")
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def result_sentence(name: str, results: dict, lo: int, hi: int) -> str:
    """The demo's conclusion in one plain sentence, from the measured figures only."""
    a, s = results["artifact"], results["softmax"]

    def grew(r) -> float:
        return r[hi]["rss_mib"] - r[lo]["rss_mib"]

    def slower(r) -> float:
        return r[hi]["ms_per_token"] / r[lo]["ms_per_token"]

    flat = "stayed flat" if abs(grew(a)) < max(1.0, 0.1 * grew(s)) else "changed"
    return (
        f"Result: from {lo} to {hi} tokens of context, {name}'s memory {flat} ({grew(a):+.1f} MiB, "
        f"{slower(a):.2f}x the time per token) while the softmax baseline's memory grew by {grew(s):+.1f} MiB "
        f"with its KV cache ({slower(s):.2f}x the time per token)."
    )


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--marks", default="128,8192")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ap.check_artifact(args.artifact)
    marks = [int(m) for m in args.marks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        base = softmax_baseline(args.artifact, Path(tmp), max(marks) + 64)
        results = {
            "artifact": run(args.artifact, args.threads, marks),
            "softmax": run(base, args.threads, marks),
        }
    name = args.artifact.name
    print(f"decode through ONNX Runtime, {args.threads} threads (each model in its own process)")
    print(f"{'model':<22}" + "".join(f"{f'ms/tok @{m}':>14}{f'RSS MiB @{m}':>15}" for m in marks))
    for key, label in (("artifact", name), ("softmax", "softmax baseline")):
        row = results[key]
        print(
            f"{label:<22}"
            + "".join(f"{row[m]['ms_per_token']:>14.2f}{row[m]['rss_mib']:>15.1f}" for m in marks)
        )
    lo, hi = min(marks), max(marks)
    print(result_sentence(name, results, lo, hi))
    summary = {
        key: {
            "ms_per_token": {str(m): r[m]["ms_per_token"] for m in marks},
            "rss_mib": {str(m): r[m]["rss_mib"] for m in marks},
            "latency_ratio": r[hi]["ms_per_token"] / r[lo]["ms_per_token"],
            "rss_growth_mib": r[hi]["rss_mib"] - r[lo]["rss_mib"],
        }
        for key, r in results.items()
    }
    print(json.dumps(with_cpu(summary)))


if __name__ == "__main__":
    main()
