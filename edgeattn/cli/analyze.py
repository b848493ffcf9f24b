"""`edgeattn analyze [CKPT]`: approximation error and cost of every attention method against exact softmax.

For random q, k, v and, given a checkpoint, for its real q, k, v at every layer (captured with forward
hooks on the mixers while it reads a text sample): the relative Frobenius error of linear, performer,
rff, lsh and nystrom attention against exact softmax on the same q, k, v, sweeping features, buckets
and landmarks. Then the complexity table (FLOPs and memory per method against T) next to the time
and peak memory measured on this machine, and the length from which linear attention is cheaper than
softmax. A table on stdout, one JSON line at the end, PNG plots with ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import Command, cli_errors


def _ints(name: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{name} must be comma-separated integers >= 1, got {text!r}")
    return values


def _mid(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def _error_table(columns: list[str], rows: dict[tuple, dict[str, float]]) -> list[str]:
    head = f"{'method':<10} {'param':<12} {'value':>6}  " + "  ".join(f"{c:>12}" for c in columns)
    lines = [head, "-" * len(head)]
    for (method, param, value), errs in rows.items():
        cells = "  ".join(f"{errs[c]:>12.4g}" if c in errs else f"{'-':>12}" for c in columns)
        lines.append(f"{method:<10} {param or '-':<12} {value if value is not None else '-':>6}  {cells}")
    return lines


def _save_png(fig, path) -> str:
    """``fig`` laid out and written to ``path`` as PNG in one atomic write; returns the path."""
    import io

    from edgeattn._atomic import write_bytes

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return str(write_bytes(path, buf.getvalue()))


def _plots(out: Path, errors: dict, cost: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullLocator

    written = []
    n_series = max(len(errors) * 2, 1)  # legend rows below the panels: the performer/rff panel has the most
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2 + 0.12 * n_series), dpi=110)
    try:
        for ax, (methods, xlabel) in zip(
            axes,
            ((("performer", "rff"), "random features m"), (("lsh",), "buckets"), (("nystrom",), "landmarks")),
        ):
            xs, ys = set(), []
            for source, rows in errors.items():
                for method in methods:
                    pts = sorted((r["value"], r["error"]) for r in rows if r["method"] == method)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{method} ({source})")
                        xs.update(x for x, _ in pts)
                        ys.extend(y for _, y in pts if y > 0)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(xs), [str(x) for x in sorted(xs)])  # the values measured, as numbers
            ax.xaxis.set_minor_locator(NullLocator())
            if ys and max(ys) / min(ys) > 10:  # a log axis labelled at 1, 2, 5 x 10^k, as plain numbers
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                ax.yaxis.set_minor_locator(NullLocator())
            ax.set_xlabel(xlabel)
            ax.set_ylabel("relative Frobenius error vs softmax")
            ax.grid(True, which="both", alpha=0.3)
            # below the panel, so that it never covers a line
            ax.legend(
                fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False
            )
        written.append(_save_png(fig, out / "error_vs_features.png"))
    finally:
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    try:
        for method in dict.fromkeys(r["method"] for r in cost):
            pts = [(r["T"], r["time_s"] * 1e3) for r in cost if r["method"] == method]
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("forward time (ms)")
        ax.set_title("attention forward time vs T on this machine")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        written.append(_save_png(fig, out / "time_vs_length.png"))
    finally:
        plt.close(fig)
    return written


@cli_errors
def analyze(
    checkpoint: Annotated[
        Path | None,
        typer.Argument(help="Trained checkpoint directory (optional: random inputs only without)."),
    ] = None,
    text: Annotated[
        Path | None, typer.Option(help="Text the checkpoint reads (default: Python's os.py).")
    ] = None,
    tokens: Annotated[int, typer.Option(min=2, help="Tokens of the text sample.")] = 256,
    random: Annotated[bool, typer.Option(help="Also analyze random Gaussian q, k, v.")] = True,
    length: Annotated[int, typer.Option(min=2, help="T of the random inputs.")] = 256,
    heads: Annotated[int, typer.Option(min=1, help="Heads of the random inputs and the timings.")] = 2,
    head_dim: Annotated[
        int, typer.Option(min=1, help="Head size d of the random inputs and the timings.")
    ] = 32,
    features: Annotated[str, typer.Option(help="Random features m swept (performer, rff).")] = "8,32,128",
    buckets: Annotated[str, typer.Option(help="LSH buckets swept (1 or even).")] = "2,8,32",
    landmarks: Annotated[str, typer.Option(help="Nystrom landmarks swept.")] = "8,32,128",
    lsh_rounds: Annotated[int, typer.Option(min=1, help="LSH hashing rounds.")] = 2,
    bucket_size: Annotated[int, typer.Option(min=1, help="LSH chunk of the sorted sequence.")] = 32,
    seeds: Annotated[int, typer.Option(min=1, help="Draws of the random features averaged per error.")] = 2,
    lengths: Annotated[str, typer.Option(help="T of the cost table and timings.")] = "128,256,512,1024",
    repeats: Annotated[int, typer.Option(min=1, help="Timed calls per op (median).")] = 3,
    threads: Annotated[int | None, typer.Option(min=1, help="Torch threads (default: torch's).")] = None,
    out: Annotated[Path | None, typer.Option(help="Directory for the PNG plots.")] = None,
) -> None:
    """Error of each approximate attention vs exact softmax, and its cost vs T (table, JSON, plots)."""
    feats, bucks, lands = (
        _ints("features", features),
        _ints("buckets", buckets),
        _ints("landmarks", landmarks),
    )
    lens = _ints("lengths", lengths)
    for b in bucks:
        if b > 1 and b % 2:
            raise ValueError(f"--buckets must be 1 or even (angular LSH), got {b}")
    if checkpoint is None and not random:
        raise ValueError("nothing to analyze: give a checkpoint or leave --random on")
    if checkpoint is not None and not checkpoint.is_dir():
        raise ValueError(f"checkpoint {checkpoint} is not a directory")
    if text is not None and not text.is_file():
        raise ValueError(f"text file {text} does not exist")
    if out is not None and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")

    from edgeattn._deps import require

    torch = require("torch")
    from edgeattn.bench.approx import COST, crossover, error_sweep, measure
    from edgeattn.ops import attention

    if threads is not None:
        torch.set_num_threads(threads)
    sweeps = {"linear": [None], "performer": feats, "rff": feats, "lsh": bucks, "nystrom": lands}
    kw = dict(seeds=seeds, lsh_rounds=lsh_rounds, bucket_size=bucket_size)
    errors: dict[str, list[dict]] = {}
    if random:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, length, heads, head_dim, generator=gen) for _ in range(3))
        errors["random"] = error_sweep(q, k, v, sweeps, **kw)
    if checkpoint is not None:
        import os

        from edgeattn.bench.approx import capture_qkv
        from edgeattn.models import EdgeLM

        model = EdgeLM.load(checkpoint).eval()
        if model.cfg.vocab_size < 256:
            raise ValueError(f"the checkpoint's vocabulary ({model.cfg.vocab_size}) is not byte-level (256)")
        data = text.read_bytes() if text is not None else Path(os.__file__).read_bytes()
        if len(data) < tokens:
            raise ValueError(f"the text has {len(data)} bytes, fewer than --tokens {tokens}")
        ids = torch.tensor(list(data[:tokens]), dtype=torch.long)[None]
        for i, name, qkv in capture_qkv(model, ids):
            if qkv is not None:
                errors[f"L{i}:{name}"] = error_sweep(*qkv, sweeps, **kw)

    # The complexity table at the middle of each sweep, next to this machine's measurements.
    opts = {"m": _mid(feats), "b": _mid(bucks), "c": bucket_size, "r": lsh_rounds, "l": _mid(lands)}
    call_opts = {
        "softmax": {},
        "linear": {},
        "performer": {"n_features": opts["m"]},
        "rff": {"n_features": opts["m"]},
        "lsh": {"n_buckets": opts["b"], "n_rounds": lsh_rounds, "bucket_size": bucket_size},
        "nystrom": {"n_landmarks": opts["l"]},
    }
    d, H = head_dim, heads
    gen = torch.Generator().manual_seed(1)
    cost = []
    for T in lens:
        q, k, v = (torch.randn(1, T, H, d, generator=gen) for _ in range(3))
        for method, c in COST.items():
            if method == "nystrom" and opts["l"] > T:
                continue
            causal = method != "nystrom"
            seconds, peak = measure(
                lambda m=method, cz=causal, x=(q, k, v): attention(*x, method=m, causal=cz, **call_opts[m]),
                repeats,
            )
            cost.append(
                {
                    "method": method,
                    "T": T,
                    "flops": H * c.flops(T, d, opts),
                    "memory_bytes": 4 * H * c.memory(T, d, opts),
                    "time_s": seconds,
                    "peak_bytes": peak,
                }
            )
    cross = {
        m: crossover(lambda T, m=m: COST[m].flops(T, d, opts), lambda T: COST["softmax"].flops(T, d, opts))
        for m in ("linear", "performer", "rff")
    }
    measured = {}
    for m in ("linear", "performer"):
        times = {r["T"]: r["time_s"] for r in cost if r["method"] == m}
        soft = {r["T"]: r["time_s"] for r in cost if r["method"] == "softmax"}
        faster = [T for T in lens if times[T] < soft[T]]
        measured[m] = min(faster) if faster else None

    # ---- report
    columns = list(errors)
    rows: dict[tuple, dict[str, float]] = {}
    for source, rs in errors.items():
        for r in rs:
            rows.setdefault((r["method"], r["param"], r["value"]), {})[source] = r["error"]
    print(f"relative Frobenius error vs exact softmax (causal; nystrom vs bidirectional), {seeds} seed(s)")
    for line in _error_table(columns, rows):
        print(line)
    print()
    print(
        f"cost per layer: H={H}, d={d}, m={opts['m']}, buckets={opts['b']}, bucket_size={bucket_size}, "
        f"rounds={lsh_rounds}, landmarks={opts['l']} (FLOPs and memory from the formulas; time and peak measured)"
    )
    head = (
        f"{'method':<10} {'T':>6} {'GFLOP':>9} {'formula MiB':>12} {'time ms':>9} {'peak MiB':>9}   formula"
    )
    print(head)
    print("-" * len(head))
    for r in cost:
        print(
            f"{r['method']:<10} {r['T']:>6} {r['flops'] / 1e9:>9.4f} {r['memory_bytes'] / 2**20:>12.3f} "
            f"{r['time_s'] * 1e3:>9.3f} {r['peak_bytes'] / 2**20:>9.3f}   {COST[r['method']].formula}"
        )
    print()
    for m in ("linear", "performer", "rff"):
        line = f"{m} needs fewer FLOPs than softmax from T = {cross[m]}"
        if m in measured:
            got = measured[m]
            line += (
                f"; measured faster here from T = {got}"
                if got is not None
                else f"; not measured faster up to T = {max(lens)}"
            )
        print(line)
    plots = []
    if out is not None:
        plots = _plots(out, errors, cost)
        for p in plots:
            print(f"wrote {p}")
    doc = {
        "errors": errors,
        "cost": cost,
        "cost_options": {**opts, "H": H, "d": d},
        "crossover_flops": cross,
        "crossover_measured": measured,
        "plots": plots,
    }
    print(json.dumps(doc, separators=(",", ":")))


def register(app: typer.Typer) -> None:
    app.command("analyze", cls=Command)(analyze)
