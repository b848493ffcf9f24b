"""pyproject.toml as setuptools reads it: metadata without deprecation warnings (pip printed three)."""

import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_license_is_an_spdx_expression_without_warnings(monkeypatch):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("setuptools < 77 reads no PEP 639 license expression")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(REPO)  # the readme and packages are found relative to the project
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    messages = [str(w.message).splitlines()[0] for w in caught]
    assert not [m for m in messages if "license" in m.lower() or "deprecat" in m.lower()], messages
    assert dist.metadata.license_expression == "Apache-2.0"
