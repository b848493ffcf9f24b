"""The C++ Streams (edgeattn/runtimes/cpp, examples/cpp/streams.cpp): N streams stepped together at batch N.

Artifacts exported with ``dynamic_batch=True``. The references: the same prompts decoded each by its own C++
Session (``streams --separate``, same samplers and seeds), and for greedy streams the Python session's
``generate_ids`` (an independent driver of the same graphs). The C++ build is tests/artifact_fixture's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgeattn.runtimes import open_session
from tests.artifact_fixture import build_generate

PREFILL = 16
PROMPTS = [
    b"Once upon a time, in a land far away",  # 36 tokens: two prefill chunks + steps
    b"The fox",
    b"x",
    b"It was a dark and stormy night; the rain fell",
]
TEMPERATURES = "0,0.8,1.0,0"  # per stream, cycled; streams 0 and 3 greedy
# The batch-N step graph against N batch-1 calls: the same kernels with another row count, float32 sums that
# differ in the last bits (the export's check: <= 1.7e-6 per call), grown through the state over 40 tokens.
LOGITS_TOL = 1e-4
SPECS = {  # name -> (mixer, target)
    "gla-onnxruntime": ("gla", "onnxruntime"),
    "gated_deltanet-onnxruntime": ("gated_deltanet", "onnxruntime"),
    "mamba2-portable": ("mamba2", "portable"),
}


@pytest.fixture(scope="session")
def streams_bin() -> Path:
    return build_generate().parent / "streams"


@pytest.fixture(scope="module")
def dyn(tmp_path_factory):
    pytest.importorskip("torch", reason="exporting a checkpoint needs torch (the 'train' extra)")
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint

    root = tmp_path_factory.mktemp("cpp-streams")
    out = {}
    for name, (mixer, target) in SPECS.items():
        ckpt = make_checkpoint(root / f"ckpt-{mixer}", mixer)
        out[name] = export_model(ckpt, root / name, target=target, prefill_chunk=PREFILL, dynamic_batch=True)
    out["fixed"] = export_model(
        root / "ckpt-gla", root / "fixed", target="onnxruntime", prefill_chunk=PREFILL
    )
    return out


def run_streams(binary: Path, art: Path, *args, prompts=PROMPTS, check: bool = True):
    cmd = [str(binary), str(art), "--threads", "1"]
    for p in prompts:
        cmd += ["--prompt", p]
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr.decode()
        return json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return proc


def load_rows(prefix: Path, i: int) -> np.ndarray:
    return np.fromfile(f"{prefix}.{i}.f32", np.float32).reshape(-1, 256)


@pytest.mark.parametrize("name", list(SPECS))
def test_streams_equal_separate_sessions(streams_bin, dyn, tmp_path, name):
    art = dyn[name]
    common = ["-n", 40, "--temperature", TEMPERATURES, "--top-k", 50, "--seed", 7]
    together = run_streams(streams_bin, art, *common, "--dump-logits", tmp_path / "s")
    apart = run_streams(streams_bin, art, *common, "--separate", "--dump-logits", tmp_path / "p")
    assert together["steps"] == 40  # one graph call per token for all four streams
    assert apart["steps"] == 4 * 40
    for i in range(len(PROMPTS)):
        tokens = together["streams"][i]["tokens"]
        assert len(tokens) == 40
        assert tokens == apart["streams"][i]["tokens"], f"stream {i}"
        rows, ref = load_rows(tmp_path / "s", i), load_rows(tmp_path / "p", i)
        assert rows.shape == ref.shape == (40, 256)
        np.testing.assert_allclose(rows, ref, rtol=LOGITS_TOL, atol=LOGITS_TOL, err_msg=f"stream {i}")
    # the streams are not copies of each other, and sampling differs from greedy
    assert len({tuple(s["tokens"]) for s in together["streams"]}) == len(PROMPTS)
    assert together["state_bytes_per_stream"] > 0


@pytest.mark.parametrize("name", ["gla-onnxruntime", "mamba2-portable"])
def test_greedy_streams_equal_python_sessions(streams_bin, dyn, name):
    art = dyn[name]
    res = run_streams(streams_bin, art, "-n", 30, "--temperature", 0)
    for prompt, stream in zip(PROMPTS, res["streams"]):
        expected = list(open_session(art, threads=1).generate_ids(prompt, 30, temperature=0))
        assert stream["tokens"] == expected


def test_streams_join_and_drop(streams_bin, dyn):
    """Stream i joins before batch step 3 * i; stream 1 is dropped after step 5, having taken steps 3, 4, 5:
    every stream's tokens are still its own separate session's."""
    art = dyn["gla-onnxruntime"]
    common = ["-n", 20, "--temperature", TEMPERATURES, "--seed", 11]
    res = run_streams(streams_bin, art, *common, "--join-every", 3, "--drop", "1:5")
    ref = run_streams(streams_bin, art, *common, "--separate")
    assert [s["dropped"] for s in res["streams"]] == [False, True, False, False]
    assert res["streams"][1]["tokens"] == ref["streams"][1]["tokens"][:3]
    for i in (0, 2, 3):
        assert res["streams"][i]["tokens"] == ref["streams"][i]["tokens"]
    assert res["steps"] == 3 * 3 + 20  # the last stream joins before step 9 and takes 20 steps


def test_stream_states_equal_python_sessions(streams_bin, dyn, tmp_path):
    """Each stream's state file (its rows of the batch buffers, taken out when it stopped) equals the state of a
    Python session fed the same prompt and tokens, and resumes there."""
    from edgeattn.runtimes.state_file import load_state

    art = dyn["gla-onnxruntime"]
    res = run_streams(
        streams_bin, art, "-n", 12, "--temperature", TEMPERATURES, "--seed", 5, "--state-out", tmp_path / "st"
    )
    for i, (prompt, stream) in enumerate(zip(PROMPTS, res["streams"])):
        sess = open_session(art, threads=1)
        sess.prefill(np.frombuffer(prompt, np.uint8).astype(np.int64)[None])
        for token in stream["tokens"]:
            sess.step(np.array([[token]], np.int64))
        tensors, meta = load_state(tmp_path / f"st.{i}.state")
        assert int(meta["position"]) == sess.position == len(prompt) + 12
        state = sess.get_state()
        assert sorted(tensors) == sorted(state)
        for name, value in state.items():
            assert tensors[name].shape == value.shape  # batch 1
            np.testing.assert_allclose(tensors[name], value, rtol=LOGITS_TOL, atol=LOGITS_TOL, err_msg=name)
        resumed = open_session(art, threads=1)
        resumed.load_state(tmp_path / f"st.{i}.state")
        assert resumed.position == sess.position


def test_fixed_batch_artifact_is_refused(streams_bin, dyn):
    proc = run_streams(streams_bin, dyn["fixed"], "-n", 5, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streams: error: "), lines
    assert "--dynamic-batch" in lines[0]
    # the same artifact decodes stream by stream
    assert run_streams(streams_bin, dyn["fixed"], "-n", 5, "--separate")["steps"] == 4 * 5


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "0,1,2"], "--temperature has 3 values for 2 prompts"),
        (["--bogus"], "unknown option --bogus"),
        (["--bogus", "1"], "unknown option --bogus"),
        (["--state-out", "{missing}/st"], "does not exist"),
        (["--dump-logits", "{missing}/rows"], "does not exist"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(streams_bin, tmp_path, args, message):
    """Extra temperatures were once ignored silently, `--bogus` said "needs a value", and a missing --state-out
    directory failed only after decoding. The artifact is never opened: the arguments fail first."""
    args = [a.replace("{missing}", str(tmp_path / "missing")) for a in args]
    proc = run_streams(streams_bin, tmp_path, *args, prompts=[b"a", b"b"], check=False)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == b"", proc.stderr
    assert len(lines) == 1 and lines[0].startswith("streams: error: ") and message in lines[0], lines
