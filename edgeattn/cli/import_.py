"""`edgeattn import SRC --out CKPT`: a Hugging Face model directory or a GGUF file to an edgeattn checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import Command, Force, check_output_dir, cli_errors


@cli_errors
def import_(
    source: Annotated[
        Path,
        typer.Argument(
            help="Hugging Face model directory (config.json with a model_type) or a GGUF file (llama.cpp's)."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Checkpoint directory to write.")],
    force: Force = False,
) -> None:
    """Map an imported model's config and weights onto an edgeattn checkpoint (for export and check)."""
    from edgeattn.convert import import_model

    check_output_dir(out, "--out")
    cfg, notes = import_model(source, out, force=force)
    for note in notes:
        typer.echo(f"note: {note}")
    typer.echo(
        f"imported {source} -> {out} ({len(cfg.mixers)} layers: {', '.join(sorted(set(cfg.mixers)))}; "
        f"vocabulary {cfg.vocab_size})"
    )


def register(app: typer.Typer) -> None:
    app.command("import", cls=Command)(import_)
