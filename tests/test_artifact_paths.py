"""A name read from an artifact's manifest is never a path (issue 31, item 1): every reader of ``edgeattn.json``
(the shared loader ``Manifest.load``, the ONNX Runtime, torch and TensorRT sessions, ``Streams``, ``edgeattn
check``, ``edgeattn web`` and the C++ runtime) refuses a ``files`` key, graph path, weights, tokenizer or
checkpoint name that is absolute, holds ``..``, a backslash or a drive letter, or is a symbolic link out of
the artifact, with one line naming the entry. Each crafted artifact lists the outside file with its true
sha256, so a reader that only checks hashes would accept it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnx", reason="the synthetic artifact is built with onnx")

from edgeattn.artifact.manifest import Manifest  # noqa: E402
from tests.artifact_fixture import build_artifact, build_generate, run_generate  # noqa: E402


def _sha(path: Path) -> dict:
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _edit(root: Path, fn) -> None:
    path = root / "edgeattn.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def craft(case: str, root: Path) -> str:
    """Make the artifact ``root`` (deep inside its tmp dir, so that '..' stays in it) hostile in one way; the
    name the readers must refuse. The file a hostile name reaches is the artifact's own step graph, copied
    out, so that only the name is wrong."""
    outside = root.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copyfile(root / "step.onnx", outside / "step.onnx")
    if case == "dotdot files entry":
        name = "../outside/step.onnx"
        _edit(root, lambda d: d["files"].update({name: _sha(outside / "step.onnx")}))
    elif case == "absolute files entry":
        name = str(outside / "step.onnx")
        _edit(root, lambda d: d["files"].update({name: _sha(outside / "step.onnx")}))
    elif case == "dotdot graph path":
        name = "../outside/step.onnx"

        def fn(d):
            d["graphs"]["step"]["path"] = name
            d["files"][name] = _sha(outside / "step.onnx")

        _edit(root, fn)
    elif case in ("backslash", "drive letter"):  # plain file names on Linux, paths on Windows
        name = "sub\\step.onnx" if case == "backslash" else "C:step.onnx"
        shutil.copyfile(root / "step.onnx", root / name)
        _edit(root, lambda d: d["files"].update({name: _sha(root / name)}))
    elif case == "symlink out":
        name = "step.onnx"
        (root / name).unlink()
        os.symlink(outside / "step.onnx", root / name)
    elif case == "symlinked directory out":
        name = "sub/step.onnx"
        os.symlink(outside, root / "sub")
        _edit(root, lambda d: d["files"].update({name: _sha(outside / "step.onnx")}))
    else:
        raise AssertionError(case)
    return name


CASES = [
    "dotdot files entry",
    "absolute files entry",
    "dotdot graph path",
    "backslash",
    "drive letter",
    "symlink out",
    "symlinked directory out",
]


def assert_refused(message: str, name: str) -> None:
    assert "\n" not in message.strip(), message
    assert repr(name) in message or json.dumps(name) in message, message
    assert "leads outside the artifact" in message or "plain relative name" in message, message


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return build_artifact(tmp_path_factory.mktemp("synthetic") / "art")


@pytest.fixture
def hostile(synthetic, tmp_path, request):
    """(artifact dir, refused name) for the case ``request.param``."""
    root = tmp_path / "a" / "b" / "art"
    shutil.copytree(synthetic, root)
    return root, craft(request.param, root)


# ---- the shared loader and the Python readers built on it ----


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_manifest_load_refuses_the_name(hostile):
    root, name = hostile
    for verify in (True, False):
        with pytest.raises(ValueError) as info:
            Manifest.load(root, verify=verify)
        assert_refused(str(info.value), name)


@pytest.mark.parametrize(
    "field, value",
    [
        ("graphs.step.path", "../step.onnx"),
        ("graphs.prefill.path", "/etc/passwd"),
        ("weights.path", "../weights.bin"),
        ("genai.graph", "..\\model.onnx"),
        ("genai.config", "genai/../../genai_config.json"),
        ("checkpoint", "../checkpoint"),
        ("tokenizer.path", "D:/tokenizer.json"),
        ("tokenizer.chat_template", "./chat_template.jinja"),
        ("tokenizer.path", ""),
    ],
)
def test_every_name_field_is_checked_and_named(synthetic, tmp_path, field, value):
    root = tmp_path / "art"
    shutil.copytree(synthetic, root)
    section, key = field.rsplit(".", 1) if "." in field else (None, field)

    def fn(d):
        if section is None:
            d[key] = value
        elif section.startswith("graphs."):
            d["graphs"][section.split(".")[1]][key] = value
            d["files"][value] = d["files"]["step.onnx"]  # listed, so only its name is wrong
        else:
            kind = {"type": "huggingface"} if section == "tokenizer" else {}
            d[section] = {**(d.get(section) or {}), **kind, key: value}

    _edit(root, fn)
    with pytest.raises(ValueError) as info:
        Manifest.load(root, verify=False)
    assert f"'{field}' {value!r}" in str(info.value), str(info.value)
    assert_refused(str(info.value), value)


def _linked_copy(synthetic, tmp_path):
    """A copy of ``synthetic`` whose prefill.onnx is a link to graphs/prefill.onnx inside it, reached
    through a link to the copy: links that stay in the artifact."""
    real = tmp_path / "real"
    shutil.copytree(synthetic, real)
    (real / "graphs").mkdir()
    os.replace(real / "prefill.onnx", real / "graphs" / "prefill.onnx")
    os.symlink("graphs/prefill.onnx", real / "prefill.onnx")
    os.symlink(real, tmp_path / "link")
    return tmp_path / "link"


def test_links_inside_the_artifact_are_fine(synthetic, tmp_path):
    """A symbolic link that stays in the artifact (and an artifact reached through a link) loads."""
    assert Manifest.load(_linked_copy(synthetic, tmp_path)).graph_path("prefill").is_file()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "tensorrt"])
@pytest.mark.parametrize("hostile", ["dotdot files entry", "symlink out"], indirect=True)
def test_sessions_refuse_the_name(hostile, backend):
    from edgeattn.runtimes import open_session

    root, name = hostile
    with pytest.raises(ValueError) as info:
        open_session(root, backend=backend, threads=1)
    assert_refused(str(info.value), name)


@pytest.mark.parametrize("hostile", ["dotdot files entry", "absolute files entry"], indirect=True)
def test_streams_refuse_the_name(hostile):
    from edgeattn.runtimes.streams import SerialStreams, Streams, open_streams

    root, name = hostile
    for make in (Streams, SerialStreams, open_streams):
        with pytest.raises(ValueError) as info:
            make(root, threads=1)
        assert_refused(str(info.value), name)


# ---- the CLI: check and web, on a real export ----


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from edgeattn.export import export_model
    from tests.export_helpers import PREFILL, make_checkpoint

    root = tmp_path_factory.mktemp("exported")
    return export_model(
        make_checkpoint(root / "ckpt", "gla"), root / "art", target="portable", prefill_chunk=PREFILL
    )


def _cli(*args):
    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_check_refuses_the_name(exported, tmp_path):
    root = tmp_path / "a" / "b" / "art"
    shutil.copytree(exported, root)
    name = craft("dotdot files entry", root)
    res = _cli("check", root, "--tokens", 8)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1, res.output
    assert_refused(res.output, name)


@pytest.mark.parametrize("absolute", [False, True])
def test_web_writes_nothing_outside_its_site(exported, tmp_path, absolute):
    """The attack of the issue: a ``files`` key that climbs out of the site's model/ directory names a file
    of the user's (``victim``); the crafter's copy sits where the same name climbs out of the artifact. Refused
    in one line, the victim untouched, no site written."""
    root = tmp_path / "downloads" / "x" / "art"
    shutil.copytree(exported, root)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    out = tmp_path / "site"
    # from out/model (and from the temporary beside out) '../../victim.txt' is tmp_path/victim.txt; from
    # the artifact it is downloads/victim.txt, which the crafter placed
    crafted = root.parent.parent / "victim.txt"
    crafted.write_text("crafted")
    name = str(crafted) if absolute else "../../victim.txt"
    _edit(root, lambda d: d["files"].update({name: _sha(crafted)}))
    res = _cli("web", root, "--out", out)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1, res.output
    assert_refused(res.output, name)
    assert victim.read_text() == "the user's own file"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["downloads", "victim.txt"]


# ---- the C++ runtime ----


@pytest.fixture(scope="module")
def generate() -> Path:
    return build_generate()


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_cpp_refuses_the_name(generate, hostile):
    root, name = hostile
    res = run_generate(generate, root, b"abc", "-n", 3, check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("generate: error: "), res.stderr
    assert f'"{name}"' in lines[0], lines[0]
    assert "leads outside the artifact" in lines[0] or "plain relative name" in lines[0], lines[0]


def test_cpp_reads_links_inside_the_artifact(generate, synthetic, tmp_path):
    run_generate(generate, _linked_copy(synthetic, tmp_path), b"abcdefgh", "-n", 3)
