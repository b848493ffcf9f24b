"""The benchmark scripts' argument parser (``benchmarks/*.py``): a bad option is one line on stderr."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors (its own, and every ``ap.error`` of a script's checks) are one
    line, ``error: ...``, and exit status 2, without argparse's usage block (``--help`` shows that)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")
