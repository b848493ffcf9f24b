"""`edgeattn check DIR`: compare an artifact with its PyTorch model, list its ops, check TensorRT compatibility."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgeattn._deps import require
from edgeattn.cli._common import Command, cli_errors


@cli_errors
def check(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory written by `edgeattn export`.")],
    tokens: Annotated[
        int, typer.Option(min=2, help="Tokens to compare (prefill chunks, then single steps).")
    ] = 300,
    tolerance: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="Max relative logit difference (default by precision).", show_default=False
        ),
    ] = None,
    text: Annotated[Path | None, typer.Option(help="Text file to feed (default: Python's os.py).")] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Intra-op threads (default: the runtime's).")
    ] = None,
) -> None:
    """Run the artifact and its PyTorch model side by side; exit 1 on a mismatch.

    Needs the train extra (PyTorch and onnx)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    for module in ("torch", "onnx"):  # on the base install: one line naming the extra, before any work
        require(module)
    from edgeattn.export.check import check_artifact

    if text is not None and not text.is_file():
        raise ValueError(f"text file {text} does not exist")
    report = check_artifact(
        artifact, tokens, tolerance, text.read_bytes() if text else None, threads, text_name=str(text)
    )
    console = Console()
    cpu = report.cpu
    table = Table(title=f"{artifact}: artifact vs PyTorch on {cpu['model']} ({cpu['kind']})")
    for col in ("graph", "tokens", "max |diff|", "relative", "ops"):
        table.add_column(col)
    for g, r in report.graphs.items():
        ops = ", ".join(f"{k}x{v}" for k, v in sorted(r["ops"].items()))
        table.add_row(g, str(r["tokens"]), f"{r['max_abs']:.3g}", f"{r['rel']:.3g}", ops)
    console.print(table)
    console.print(
        f"bits per byte on {escape(report.bpb_text)}: torch {report.bpb['torch']:.4f}, "
        f"artifact {report.bpb['artifact']:.4f} (difference {report.bpb['artifact'] - report.bpb['torch']:+.4f})",
        soft_wrap=True,
    )
    ppl = report.perplexity
    console.print(
        f"perplexity: torch {ppl['torch']:.4g}, artifact {ppl['artifact']:.4g} "
        f"({ppl['artifact'] / ppl['torch'] - 1:+.2%})",
        soft_wrap=True,
    )
    for note in report.notes:
        console.print(f"[yellow]note[/yellow]: {escape(note)}", soft_wrap=True)
    if report.tensorrt is not None:
        if report.tensorrt:
            console.print("TensorRT 10 compatibility: [red]problems[/red]")
            for p in report.tensorrt:
                console.print(f"  - {escape(p)}")
        else:
            console.print("TensorRT 10 compatibility: [green]every op and attribute is supported[/green]")
    if not report.ok:
        console.print(f"[red]MISMATCH[/red]: relative difference above {report.tolerance:g}")
        raise typer.Exit(1)
    console.print(f"[green]OK[/green]: within {report.tolerance:g}")


def register(app: typer.Typer) -> None:
    app.command("check", cls=Command)(check)
