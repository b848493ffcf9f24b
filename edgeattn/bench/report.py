"""Everything ``edgeattn bench`` shows and writes: rich tables, results.json/.csv, the comparison with an
earlier run, and the one-line JSON headline. Writes are atomic (a temporary file, then a rename)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from edgeattn._atomic import write_bytes
from edgeattn.bench import schema
from edgeattn.bench.schema import MiB

# ---- small formatting helpers ------------------------------------------------------------------------


def _med(st: dict | None, scale: float = 1.0) -> float | None:
    return None if st is None else st["median"] * scale


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _spread(st: dict | None, scale: float = 1.0, spec: str = ".3g") -> str:
    if st is None:
        return "-"
    if len(st["values"]) == 1:
        return format(st["median"] * scale, spec)
    lo, mid, hi = (format(st[k] * scale, spec) for k in ("min", "median", "max"))
    return f"{mid} [{lo}-{hi}]"


def _cells(*cells: str):
    """Table cells as plain text: names and "[min-max]" spreads are not rich markup."""
    from rich.text import Text

    return [Text(c) for c in cells]


def _measured(result: dict) -> list[dict]:
    return [c for c in result["contexts"] if not c["skipped"]]


def csv_rows(doc: dict) -> list[dict]:
    """One row per (configuration, context): the figures of results.json, flattened."""
    rows = []
    for r in doc["results"]:
        th = {t["context"]: t for t in r["theory"]}
        for c in r["contexts"]:
            lat = c.get("latency_s") or {}
            t = th.get(c["context"], {})
            rows.append(
                {
                    "name": r["name"],
                    "mixer": r["mixer"],
                    "backend": r["backend"],
                    "device": r.get("device"),
                    "target": r["target"],
                    "precision": r["precision"],
                    "params": r["params"],
                    "context": c["context"],
                    "skipped": c["skipped"] or "",
                    "p50_ms": _med(lat.get("p50"), 1e3),
                    "p50_min_ms": lat["p50"]["min"] * 1e3 if lat else None,
                    "p50_max_ms": lat["p50"]["max"] * 1e3 if lat else None,
                    "p90_ms": _med(lat.get("p90"), 1e3),
                    "p99_ms": _med(lat.get("p99"), 1e3),
                    "floor_ms": t.get("floor_s", 0) * 1e3,
                    "floor_bound": t.get("bound"),
                    "floor_multiple": _med(c.get("floor_multiple")),
                    "flops_per_token": t.get("flops"),
                    "state_bytes": t.get("state_bytes"),
                    "rss_mib": _med(c.get("rss_bytes"), 1 / MiB),
                    "rss_min_mib": c["rss_bytes"]["min"] / MiB if c.get("rss_bytes") else None,
                    "rss_max_mib": c["rss_bytes"]["max"] / MiB if c.get("rss_bytes") else None,
                    "peak_rss_mib": _med(c.get("peak_rss_bytes"), 1 / MiB),
                    "device_mib": _med(c.get("device_bytes"), 1 / MiB),
                    "memory_slope_bytes_per_token": _med(r["memory_slope_bytes_per_token"]),
                    "prefill_tokens_per_s": _med(r["prefill_tokens_per_s"]),
                    "step_tokens_per_s": _med(r["step_tokens_per_s"]),
                    "load_s": _med(r["load_s"]),
                    "artifact_bytes": r["artifact_bytes"],
                    "weight_bytes": r["weight_bytes"],
                    "bits_per_byte": r["bits_per_byte"],
                }
            )
    return rows


def write_outputs(doc: dict, out: Path) -> list[Path]:
    """results.json, results.csv and the plots (when matplotlib is installed) in ``out``."""
    from edgeattn.bench.plots import write_plots

    out = Path(out)
    files = [out / "results.json", out / "results.csv"]
    plots, why = write_plots(doc, out)
    doc["files"] = [str(p) for p in files + plots]
    doc["plots_skipped"] = why
    schema.check(doc)
    rows = csv_rows(doc)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["name"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_bytes(out / "results.csv", buf.getvalue().encode())
    write_bytes(out / "results.json", (json.dumps(doc, indent=2) + "\n").encode())
    return files + plots


def read_results(path: Path) -> dict:
    """An earlier results.json, validated (one-line ValueError otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--compare {path} does not exist")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--compare {path} is not valid JSON: {e}") from None
    try:
        schema.check(doc)
    except ValueError as e:
        raise ValueError(f"--compare {path}: {e}") from None
    return doc


# ---- comparison with an earlier run ------------------------------------------------------------------


