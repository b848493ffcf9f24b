"""Shared CLI plumbing: one-line errors with exit code 2, never a traceback."""

from __future__ import annotations

import functools
import sys

import typer

EXIT_BAD_INPUT = 2


class CLIError(Exception):
    """An error whose message is shown to the user as one line."""


def fail(message: str) -> typer.Exit:
    first = str(message).strip().splitlines()[0] if str(message).strip() else "failed"
    print(f"error: {first}", file=sys.stderr)
    return typer.Exit(EXIT_BAD_INPUT)


def cli_errors(fn):
    """Turn the errors users cause (bad paths, bad values, missing extras) into one line and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from edgeattn._deps import MissingDependency

        try:
            return fn(*args, **kwargs)
        except (CLIError, ValueError, FileNotFoundError, NotADirectoryError, MissingDependency) as e:
            raise fail(str(e)) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper
