"""The `edgeattn` command: one module per command, composed here."""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

from edgeattn.cli._common import Group

app = typer.Typer(
    name="edgeattn",
    cls=Group,
    help="Linear-attention language models from training to edge devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from edgeattn import __version__

        typer.echo(f"edgeattn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Linear-attention language models from training to edge devices."""


# Each module defines `register(app)`; torch is imported inside the commands that need it only.
COMMANDS = (
    "train",
    "sample",
    "import",
    "linearize",
    "export",
    "run",
    "check",
    "bench",
    "analyze",
    "serve",
    "web",
)
_MODULES = {"import": "import_"}  # `import` is a Python keyword

for _name in COMMANDS:
    importlib.import_module(f"edgeattn.cli.{_MODULES.get(_name, _name)}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