def figures(r: dict) -> dict[str, float]:
    """Every measured figure of one configuration, by a stable name (medians over repeats)."""
    out: dict[str, float | None] = {}
    for c in _measured(r):
        k = c["context"]
        for q in ("p50", "p90", "p99"):
            out[f"decode_{q}_ms@{k}"] = _med(c["latency_s"][q], 1e3)
        out[f"floor_multiple@{k}"] = _med(c["floor_multiple"])
        out[f"rss_mib@{k}"] = _med(c["rss_bytes"], 1 / MiB)
        out[f"peak_rss_mib@{k}"] = _med(c["peak_rss_bytes"], 1 / MiB)
        out[f"device_mib@{k}"] = _med(c.get("device_bytes"), 1 / MiB)
    out["memory_slope_bytes_per_token"] = _med(r["memory_slope_bytes_per_token"])
    out["prefill_tokens_per_s"] = _med(r["prefill_tokens_per_s"])
    out["step_tokens_per_s"] = _med(r["step_tokens_per_s"])
    out["load_s"] = _med(r["load_s"])
    out["rss_after_load_mib"] = _med(r["rss_after_load_bytes"], 1 / MiB)
    out["artifact_bytes"] = float(r["artifact_bytes"])
    out["bits_per_byte"] = r["bits_per_byte"]
    return {k: v for k, v in out.items() if v is not None}


def compare(doc: dict, old: dict, against: str) -> dict:
    """Ratio new / old of every figure the two runs share, per configuration matched by (name, backend)."""
    before = {(r["name"], r["backend"]): r for r in old["results"]}
    rows, unmatched = [], []
    for r in doc["results"]:
        o = before.get((r["name"], r["backend"]))
        if o is None:
            unmatched.append(f"{r['name']} on {r['backend']}")
            continue
        new, prev = figures(r), figures(o)
        for k in new:
            if k in prev:
                ratio = new[k] / prev[k] if prev[k] else None
                rows.append(
                    {
                        "name": r["name"],
                        "backend": r["backend"],
                        "figure": k,
                        "old": prev[k],
                        "new": new[k],
                        "ratio": ratio,
                    }
                )
    return {"against": against, "created_before": old.get("created"), "rows": rows, "unmatched": unmatched}


# ---- terminal ----------------------------------------------------------------------------------------


