"""`edgeattn bench DIR...`: decode latency, memory and prefill speed of exported artifacts on this machine.

    edgeattn bench art/gla art/softmax --backend onnxruntime --contexts 128,1024,4096,16384 --out bench/
    edgeattn bench --mixers gla,retnet,softmax --size small --out bench/      # fresh models (needs torch)
    edgeattn bench art/gla --compare bench/results.json                       # ratio to an earlier run

Every (artifact, backend) configuration runs in a process of its own (edgeattn.bench.worker) for each
repeat, in round-robin order. On existing artifacts only the base install is needed (no torch).
The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import sys
import tempfile
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import cli_errors

_WHAT = "What to benchmark"
_HOW = "Measurement"
_OUT = "Output"


class Size(str, Enum):
    tiny = "tiny"
    small = "small"
    medium = "medium"


class Target(str, Enum):
    auto = "auto"
    onnxruntime = "onnxruntime"
    portable = "portable"


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"


def _console(stderr: bool = False):
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Not a terminal (a pipe, a log file): wide enough for the tables instead of rich's 80 columns.
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(file=stream, width=width, stderr=stderr)


def _fresh(
    mixers: str,
    size: Size,
    contexts: list[int],
    steps: int,
    warmup: int,
    target: str,
    precision: str,
    root: Path,
    console,
    rerun_options: str = "",
) -> tuple[list[Path], list[dict]]:
    """Export one model per family into ``root``; print the parameter counts; list the missing families."""
    from rich.markup import escape

    from edgeattn.bench import presets

    names = presets.parse_mixers(mixers)
    planned = presets.plan(names, size.value, presets.max_seq_len_for(contexts, steps, warmup + 64))
    missing = []
    for p in planned:
        if p.config is None:
            cmd = presets.rerun_command([p.mixer], size.value) + rerun_options
            missing.append({"mixer": p.mixer, "reason": p.reason, "command": cmd})
    avail = [p for p in planned if p.config is not None]
    if not avail:
        raise ValueError(
            f"none of the mixers {', '.join(names)} is available in this install: {planned[0].reason}"
        )
    ref = avail[0].params
    console.print(
        f"size {size.value}: d_model {avail[0].config.d_model}, {avail[0].config.n_layers} layers, "
        f"{avail[0].config.n_heads} heads; MLP ratio set per family for equal parameter counts:"
    )
    for p in avail:
        console.print(
            f"  {p.mixer:<14} {p.params:>12,} parameters  (MLP ratio {p.config.mlp_ratio:.3f}, "
            f"{100 * (p.params / ref - 1):+.1f}% vs {avail[0].mixer})"
        )
    for m in missing:
        console.print(f"  {m['mixer']:<14} [yellow]missing[/yellow]: {escape(m['reason'])}")
    with _console(stderr=True).status(f"exporting {len(avail)} models ({target}, {precision})"):
        arts = presets.export_planned(planned, root, target=target, precision=precision)
    return [arts[p.mixer] for p in avail], missing


@cli_errors
def bench(
    artifacts: Annotated[
        list[Path] | None,
        typer.Argument(help="Artifact directories written by `edgeattn export`.", show_default=False),
    ] = None,
    mixers: Annotated[
        str | None,
        typer.Option(
            help="Export fresh models of these families (comma list) and benchmark them; needs torch.",
            rich_help_panel=_WHAT,
        ),
    ] = None,
    size: Annotated[
        Size,
        typer.Option(help="Size preset of --mixers models (equal parameter counts).", rich_help_panel=_WHAT),
    ] = Size.small,
    target: Annotated[
        Target,
        typer.Option(
            help="Export target of --mixers models; auto: portable when tensorrt is benchmarked.",
            rich_help_panel=_WHAT,
        ),
    ] = Target.auto,
    precision: Annotated[
        Precision, typer.Option(help="Precision of --mixers models.", rich_help_panel=_WHAT)
    ] = Precision.fp32,
    backend: Annotated[
        str, typer.Option(help="Backends, comma list: onnxruntime, torch, tensorrt.", rich_help_panel=_HOW)
    ] = "onnxruntime",
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="Intra-op threads (default: the runtime's).", rich_help_panel=_HOW),
    ] = None,
    contexts: Annotated[
        str,
        typer.Option(
            help="Context lengths (tokens in the state) to decode at, comma list.", rich_help_panel=_HOW
        ),
    ] = "128,1024,4096,16384",
    repeats: Annotated[
        int,
        typer.Option(
            min=1,
            help="Runs of every configuration, each in a fresh process, round-robin.",
            rich_help_panel=_HOW,
        ),
    ] = 3,
    steps: Annotated[
        int,
        typer.Option(
            min=1,
            help="Timed single steps at each context (in blocks, interleaved across contexts).",
            rich_help_panel=_HOW,
        ),
    ] = 128,
    warmup: Annotated[
        int, typer.Option(min=0, help="Untimed steps after loading.", rich_help_panel=_HOW)
    ] = 16,
    prefill_tokens: Annotated[
        int,
        typer.Option(min=1, help="Tokens for the prefill throughput (prefill graph).", rich_help_panel=_HOW),
    ] = 1024,
    step_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens for the throughput through single steps.", rich_help_panel=_HOW)
    ] = 256,
    bandwidth_mib: Annotated[
        int, typer.Option(min=1, help="Array size of the read-bandwidth measurement.", rich_help_panel=_HOW)
    ] = 512,
    eval_text: Annotated[
        Path | None,
        typer.Option(
            "--eval",
            help="Text file: bits per byte of each artifact through the same runtime.",
            rich_help_panel=_HOW,
        ),
    ] = None,
    eval_bytes: Annotated[
        int, typer.Option(min=1, help="Bytes of --eval text to score.", rich_help_panel=_HOW)
    ] = 8192,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Directory for results.json, results.csv and PNG plots.", rich_help_panel=_OUT
        ),
    ] = None,
    compare: Annotated[
        Path | None,
        typer.Option(
            help="An earlier results.json: print the ratio of every figure to it.", rich_help_panel=_OUT
        ),
    ] = None,
    export_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keep the --mixers artifacts here (to copy to a device) instead of a temporary directory.",
            rich_help_panel=_OUT,
        ),
    ] = None,
) -> None:
    """Benchmark decode latency, resident memory and prefill speed, next to each family's analytic floor."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from edgeattn.bench import report
    from edgeattn.bench.runner import Settings, load_targets, parse_backends, parse_ints, run

    # everything a user can get wrong is refused before anything slow starts
    backends = parse_backends(backend)
    ctx = parse_ints(contexts, "--contexts")
    old = report.read_results(compare) if compare is not None else None
    if eval_text is not None and not eval_text.is_file():
        raise ValueError(f"--eval text file {eval_text} does not exist")
    if not artifacts and not mixers:
        raise ValueError("give artifact directories, or --mixers gla,retnet,softmax to export fresh ones")
    targets = load_targets(list(artifacts or []))
    if export_dir is not None and export_dir.exists() and any(export_dir.iterdir()):
        raise ValueError(f"--export-dir {export_dir} exists and is not empty")
    settings = Settings(
        backends=backends,
        contexts=ctx,
        repeats=repeats,
        steps=steps,
        warmup=warmup,
        threads=threads,
        prefill_tokens=prefill_tokens,
        step_tokens=step_tokens,
        eval_text=eval_text,
        eval_bytes=eval_bytes,
        bandwidth_mib=bandwidth_mib,
    )
    console = _console()
    with tempfile.TemporaryDirectory(prefix="edgeattn-bench-") as tmp:
        root = Path(tmp) if export_dir is None else export_dir
        missing: list[dict] = []
        if mixers:
            tgt = (
                target.value
                if target != Target.auto
                else ("portable" if "tensorrt" in backends else "onnxruntime")
            )
            again = f" --contexts {','.join(map(str, ctx))} --backend {','.join(backends)}"
            again += f" --repeats {repeats}" + (f" --threads {threads}" if threads else "")
            paths, missing = _fresh(
                mixers, size, ctx, steps, warmup, tgt, precision.value, root, console, again
            )
            targets += load_targets(paths)
        total = (
            1 + repeats * len(targets) * len(backends) + (len(targets) * len(backends) if eval_text else 0)
        )
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=_console(stderr=True), transient=True) as bar:
            task = bar.add_task("starting", total=total)
            started = [False]

            def tick(label: str) -> None:
                if started[0]:
                    bar.advance(task)
                started[0] = True
                bar.update(task, description=label)

            doc = run(
                targets,
                settings,
                missing=missing,
                progress=tick,
                command=["edgeattn", "bench", *sys.argv[1:]],
            )
            bar.advance(task)
        if mixers and export_dir is None:  # the artifacts go with the temporary directory: say what they were
            for r in doc["results"]:
                if r["artifact"].startswith(tmp):
                    r["artifact"] = f"(temporary) {r['mixer']}, size {size.value}"
    report.print_report(doc, console)
    if old is not None:
        doc["comparison"] = report.compare(doc, old, str(compare))
        report.print_comparison(doc["comparison"], console)
    if out is not None:
        files = report.write_outputs(doc, out)
        console.print(f"wrote {', '.join(str(f) for f in files)}")
        if doc.get("plots_skipped"):
            console.print(f"[yellow]plots skipped[/yellow]: {doc['plots_skipped']}")
    console.file.flush()
    typer.echo(json.dumps(report.headline(doc, out)))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
