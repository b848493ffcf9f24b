"""Decode latency and resident memory against context: linear-attention families vs the softmax baseline.

What it measures: `edgeattn bench --mixers gla,retnet,linear,aft,flash,swa,softmax --size small` (models of
equal parameter count, random weights: speed and memory do not depend on them) on ONNX Runtime, decode
latency per token after filling the state to 128 ... 16384 tokens, resident memory, prefill throughput and
each latency as a multiple of its floor (weights + state bytes over the measured read bandwidth, or FLOPs
over the measured matmul rate). Then it checks the claim the project makes:

- every fixed-state family decodes at 16384 tokens within 10% of its latency at 128, in resident memory
  within 1 MiB of it;
- the softmax baseline (KV cache) is at least 3x slower at 16384 than at 128.

    python benchmarks/decode.py [--size small] [--threads 1] [--repeats 3] [--out runs/bench-decode]
    python benchmarks/decode.py --from runs/bench-decode/results.json     # only the table and the checks

Prints a markdown table (for the README), the checks, then one JSON line. Families that this install
cannot build or run are listed as missing with the command that re-runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

FAMILIES = ("gla", "retnet", "linear", "aft", "flash", "swa", "softmax")
LINEAR = ("gla", "retnet", "linear", "aft", "flash", "swa")  # fixed-size state
SHORT, LONG = 128, 16384
MiB = 2**20


def run_bench(args) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "edgeattn.cli.main",
        "bench",
        "--mixers",
        ",".join(args.mixers),
        "--size",
        args.size,
        "--contexts",
        f"{SHORT},1024,4096,{LONG}",
        "--repeats",
        str(args.repeats),
        "--out",
        str(args.out),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    print("$ " + " ".join(cmd[2:]).replace("edgeattn.cli.main", "edgeattn", 1), flush=True)
    subprocess.run(cmd, check=True)
    return Path(args.out) / "results.json"


def headline(doc: dict) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    for r in doc["results"]:
        ctx = {c["context"]: c for c in r["contexts"] if not c["skipped"]}
        if SHORT not in ctx or LONG not in ctx:
            notes.append(
                f"{r['name']}: no figures at {SHORT} and {LONG} tokens "
                f"({'; '.join(r['errors']) or 'skipped'})"
            )
            continue
        a, b = ctx[SHORT], ctx[LONG]
        rows.append(
            {
                "family": r["mixer"],
                "backend": r["backend"],
                "params": r["params"],
                "ms_short": a["latency_s"]["p50"]["median"] * 1e3,
                "ms_short_spread": (a["latency_s"]["p50"]["min"] * 1e3, a["latency_s"]["p50"]["max"] * 1e3),
                "ms_long": b["latency_s"]["p50"]["median"] * 1e3,
                "ms_long_spread": (b["latency_s"]["p50"]["min"] * 1e3, b["latency_s"]["p50"]["max"] * 1e3),
                "mib_short": a["rss_bytes"]["median"] / MiB,
                "mib_long": b["rss_bytes"]["median"] / MiB,
                "prefill_tokens_per_s": (r["prefill_tokens_per_s"] or {}).get("median"),
                "floor_short": a["floor_multiple"]["median"],
                "floor_long": b["floor_multiple"]["median"],
            }
        )
    return rows, notes


def check(row: dict) -> tuple[bool, str]:
    ratio = row["ms_long"] / row["ms_short"]
    grow = row["mib_long"] - row["mib_short"]
    if row["family"] == "softmax":
        return ratio >= 3, f"{ratio:.2f}x slower at {LONG} (target >= 3x)"
    ok = ratio <= 1.10 and grow <= 1.0
    return ok, f"latency x{ratio:.3f} (target <= 1.10), memory {grow:+.2f} MiB (target <= 1 MiB)"


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mixers", type=lambda s: s.split(","), default=list(FAMILIES))
    ap.add_argument("--out", type=Path, default=Path("runs/bench-decode"))
    ap.add_argument("--from", dest="source", type=Path, default=None, help="an existing results.json")
    args = ap.parse_args()

    path = args.source or run_bench(args)
    doc = json.loads(path.read_text())
    rows, notes = headline(doc)
    mach = doc["machine"]
    print(
        f"\n{mach['cpu']}, {mach['cores_logical']} cores; "
        f"read bandwidth {mach['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
        f"threads {doc['settings']['threads'] or 'default'}; "
        f"median of {doc['settings']['repeats']} runs [min-max]\n"
    )
    print(
        f"| family | params | decode ms @{SHORT} | decode ms @{LONG} | RSS MiB @{SHORT} | RSS MiB @{LONG} "
        "| prefill tok/s | x floor @128 / @16384 | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    verdicts = {}
    for row in rows:
        ok, why = check(row)
        verdicts[row["family"]] = {"ok": ok, "why": why}
        s0, s1 = row["ms_short_spread"], row["ms_long_spread"]
        print(
            f"| {row['family']} | {row['params'] / 1e6:.2f}M "
            f"| {row['ms_short']:.3f} [{s0[0]:.3f}-{s0[1]:.3f}] "
            f"| {row['ms_long']:.3f} [{s1[0]:.3f}-{s1[1]:.3f}] "
            f"| {row['mib_short']:.1f} | {row['mib_long']:.1f} | {row['prefill_tokens_per_s'] or 0:,.0f} "
            f"| {row['floor_short']:.1f} / {row['floor_long']:.1f} | {'met' if ok else 'MISSED'}: {why} |"
        )
    for m in doc["missing"]:
        print(f"\nmissing {m['mixer']}: {m['reason']}\n  re-run: {m['command']}")
    for n in notes:
        print(f"\nno figures: {n}")
    print(
        json.dumps(
            with_cpu(
                {
                    "rows": rows,
                    "verdicts": verdicts,
                    "missing": [m["mixer"] for m in doc["missing"]] + [n.split(":")[0] for n in notes],
                    "results": str(path),
                }
            )
        )
    )


if __name__ == "__main__":
    main()