def print_report(doc: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    mach = doc["machine"]
    gpu = ", ".join(g["name"] for g in mach["gpus"]) or "no GPU"
    load = mach.get("load_average")
    console.print(
        f"[bold]{escape(mach['cpu'])}[/bold], {mach['cores_logical']} cores, "
        f"{mach['memory_bytes'] / 2**30:.1f} GiB, {escape(gpu)}; "
        f"read bandwidth {mach['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"matmul {mach['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s (numpy float32)"
        + (f"; load average {load[0]:.1f} at start" if load else "")
    )
    s = doc["settings"]
    console.print(
        f"{s['repeats']} repeats round-robin, {s['steps']} timed steps per context "
        f"after {s['warmup']} warm-up steps, "
        f"threads {s['threads'] or 'runtime default'}; spread in brackets is \\[min-max] over repeats"
    )

    first, last = s["contexts"][0], s["contexts"][-1]
    t = Table(title="Theory: cost per token and the floor it implies on this machine")
    for col in (
        "family",
        "params",
        "weights MiB",
        "train parallel",
        "train chunk",
        "decode/token",
        "state",
        f"GFLOP/token @{first} / @{last}",
        f"state KiB @{first} / @{last}",
        f"floor ms @{first} / @{last}",
    ):
        t.add_column(col, overflow="fold")
    shown = set()
    for r in doc["results"]:
        if r["name"] in shown:
            continue
        shown.add(r["name"])
        a, b = r["theory"][0], r["theory"][-1]
        cx = r["complexity"]
        t.add_row(
            *_cells(
                f"{r['name']} ({r['mixer']})" if r["name"] != r["mixer"] else r["name"],
                f"{r['params'] / 1e6:.2f}M",
                f"{r['weight_bytes'] / MiB:.2f}",
                cx["parallel"],
                cx["chunk"],
                cx["decode"],
                cx["state"],
                f"{a['flops'] / 1e9:.3g} / {b['flops'] / 1e9:.3g}",
                f"{a['state_bytes'] / 1024:.4g} / {b['state_bytes'] / 1024:.4g}",
                f"{a['floor_s'] * 1e3:.3g} / {b['floor_s'] * 1e3:.3g} ({b['bound']})",
            )
        )
    console.print(t)

    t = Table(title="Decode: latency per token after filling the state to each context")
    for col in (
        "name",
        "backend",
        "context",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "x floor",
        "RSS MiB",
        "device MiB",
    ):
        t.add_column(col, overflow="fold")
    for r in doc["results"]:
        for c in r["contexts"]:
            head = [r["name"], r["backend"], str(c["context"])]
            if c["skipped"]:
                why = c["skipped"] if c["skipped"].startswith("failed") else f"skipped: {c['skipped']}"
                t.add_row(*_cells(*head, why, *[""] * 5))
                continue
            lat = c["latency_s"]
            cells = [_spread(lat[q], 1e3) for q in ("p50", "p90", "p99")]
            cells += [_spread(c["floor_multiple"]), _spread(c["rss_bytes"], 1 / MiB, ".1f")]
            cells += [_spread(c["device_bytes"], 1 / MiB, ".1f")]
            t.add_row(*_cells(*head, *cells))
    console.print(t)
    below = any(c["floor_multiple"]["median"] < 1 for r in doc["results"] for c in _measured(r))
    if below:
        console.print(
            "x floor below 1: weights and state served from the CPU caches beat the DRAM bandwidth floor "
            "(the model fits in the last-level cache)"
        )

    t = Table(title="Load, prefill and memory growth")
    cols = [
        "name",
        "backend",
        "load s",
        "graphs MiB",
        "prefill tok/s (graph)",
        "prefill tok/s (steps)",
        "RSS slope B/token",
    ]
    if any(r["bits_per_byte"] is not None for r in doc["results"]):
        cols.append("bits/byte")
    for col in cols:
        t.add_column(col, overflow="fold")
    for r in doc["results"]:
        row = [
            r["name"],
            r["backend"],
            _spread(r["load_s"]),
            f"{r['artifact_bytes'] / MiB:.2f}",
            _spread(r["prefill_tokens_per_s"], 1, ".0f"),
            _spread(r["step_tokens_per_s"], 1, ".0f"),
            _spread(r["memory_slope_bytes_per_token"], 1, ".0f"),
        ]
        if len(cols) > 7:
            row.append(_fmt(r["bits_per_byte"], ".4f"))
        t.add_row(*_cells(*row))
    console.print(t)
    for r in doc["results"]:
        for e in r["errors"]:
            console.print(f"[red]failed[/red] {escape(e)}")
    for m in doc["missing"]:
        console.print(
            f"[yellow]missing[/yellow] {m['mixer']}: {escape(m['reason'])}; re-run: {escape(m['command'])}"
        )


def print_comparison(cmp: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"Against {cmp['against']} ({cmp['created_before']}): ratio = this run / that run")
    for col in ("name", "backend", "figure", "before", "now", "ratio"):
        t.add_column(col, overflow="fold")
    for row in cmp["rows"]:
        ratio = row["ratio"]
        style = "" if ratio is None else ("green" if 0.95 <= ratio <= 1.05 else "yellow")
        cells = _cells(
            row["name"],
            row["backend"],
            row["figure"],
            f"{row['old']:.4g}",
            f"{row['new']:.4g}",
            _fmt(ratio, ".3f"),
        )
        cells[-1].stylize(style)
        t.add_row(*cells)
    console.print(t)
    for u in cmp["unmatched"]:
        console.print(f"not in {cmp['against']}: {u}")


def headline(doc: dict, out: Path | None) -> dict:
    """The figures a program wants, for the one JSON line that ends stdout."""
    results = []
    for r in doc["results"]:
        m = _measured(r)
        results.append(
            {
                "name": r["name"],
                "backend": r["backend"],
                "mixer": r["mixer"],
                "params": r["params"],
                "decode_ms": {str(c["context"]): round(c["latency_s"]["p50"]["median"] * 1e3, 5) for c in m},
                "rss_mib": {str(c["context"]): round(c["rss_bytes"]["median"] / MiB, 2) for c in m},
                "floor_multiple": {str(c["context"]): round(c["floor_multiple"]["median"], 2) for c in m},
                "skipped": [c["context"] for c in r["contexts"] if c["skipped"]],
                "prefill_tokens_per_s": _med(r["prefill_tokens_per_s"]),
                "step_tokens_per_s": _med(r["step_tokens_per_s"]),
                "bytes_per_token": _med(r["memory_slope_bytes_per_token"]),
                "bits_per_byte": r["bits_per_byte"],
                "errors": len(r["errors"]),
            }
        )
    mach = doc["machine"]
    return {
        "bench": schema.FORMAT,
        "cpu": mach["cpu"],
        "bandwidth_gb_s": round(mach["bandwidth_bytes_per_s"] / 1e9, 2),
        "matmul_gflop_s": round(mach["matmul_flops_per_s"] / 1e9, 2),
        "results": results,
        "missing": [m["mixer"] for m in doc["missing"]],
        "out": None if out is None else str(out),
    }
