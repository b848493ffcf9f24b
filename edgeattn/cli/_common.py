"""Shared CLI plumbing: one-line errors with exit code 2, never a traceback; checks of output paths."""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

try:  # Typer >= 0.26 vendors Click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older Typer on Click
    from click import exceptions as click_exceptions
_NO_ARGS_IS_HELP = getattr(click_exceptions, "NoArgsIsHelpError", ())  # Click >= 8.2

EXIT_BAD_INPUT = 2

# Sampling defaults of `edgeattn run` and `edgeattn sample`.
TEMPERATURE = 0.8
TOP_P = 0.95


class CLIError(Exception):
    """An error whose message is shown to the user as one line."""


def fail(message: str) -> typer.Exit:
    first = str(message).strip().splitlines()[0] if str(message).strip() else "failed"
    print(f"error: {first}", file=sys.stderr)
    return typer.Exit(EXIT_BAD_INPUT)


def _check_finite(kwargs: dict) -> None:
    """Every float option must be a number: click's ranges let nan (and inf) through."""
    for name, value in kwargs.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise CLIError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


# errno values of a full disk (ENOSPC) or a full quota (EDQUOT)
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def disk_full(e: BaseException) -> Exception | None:
    """The error in ``e``'s chain that says the disk (or quota) is full, or None: an OSError with ENOSPC or
    EDQUOT, or a library's error that carries only the message (torch's C++ writer raises a RuntimeError,
    safetensors a SafetensorError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return e
        if isinstance(e, Exception) and any(os.strerror(n) in str(e) for n in _DISK_FULL):
            return e
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def writing(out: Path, option: str):
    """A full disk while the body writes ``out`` (whole or not at all: the writer removes its temporary)
    becomes one line naming ``option``, not a traceback."""
    try:
        yield
    except Exception as e:
        full = disk_full(e)
        if full is None:
            raise
        why = full.strerror if isinstance(full, OSError) and full.strerror else os.strerror(errno.ENOSPC)
        raise CLIError(
            f"{option} {out}: {why.lower()}, nothing written: free some space or give {option} on another disk"
        ) from None


def cli_errors(fn):
    """Turn the errors users cause (bad paths, bad values, missing extras) into one line and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from edgeattn._deps import MissingDependency

        try:
            _check_finite(kwargs)
            return fn(*args, **kwargs)
        except (CLIError, ValueError, FileNotFoundError, NotADirectoryError, MissingDependency) as e:
            raise fail(str(e)) from None
        except ModuleNotFoundError as e:  # an optional dependency imported without edgeattn._deps.require
            from edgeattn._deps import missing_message

            message = missing_message(e.name or "")
            if message is None:
                raise
            raise fail(message) from None
        except Exception as e:  # a full disk in any command: one line, not a traceback
            full = disk_full(e)
            if full is None:
                raise
            where = f" writing {full.filename}" if isinstance(full, OSError) and full.filename else ""
            raise fail(f"no space left on device{where}: free some space or write elsewhere") from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper


# ---- output paths: refused before any work starts ----


def _writable_dir(d: Path, option: str, path: Path) -> None:
    if not os.access(d, os.W_OK | os.X_OK):
        raise CLIError(f"{option} {path}: directory {d} is not writable")


def check_output_file(path: Path, option: str) -> None:
    """A file that will be written (replaced if it exists): not a directory, in a writable directory."""
    if path.is_dir():
        raise CLIError(f"{option} {path} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise CLIError(f"{option} {path}: directory {parent} does not exist")
    _writable_dir(parent, option, path)


def check_output_dir(path: Path, option: str) -> None:
    """A directory that will be written (created with its parents if missing): not an existing file."""
    if path.exists() and not path.is_dir():
        raise CLIError(f"{option} {path} exists and is not a directory")
    nearest = path
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise CLIError(f"{option} {path}: {nearest} is not a directory")
    _writable_dir(nearest, option, path)


# ---- options shared by the commands that write a folder ----

Force = Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]


# ---- the command classes: one-line usage errors, flags without a type in --help ----


def _flags_without_type(params):
    # Typer's rich help prints a `<bool>` type after every flag (`--force <bool>`), which reads as if the
    # flag took a value; an empty metavar leaves the type column blank for flags only.
    for p in params:
        if getattr(p, "is_flag", False) and not p.metavar:
            p.metavar = ""
    return params


def _one_line(message: str) -> str:
    return " ".join(message.replace("Value error, ", "").split())


def _main_one_line_errors(main, self, args, prog_name, complete_var, standalone_mode, extra):
    if not standalone_mode:
        return main(self, args, prog_name, complete_var, standalone_mode=False, **extra)
    try:
        rv = main(self, args, prog_name, complete_var, standalone_mode=False, **extra)
    except _NO_ARGS_IS_HELP as e:
        if e.message:  # plain help mode returns the help text; rich mode has printed it already
            print(e.message)
        sys.exit(e.exit_code)
    except click_exceptions.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        print(f"error: {_one_line(e.format_message())}{hint}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except click_exceptions.ClickException as e:
        print(f"error: {_one_line(e.format_message())}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


class Command(TyperCommand):
    """Every edgeattn command: usage errors (a bad choice, an unknown option) are one `error:` line
    and exit 2 when the command runs on its own; flags show no type in --help."""

    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        return _main_one_line_errors(
            TyperCommand.main, self, args, prog_name, complete_var, standalone_mode, extra
        )


class Group(TyperGroup):
    """The `edgeattn` command: usage errors of it and of every subcommand are one `error:` line, exit 2."""

    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        return _main_one_line_errors(
            TyperGroup.main, self, args, prog_name, complete_var, standalone_mode, extra
        )
