"""`edgeattn web ARTIFACT --out SITE`: a static site that generates with the artifact inside the browser."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import Command, Force, check_output_dir, cli_errors, writing


@cli_errors
def web(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory written by `edgeattn export`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Site directory to write.")],
    node_modules: Annotated[
        Path | None,
        typer.Option(
            help="node_modules holding onnxruntime-web (default: $EDGEATTN_WEB_MODULES, else the repository's "
            "web/node_modules)."
        ),
    ] = None,
    force: Force = False,
) -> None:
    """Write a static site (index.html, a JavaScript module, the artifact, onnxruntime-web) that runs the
    model in the browser with a fixed-size state; serve it with any static server. WASM threads need the
    server to send Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy: require-corp;
    without them the page runs on one thread. URL query: ?prompt=TEXT&max_new_tokens=N&temperature=T&autostart=1."""
    from edgeattn.web import build_site

    check_output_dir(out, "--out")
    with writing(out, "--out"):
        site = build_site(artifact, out, node_modules=node_modules, force=force)
    typer.echo(f"wrote {site}/index.html; serve it, e.g.: python -m edgeattn.web.serve {site}")


def register(app: typer.Typer) -> None:
    app.command("web", cls=Command)(web)
