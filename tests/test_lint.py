"""ruff runs clean on the whole tree (issue 2): lint rules and formatting, as configured in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed (it comes with the `dev` extra)")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_is_clean(args):
    res = subprocess.run([*_ruff(), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_import_layers_hold():
    """The import-linter contracts of pyproject.toml (the layers of docs/architecture.md, no torch in the
    base install's packages) are kept."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (it comes with the `dev` extra)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's edgeattn, not an installed one
    res = subprocess.run([str(exe)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout
