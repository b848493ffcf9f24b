"""PNG plots of a results document (matplotlib, Agg backend): one line per configuration, log context axis.

- ``latency_vs_context.png``: decode latency per token (p50, bars from the min to the max over repeats);
- ``memory_vs_context.png``: resident memory after each context (median, bars min to max).
"""

from __future__ import annotations

import io
from pathlib import Path

from edgeattn._atomic import write_bytes
from edgeattn.bench.schema import MiB


def _series(doc: dict, key: str, scale: float):
    for r in doc["results"]:
        pts = [c for c in r["contexts"] if not c["skipped"] and (c.get(key) if key != "latency" else True)]
        if not pts:
            continue
        stats = [c["latency_s"]["p50"] if key == "latency" else c[key] for c in pts]
        xs = [c["context"] for c in pts]
        ys = [s["median"] * scale for s in stats]
        lo = [(s["median"] - s["min"]) * scale for s in stats]
        hi = [(s["max"] - s["median"]) * scale for s in stats]
        yield f"{r['name']} / {r['backend']}", xs, ys, (lo, hi)


def _plot(doc: dict, key: str, scale: float, ylabel: str, title: str) -> bytes | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(_series(doc, key, scale))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    try:
        for label, xs, ys, err in series:
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for _, xs, _, _ in series for x in xs})
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.minorticks_off()
        all_y = [y for _, _, ys, _ in series for y in ys if y > 0]
        if all_y and max(all_y) / min(all_y) > 30:
            ax.set_yscale("log")
        ax.set_xlabel("context (tokens in the state)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def write_plots(doc: dict, out: Path) -> tuple[list[Path], str | None]:
    """Write the plots into ``out``; ``(paths, None)``, or ``([], reason)`` without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [], "matplotlib is not installed: pip install 'edgeattn[bench]' for the plots"
    cpu = doc["machine"]["cpu"]
    written = []
    for name, key, scale, ylabel in (
        ("latency_vs_context.png", "latency", 1e3, "decode latency p50 (ms / token)"),
        ("memory_vs_context.png", "rss_bytes", 1 / MiB, "resident memory (MiB)"),
    ):
        png = _plot(doc, key, scale, ylabel, f"{ylabel.split(' (')[0]} vs context, {cpu}")
        if png is not None:
            written.append(write_bytes(Path(out) / name, png))
    return written, None
