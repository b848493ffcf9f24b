"""The C++ runtime (edgeattn/runtimes/cpp) and its example examples/cpp/generate.cpp on a synthetic artifact.

Set-up, once per session: scripts/fetch_onnxruntime_headers.sh (a no-op once .third_party/ has the headers),
CMake configure and build in build/cpp-tests (incremental). Skipped only without cmake or a C++ compiler.
The reference is tests/artifact_fixture.OrtDriver: onnxruntime's Python API driven by the manifest alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgeattn.runtimes.state_file import load_state, save_state
from tests.artifact_fixture import (
    OrtDriver,
    Result,
    build_artifact,
    build_generate,
    make_weights,
    reference_step,
    run_generate,
    zero_state,
)

PROMPT = b"The quick brown fox"  # 19 tokens: 4 prefill chunks of 4, then 3 steps


# ----------------------------------------------------------------------------------------------------------
# set-up
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def generate() -> Path:
    """The built example binary (built once per session, shared with tests/test_cpp_real.py)."""
    return build_generate()


@pytest.fixture(scope="session")
def artifact(tmp_path_factory) -> Path:
    pytest.importorskip("onnx", reason="the synthetic artifact is built with onnx (the 'train' extra)")
    return build_artifact(tmp_path_factory.mktemp("artifact"))


def run(binary: Path, artifact_dir, prompt: bytes = PROMPT, *args, check: bool = True) -> Result:
    return run_generate(binary, artifact_dir, prompt, *args, check=check)


# ----------------------------------------------------------------------------------------------------------
# the fixture itself
# ----------------------------------------------------------------------------------------------------------


def test_fixture_graphs_match_numpy_reference(artifact):
    """step.onnx and prefill.onnx compute the numpy reference step, so the C++ checks check real math."""
    w = make_weights(0)
    drv = OrtDriver(artifact)
    state = zero_state()
    ids = list(PROMPT)
    for t in ids[:-1]:
        _, state = reference_step(w, t, state)
    ref_logits, state = reference_step(w, ids[-1], state)
    got = drv.prefill(ids)  # 4 prefill chunks + 3 steps
    np.testing.assert_allclose(got, ref_logits, rtol=1e-4, atol=1e-4)
    for name, ref in state.items():
        np.testing.assert_allclose(drv.state[name], ref, rtol=1e-4, atol=1e-5)
    assert drv.position == len(ids)


# ----------------------------------------------------------------------------------------------------------
# the C++ runtime against the Python driver
# ----------------------------------------------------------------------------------------------------------


def test_greedy_matches_python(generate, artifact, tmp_path):
    logits_file = tmp_path / "logits.npy"
    res = run(generate, artifact, PROMPT, "-n", 200, "--dump-logits", logits_file)
    tokens, rows = OrtDriver(artifact).greedy(list(PROMPT), 200)
    assert res.tokens == tokens
    assert len(set(tokens)) > 10  # the synthetic model does not just repeat itself
    np.testing.assert_allclose(np.load(logits_file), rows, rtol=1e-5, atol=1e-5)
    assert res.report["tokens"] == 200 and res.report["position"] == len(PROMPT) + 200


def test_sampling(generate, artifact):
    greedy = run(generate, artifact, PROMPT, "-n", 50).tokens
    # top-k 1 and a tiny top-p keep only the most likely token: greedy again, at any temperature
    assert (
        run(generate, artifact, PROMPT, "-n", 50, "--temperature", 1.5, "--top-k", 1, "--seed", 3).tokens
        == greedy
    )
    assert (
        run(generate, artifact, PROMPT, "-n", 50, "--temperature", 1.5, "--top-p", 1e-6, "--seed", 3).tokens
        == greedy
    )
    a = run(generate, artifact, PROMPT, "-n", 50, "--temperature", 1.0, "--seed", 1).tokens
    b = run(generate, artifact, PROMPT, "-n", 50, "--temperature", 1.0, "--seed", 1).tokens
    c = run(generate, artifact, PROMPT, "-n", 50, "--temperature", 1.0, "--seed", 2).tokens
    d = run(
        generate, artifact, PROMPT, "-n", 50, "--temperature", 0.8, "--top-k", 20, "--top-p", 0.9, "--seed", 1
    )
    assert a == b and a != c and a != greedy
    assert len(d.tokens) == 50


def test_python_state_resumes_in_cpp(generate, artifact, tmp_path):
    drv = OrtDriver(artifact)
    drv.greedy(list(b"Once upon a time"), 37)  # 16 prompt tokens + 37 generated, all consumed
    state_file = tmp_path / "py.state"
    drv.save_state(state_file)
    tokens, rows = drv.greedy(list(b" and then"), 60)

    logits_file = tmp_path / "logits.npy"
    res = run(
        generate, artifact, b" and then", "-n", 60, "--state-in", state_file, "--dump-logits", logits_file
    )
    assert res.tokens == tokens
    np.testing.assert_allclose(np.load(logits_file), rows, rtol=1e-5, atol=1e-5)
    assert res.report["position"] == 16 + 37 + 9 + 60


def test_cpp_state_loads_in_python(generate, artifact, tmp_path):
    state_file = tmp_path / "cpp.state"
    res = run(generate, artifact, PROMPT, "-n", 30, "--state-out", state_file)
    tensors, meta = load_state(state_file)
    assert meta["fingerprint"] == json.loads((artifact / "edgeattn.json").read_text())["fingerprint"]
    assert int(meta["position"]) == len(PROMPT) + 30

    drv = OrtDriver(artifact)  # the same tokens through the driver give the same state
    drv.prefill(list(PROMPT))
    for t in res.tokens:
        drv.step(t)
    for name, t in drv.state.items():
        np.testing.assert_allclose(tensors[name], t, rtol=1e-6, atol=1e-6)

    resumed = OrtDriver(artifact)
    resumed.load_state(state_file)
    assert resumed.position == len(PROMPT) + 30
    expected, _ = drv.greedy(list(b"!"), 20)  # continuing the driver that ran the same tokens
    assert resumed.greedy(list(b"!"), 20)[0] == expected
    assert run(generate, artifact, b"!", "-n", 20, "--state-in", state_file).tokens == expected


def test_memory_is_constant_per_token(generate, artifact):
    short = run(generate, artifact, PROMPT, "-n", 200).report
    long = run(generate, artifact, PROMPT, "-n", 2000).report
    assert long["peak_bytes_at_last"] is not None, (
        "built without ONNX Runtime memory statistics (headers < 1.23)"
    )
    assert long["peak_bytes_at_last"] > 0
    assert long["peak_bytes_at_last"] == long["peak_bytes_at_128"] == short["peak_bytes_at_last"]


# ----------------------------------------------------------------------------------------------------------
# bad inputs: a non-zero exit and a one-line message
# ----------------------------------------------------------------------------------------------------------


def _edit_manifest(root: Path, **changes) -> None:
    path = root / "edgeattn.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _bad_case(name: str, root: Path, artifact: Path):
    """(artifact dir, extra args, prompt, expected message) for one kind of bad input."""
    if name == "missing manifest":
        root.mkdir()
        return root, [], PROMPT, "no manifest"
    if name == "not an artifact directory":
        return root / "nowhere", [], PROMPT, "no manifest"
    if name == "future format version":
        build_artifact(root, format_version=2)
        return root, [], PROMPT, "format_version 2"
    if name == "sha256 mismatch":
        shutil.copytree(artifact, root)
        with open(root / "step.onnx", "ab") as f:
            f.write(b"\0")
        return root, [], PROMPT, "does not match its sha256"
    if name == "missing graph file":
        shutil.copytree(artifact, root)
        (root / "prefill.onnx").unlink()
        return root, [], PROMPT, "prefill.onnx is missing"
    if name == "invalid manifest json":
        shutil.copytree(artifact, root)
        (root / "edgeattn.json").write_text("{ not json")
        return root, [], PROMPT, "not valid JSON"
    if name == "dynamic state (KV cache)":
        shutil.copytree(artifact, root)
        state = json.loads((root / "edgeattn.json").read_text())["state"]
        state[1]["shape"] = [1, 2, "past_length", 4]
        _edit_manifest(root, state=state)
        return root, [], PROMPT, "dynamic dimension"
    if name == "state of another model":
        state = root.with_suffix(".state")
        drv = OrtDriver(artifact)
        save_state(state, drv.state, "0" * 64, 0)
        return artifact, ["--state-in", state], PROMPT, "another model"
    if name == "state with other tensors":
        state = root.with_suffix(".state")
        drv = OrtDriver(artifact)
        tensors = dict(drv.state)
        tensors["past_key_values.1.recurrent_state"] = np.zeros((1, 2, 4, 5), np.float32)
        save_state(state, tensors, drv.fingerprint, 0)
        return artifact, ["--state-in", state], PROMPT, "has shape [1, 2, 4, 5]"
    if name == "corrupt state file":
        state = root.with_suffix(".state")
        state.write_bytes(b"\x10\0\0\0\0\0\0\0garbage!garbage!")
        return artifact, ["--state-in", state], PROMPT, "not an edgeattn state file"
    if name == "token out of range":
        build_artifact(root, vocab_size=128)
        return root, [], "café".encode(), "token 195 is out of range"
    raise AssertionError(name)


BAD_CASES = [
    "missing manifest",
    "not an artifact directory",
    "future format version",
    "sha256 mismatch",
    "missing graph file",
    "invalid manifest json",
    "dynamic state (KV cache)",
    "state of another model",
    "state with other tensors",
    "corrupt state file",
    "token out of range",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_with_one_line(generate, artifact, tmp_path, case):
    root, args, prompt, message = _bad_case(case, tmp_path / "bad", artifact)
    res = run(generate, root, prompt, "-n", 5, *args, check=False)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("generate: error: ") and message in lines[0], lines[0]


def test_bad_arguments(generate, artifact):
    for args in (["-n", "x"], ["--bogus", "1"], ["--top-p", "0"]):
        res = run(generate, artifact, PROMPT, *args, check=False)
        assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("args", [["--bogus"], ["--bogus", "1"], ["--bogus=1"], ["--no-such-flag"]])
def test_unknown_option_is_named(generate, artifact, args):
    """An unknown option is called unknown, also without a value after it (it once said "--bogus needs a value")."""
    res = run(generate, artifact, PROMPT, *args, check=False)
    assert res.returncode == 2 and res.proc.stdout == b""
    lines = res.stderr.strip().splitlines()
    name = args[0].split("=")[0]
    assert len(lines) == 1 and lines[0].startswith(f"generate: error: unknown option {name}"), res.stderr


@pytest.mark.parametrize("option", ["--state-out", "--dump-logits"])
def test_output_into_a_missing_directory_is_refused_before_generating(generate, artifact, tmp_path, option):
    res = run(generate, artifact, PROMPT, "-n", 50, option, tmp_path / "missing" / "out", check=False)
    assert res.returncode == 2 and res.proc.stdout == b""  # refused before a token was generated
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"generate: error: {option} "), res.stderr
    assert "does not exist" in lines[0]
    res = run(generate, artifact, PROMPT, "-n", 5, option, tmp_path, check=False)  # a directory
    assert res.returncode == 2 and "is a directory" in res.stderr and res.proc.stdout == b""


@pytest.mark.parametrize("victim", ["step.onnx", "edgeattn.json", "state-in"])
def test_a_fifo_in_place_of_a_file_is_refused_without_hanging(generate, artifact, tmp_path, victim):
    """A FIFO never ends (or never opens) when read: refused as Python refuses it, not read."""
    import os
    import subprocess

    root = tmp_path / "art"
    shutil.copytree(artifact, root)
    args = []
    if victim == "state-in":
        fifo = tmp_path / "fifo.state"
        args = ["--state-in", str(fifo)]
    else:
        fifo = root / victim
        fifo.unlink()
    os.mkfifo(fifo)
    cmd = [str(generate), str(root), "--prompt", "ab", "-n", "3", "--threads", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, timeout=60)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("generate: error: ") and "is not a regular file" in lines[0], lines[0]


def test_non_finite_logits_are_refused(generate, tmp_path):
    """A model whose logits turn NaN (token '!' has a NaN embedding) stops with one line; it never prints the
    argmax of NaN. Before the NaN, it generates as usual."""
    art = build_artifact(tmp_path / "nan", nan_token=ord("!"))
    assert run(generate, art, b"Hello", "-n", 5).tokens is not None
    for args in ([], ["--temperature", "0.8", "--seed", "1"]):
        res = run(generate, art, b"Hello!", "-n", 5, *args, check=False)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert lines[0].startswith("generate: error: the model's logits are not finite"), lines[0]
        assert res.proc.stdout == b"Hello!\n"  # the prompt, and no token after it


# ----------------------------------------------------------------------------------------------------------
# state files that lie, and manifests that do not match their graphs: C++ refuses what Python refuses
# ----------------------------------------------------------------------------------------------------------


def _state_data_start(raw: bytes) -> int:
    return 8 + int.from_bytes(raw[:8], "little")


def test_cpp_refuses_flipped_bytes_nan_and_old_state_files(generate, artifact, tmp_path):
    import hashlib
    import struct

    from tests.test_state_file import _header_file

    drv = OrtDriver(artifact)
    drv.greedy(list(PROMPT), 5)
    good = tmp_path / "good.state"
    drv.save_state(good)
    raw = good.read_bytes()
    start = _state_data_start(raw)
    cases = {}
    for i, offset in enumerate((start, start + 5, (start + len(raw)) // 2, len(raw) - 1)):
        bad = bytearray(raw)
        bad[offset] ^= 0x10
        cases[f"flip{i}"] = (bytes(bad), "does not match the data_sha256")
    # NaN with a correct checksum, as another writer could produce
    header = json.loads(raw[8:start])
    data = bytearray(raw[start:])
    data[0:4] = struct.pack("<f", float("nan"))
    header["__metadata__"]["data_sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    _header_file(tmp_path / "nan.state", header, bytes(data))
    cases["nan"] = ((tmp_path / "nan.state").read_bytes(), "holds NaN or inf")
    header["__metadata__"]["format_version"] = "1"  # the old format: no checksum
    del header["__metadata__"]["data_sha256"]
    _header_file(tmp_path / "v1.state", header, raw[start:])
    cases["v1"] = ((tmp_path / "v1.state").read_bytes(), "before state files carried a checksum")

    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.state"
        path.write_bytes(content)
        res = run(generate, artifact, b"!", "-n", 3, "--state-in", path, check=False)
        lines = res.stderr.strip().splitlines()
        assert res.returncode != 0 and len(lines) == 1, (name, res.stderr)
        assert lines[0].startswith("generate: error: ") and message in lines[0], (name, lines[0])
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):  # Python agrees
            load_state(path)
    run(generate, artifact, b"!", "-n", 3, "--state-in", good)  # the untouched file still loads


def test_cpp_state_file_format(generate, artifact, tmp_path):
    """C++ writes format_version 2 with the sha256 of the tensor bytes, as Python does, byte for byte."""
    import hashlib

    cpp = tmp_path / "cpp.state"
    run(generate, artifact, PROMPT, "-n", 10, "--state-out", cpp)
    raw = cpp.read_bytes()
    meta = json.loads(raw[8 : _state_data_start(raw)])["__metadata__"]
    assert meta["format_version"] == "2"
    assert meta["data_sha256"] == hashlib.sha256(raw[_state_data_start(raw) :]).hexdigest()
    tensors, meta_py = load_state(cpp)
    py = tmp_path / "py.state"
    save_state(py, tensors, meta_py["fingerprint"], int(meta_py["position"]))
    assert py.read_bytes()[_state_data_start(py.read_bytes()) :] == raw[_state_data_start(raw) :]
    assert load_state(py)[1]["data_sha256"] == meta["data_sha256"]


@pytest.mark.parametrize(
    "case",
    [
        "state shape",
        "vocab_size",
        "prefill tokens",
        "input_ids name",
        "state input name",
        "state without shape",
        "file without sha256",
        "graph not listed",
        "state dtype",
    ],
)
def test_cpp_and_python_refuse_the_same_manifest_edits(generate, artifact, tmp_path, case):
    from edgeattn.runtimes import open_session
    from tests.test_manifest import EDITS, edit

    root = tmp_path / "art"
    shutil.copytree(artifact, root)
    edit(root, EDITS[case][0])
    res = run(generate, root, PROMPT, "-n", 3, check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("generate: error: "), res.stderr
    with pytest.raises(ValueError, match=None):
        open_session(root, threads=1)
