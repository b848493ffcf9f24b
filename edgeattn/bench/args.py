"""The benchmark scripts' argument parser (``benchmarks/*.py``): a bad option is one line on stderr."""

from __future__ import annotations

import argparse
import os


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors (its own, and every ``ap.error`` of a script's checks) are one
    line, ``error: ...``, and exit status 2, without argparse's usage block (``--help`` shows that)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")

    def check_artifact(self, path: str | os.PathLike, option: str = "") -> None:
        """``error`` unless ``path`` is an exported artifact whose manifest reads and whose files match their
        hashes (what ``open_session`` checks first), so that a wrong folder is one line, not a traceback."""
        from edgeattn.artifact.manifest import Manifest

        try:
            Manifest.load(path)
        except (OSError, ValueError) as e:
            self.error(f"{option}{': ' if option else ''}{_first_line(e)}")

    def open_session(self, path: str | os.PathLike, option: str = "", **kwargs):
        """``edgeattn.runtimes.open_session(path, **kwargs)``, or ``error`` naming ``option`` (or the path)
        where it is not an artifact or a damaged one: one line, not a traceback."""
        from edgeattn.runtimes import open_session

        try:
            return open_session(path, **kwargs)
        except (OSError, ValueError) as e:
            self.error(f"{option or path}: {' '.join(_first_line(e).split())}")

    def check_source(self, path: str | os.PathLike, option: str, kinds: tuple[str, ...]) -> None:
        """``error`` unless ``path`` is a model source of one of ``kinds`` (``edgeattn.artifact.sources``:
        ``checkpoint``, ``huggingface``, ``artifact``, ``gguf``)."""
        from edgeattn.artifact.sources import directory_kind

        try:
            kind = directory_kind(path)
        except (OSError, ValueError) as e:
            self.error(f"{option}: {_first_line(e)}")
        if kind not in kinds:
            self.error(f"{option}: {path} is of kind '{kind}'; this needs: {', '.join(kinds)}")
