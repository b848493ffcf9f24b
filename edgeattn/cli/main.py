"""The `edgeattn` command: one module per command, composed here."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="edgeattn",
    help="Linear-attention language models from training to edge devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module defines `register(app)`; torch is imported inside the commands that need it only.
COMMANDS = ("train", "sample", "import", "export", "run", "check", "bench")
_MODULES = {"import": "import_"}  # `import` is a Python keyword

for _name in COMMANDS:
    importlib.import_module(f"edgeattn.cli.{_MODULES.get(_name, _name)}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
