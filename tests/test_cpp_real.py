"""The C++ example (examples/cpp/generate.cpp over edgeattn/runtimes/cpp) on artifacts of the real exporter.

Tiny checkpoints (tests/export_helpers.make_checkpoint) exported with ``prefill_chunk=16``:

    gla-onnxruntime     GLA, target onnxruntime: the fused com.microsoft.LinearAttention op
    gla-portable        the same checkpoint, target portable: standard ONNX ops only
    linear-onnxruntime  normalized linear attention: two state tensors per layer (recurrent_state, normalizer)
    gla-other           another GLA checkpoint (seed 1): same state names and shapes, another fingerprint
    gated_deltanet-onnxruntime  Gated DeltaNet: LinearAttention gated_delta + CausalConvWithState, conv_state
    mamba2-portable     Mamba2, standard ONNX ops: conv_state + recurrent_state per layer
    softmax-onnxruntime the softmax baseline: GroupQueryAttention over a preallocated KV buffer of max_length
                        tokens, one buffer bound as past and present (manifest "shared": true)
    gla_softmax-onnxruntime  one GLA layer and one softmax layer: recurrent state beside a shared KV buffer

The reference is the Python ONNX Runtime session, ``open_session(artifact, threads=1)``: the same ONNX Runtime
library running the same graphs with the same thread count, so tokens must be equal and logits equal to 1e-5.
Prompts are longer than the prefill chunk, so both graphs run. The C++ build is tests/artifact_fixture's, made
once per session and shared with tests/test_cpp.py; skipped only without cmake or a C++ compiler.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgeattn.runtimes import open_session
from edgeattn.runtimes.state_file import load_state
from tests.artifact_fixture import build_generate, greedy_logits, run_generate

PREFILL = 16
PROMPT = b"Once upon a time, in a land far away, a"  # 40 tokens: 2 prefill chunks + 8 steps
PROMPT2 = b" and then, one fine morning, the fox"  # 36 tokens, fed after a loaded state
# The Python session runs unpacked shared weights, the C++ one prepacks its own: different MLAS kernels, whose
# float32 sums differ in the last bits; over 60 tokens of state the fused projections of
# edgeattn.export.optimize reached 1.1e-5 on logits of magnitude 3.
TOL = 3e-5
LOGITS_TOL = 1e-4  # logits after 60 tokens: the same kernels' differences, grown through the state
ARTIFACTS = [
    "gla-onnxruntime",
    "gla-portable",
    "linear-onnxruntime",
    "gated_deltanet-onnxruntime",
    "mamba2-portable",
]

# name -> (mixer, checkpoint seed, target)
SPECS = {
    "gla-onnxruntime": ("gla", 0, "onnxruntime"),
    "gla-portable": ("gla", 0, "portable"),
    "linear-onnxruntime": ("linear", 0, "onnxruntime"),
    "gla-other": ("gla", 1, "onnxruntime"),
    "gated_deltanet-onnxruntime": ("gated_deltanet", 0, "onnxruntime"),
    "mamba2-portable": ("mamba2", 0, "portable"),
    "softmax-onnxruntime": ("softmax", 0, "onnxruntime"),
    "gla_softmax-onnxruntime": ("gla,softmax", 0, "onnxruntime"),
}
# Artifacts with a preallocated KV buffer (max_length 512, tests/export_helpers.tiny_config): the tests of
# ARTIFACTS run on them too, but for test_memory_is_constant_per_token, whose 2000 tokens exceed max_length.
KV_ARTIFACTS = ["softmax-onnxruntime", "gla_softmax-onnxruntime"]


class _Artifacts(dict):
    """Artifacts exported on first use, once per session (checkpoints shared between targets)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root
        self.ckpts: dict[tuple[str, int], Path] = {}

    def __missing__(self, name: str) -> Path:
        from edgeattn.export import export_model
        from tests.export_helpers import make_checkpoint

        mixer, seed, target = SPECS[name]
        if (mixer, seed) not in self.ckpts:
            self.ckpts[mixer, seed] = make_checkpoint(self.root / f"ckpt-{mixer}-{seed}", mixer, seed=seed)
        self[name] = export_model(
            self.ckpts[mixer, seed], self.root / name, target=target, prefill_chunk=PREFILL
        )
        return self[name]


@pytest.fixture(scope="session")
def generate() -> Path:
    return build_generate()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> _Artifacts:
    pytest.importorskip("torch", reason="exporting a checkpoint needs torch (the 'train' extra)")
    pytest.importorskip("onnx", reason="exporting a checkpoint needs onnx (the 'train' extra)")
    return _Artifacts(tmp_path_factory.mktemp("real-artifacts"))


@pytest.fixture(params=ARTIFACTS + KV_ARTIFACTS)
def art(request, artifacts) -> Path:
    return artifacts[request.param]


@pytest.fixture(params=ARTIFACTS)
def recurrent_art(request, artifacts) -> Path:
    return artifacts[request.param]


@pytest.fixture(params=KV_ARTIFACTS)
def kv_art(request, artifacts) -> Path:
    return artifacts[request.param]


def session(art: Path):
    return open_session(art, threads=1)


def py_greedy(sess, prompt: bytes, n: int) -> tuple[list[int], np.ndarray]:
    """``greedy_logits`` of a byte prompt."""
    return greedy_logits(sess, np.frombuffer(prompt, np.uint8), n)


def assert_logits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=LOGITS_TOL, atol=LOGITS_TOL)


# ----------------------------------------------------------------------------------------------------------
# the artifacts are what the tests claim
# ----------------------------------------------------------------------------------------------------------


def test_artifacts_are_the_intended_graphs(artifacts):
    import onnx

    def domains(name: str) -> set[tuple[str, str]]:
        nodes = onnx.load(str(artifacts[name] / "step.onnx")).graph.node
        return {(n.domain, n.op_type) for n in nodes if n.domain not in ("", "ai.onnx")}

    assert ("com.microsoft", "LinearAttention") in domains("gla-onnxruntime")
    assert ("com.microsoft", "LinearAttention") in domains("linear-onnxruntime")
    assert domains("gla-portable") == set()
    assert domains("gated_deltanet-onnxruntime") == {
        ("com.microsoft", "LinearAttention"),
        ("com.microsoft", "CausalConvWithState"),
        ("com.microsoft", "LinearAttentionGate"),  # decay and beta
        ("com.microsoft", "SkipSimplifiedLayerNormalization"),  # edgeattn.export.optimize's residual + norm
    }
    assert domains("mamba2-portable") == set()
    for name in ARTIFACTS:
        m = json.loads((artifacts[name] / "edgeattn.json").read_text())
        assert m["graphs"]["prefill"]["tokens"] == PREFILL < len(PROMPT)
    names = [
        e["name"]
        for e in json.loads((artifacts["linear-onnxruntime"] / "edgeattn.json").read_text())["state"]
    ]
    assert names == ["recurrent_state", "normalizer"] * 2
    for name in ("gated_deltanet-onnxruntime", "mamba2-portable"):
        state = json.loads((artifacts[name] / "edgeattn.json").read_text())["state"]
        assert [e["name"] for e in state] == ["conv_state", "recurrent_state"] * 2


# ----------------------------------------------------------------------------------------------------------
# C++ against the Python session
# ----------------------------------------------------------------------------------------------------------


def test_greedy_matches_python(generate, art, tmp_path):
    logits_file = tmp_path / "logits.npy"
    res = run_generate(generate, art, PROMPT, "-n", 200, "--dump-logits", logits_file)
    expected = list(session(art).generate_ids(PROMPT, 200, temperature=0))
    assert res.tokens == expected
    tokens, rows = py_greedy(session(art), PROMPT, 200)
    assert tokens == expected
    assert_logits_equal(np.load(logits_file), rows)
    assert np.ptp(rows, axis=0).max() > 0.1  # the logits move from token to token
    assert res.report["prompt_tokens"] == len(PROMPT) and res.report["position"] == len(PROMPT) + 200


def test_python_state_resumes_in_cpp(generate, art, tmp_path):
    sess = session(art)
    list(sess.generate_ids(b"It was a dark and stormy night", 37, temperature=0))  # 30 + 37 tokens consumed
    state_file = tmp_path / "py.state"
    sess.save_state(state_file)
    tokens, rows = py_greedy(sess, PROMPT2, 60)

    logits_file = tmp_path / "logits.npy"
    res = run_generate(
        generate, art, PROMPT2, "-n", 60, "--state-in", state_file, "--dump-logits", logits_file
    )
    assert res.tokens == tokens
    assert_logits_equal(np.load(logits_file), rows)
    assert res.report["position"] == 30 + 37 + len(PROMPT2) + 60


def test_cpp_state_loads_in_python(generate, art, tmp_path):
    state_file = tmp_path / "cpp.state"
    res = run_generate(generate, art, PROMPT, "-n", 50, "--state-out", state_file)

    ref = session(art)  # the same tokens through Python give the same state
    assert py_greedy(ref, PROMPT, 50)[0] == res.tokens
    tensors, meta = load_state(state_file)
    assert meta["fingerprint"] == ref.manifest.fingerprint
    assert int(meta["position"]) == ref.position == len(PROMPT) + 50
    state = ref.get_state()
    assert sorted(tensors) == sorted(state)
    for name, value in state.items():
        np.testing.assert_allclose(tensors[name], value, rtol=TOL, atol=TOL, err_msg=name)

    resumed = session(art)
    resumed.load_state(state_file)
    assert resumed.position == len(PROMPT) + 50
    tokens, rows = py_greedy(resumed, PROMPT2, 60)
    expected_tokens, expected_rows = py_greedy(ref, PROMPT2, 60)  # Python, never through a file
    assert tokens == expected_tokens
    assert_logits_equal(rows, expected_rows)

    logits_file = tmp_path / "logits.npy"
    again = run_generate(
        generate, art, PROMPT2, "-n", 60, "--state-in", state_file, "--dump-logits", logits_file
    )
    assert again.tokens == tokens
    assert_logits_equal(np.load(logits_file), rows)


def test_memory_is_constant_per_token(generate, recurrent_art):
    short = run_generate(generate, recurrent_art, PROMPT, "-n", 200).report
    long = run_generate(generate, recurrent_art, PROMPT, "-n", 2000).report
    assert long["peak_bytes_at_last"] is not None, (
        "built without ONNX Runtime memory statistics (headers < 1.23)"
    )
    assert long["peak_bytes_at_last"] > 0
    assert long["peak_bytes_at_last"] == long["peak_bytes_at_128"] == short["peak_bytes_at_last"]
    assert long["rss_bytes_last"] - long["rss_bytes_start"] < 2**20  # resident memory: within 1 MiB


# ----------------------------------------------------------------------------------------------------------
# one copy of the weights: shared initializers, prepacked once, one session for one graph file
# ----------------------------------------------------------------------------------------------------------


def test_shared_weights_are_prepacked_once(generate, artifacts, tmp_path):
    """Both sessions take weights.bin's tensors as shared initializers and one prepacked-weights container:
    the same logits as each session prepacking its own copy (--no-share-weights), bitwise (the same packing
    and kernels), and the packed matrices no longer in the sessions' arenas."""
    art = artifacts["gla-onnxruntime"]
    assert json.loads((art / "edgeattn.json").read_text())["weights"]["path"] == "weights.bin"
    shared_file, own_file = tmp_path / "shared.npy", tmp_path / "own.npy"
    shared = run_generate(generate, art, PROMPT, "-n", 100, "--dump-logits", shared_file)
    own = run_generate(generate, art, PROMPT, "-n", 100, "--dump-logits", own_file, "--no-share-weights")
    assert shared.tokens == own.tokens
    np.testing.assert_array_equal(np.load(shared_file), np.load(own_file))
    assert shared.report["peak_bytes_at_last"] < own.report["peak_bytes_at_last"]


def _edit_weights(art: Path, root: Path, edit) -> Path:
    shutil.copytree(art, root)
    data = json.loads((root / "edgeattn.json").read_text())
    edit(data["weights"]["tensors"][0])
    (root / "edgeattn.json").write_text(json.dumps(data))
    return root


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update(offset=t["offset"] + 2**40), "lies outside the file"),
        (lambda t: t.update(length=t["length"] - 4), "which its shape and dtype contradict"),
    ],
)
def test_weights_table_that_disagrees_is_one_error_line(generate, artifacts, tmp_path, edit, message):
    root = _edit_weights(artifacts["gla-onnxruntime"], tmp_path / "art", edit)
    res = run_generate(generate, root, PROMPT, "-n", 5, check=False)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate: error: ") and message in lines[0], res.stderr


def test_weights_bin_replaced_by_a_fifo_is_refused(generate, artifacts, tmp_path):
    """weights.bin as a FIFO once hung generate (reading it for its sha256 waits for a writer forever); Python
    refuses it as missing. Now one line, at once."""
    import os
    import subprocess

    root = tmp_path / "art"
    shutil.copytree(artifacts["gla-onnxruntime"], root)
    (root / "weights.bin").unlink()
    os.mkfifo(root / "weights.bin")
    cmd = [str(generate), str(root), "--prompt", PROMPT, "-n", "3", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, timeout=60)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("generate: error: ") and "weights.bin is not a regular file" in lines[0], lines


def test_one_graph_file_for_step_and_prefill(generate, artifacts, tmp_path):
    """Step and prefill naming the same graph (a dynamic token axis: export --genai's model.onnx, whose state
    is the manifest's for Gated DeltaNet): one session serves both, with the Python session's tokens and
    logits (which opens the file twice)."""
    from edgeattn.export import export_model

    two_graphs = artifacts["gated_deltanet-onnxruntime"]  # exports (and so makes) the checkpoint
    art = export_model(
        artifacts.ckpts["gated_deltanet", 0],
        tmp_path / "one",
        target="onnxruntime",
        prefill_chunk=PREFILL,
        genai=True,
    )
    data = json.loads((art / "edgeattn.json").read_text())
    for graph in ("step", "prefill"):
        data["graphs"][graph]["path"] = "model.onnx"
    data["prefill_logits"] = "all"  # model.onnx returns every token's logits (step.onnx: the last one's)
    data.pop("logits_count", None)  # (step.onnx's optional input)
    (art / "edgeattn.json").write_text(json.dumps(data))

    logits_file = tmp_path / "logits.npy"
    res = run_generate(generate, art, PROMPT, "-n", 60, "--dump-logits", logits_file)
    tokens, rows = py_greedy(session(art), PROMPT, 60)
    assert res.tokens == tokens
    assert_logits_equal(np.load(logits_file), rows)
    # and the same model as the two-graph artifact, to float rounding
    ref_tokens, ref_rows = py_greedy(session(two_graphs), PROMPT, 60)
    assert tokens == ref_tokens
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------
# the preallocated KV buffer (softmax baseline, target onnxruntime)
# ----------------------------------------------------------------------------------------------------------


def test_kv_buffer_artifacts_share_one_buffer(artifacts):
    import onnx

    for name in KV_ARTIFACTS:
        m = json.loads((artifacts[name] / "edgeattn.json").read_text())
        shared = [e for e in m["state"] if e.get("shared")]
        assert shared and shared == [e for e in m["state"] if e["name"] in ("key", "value")]
        assert all(e["shape"][2] == m["max_length"] == 512 for e in shared)  # [B, H, max_length, Dh]
        ops = {n.op_type for n in onnx.load(str(artifacts[name] / "step.onnx")).graph.node}
        assert "GroupQueryAttention" in ops


def test_kv_buffer_memory_is_preallocated(generate, kv_art):
    """The buffer of max_length tokens is allocated when the session opens: by token 128 the arena holds all
    of it, and from 128 to 460 tokens it grows by GroupQueryAttention's per-step scratch (scores over the
    tokens so far) only."""
    m = json.loads((kv_art / "edgeattn.json").read_text())
    kv_bytes = sum(4 * int(np.prod(e["shape"])) for e in m["state"] if e.get("shared"))
    res = run_generate(generate, kv_art, PROMPT, "-n", 460).report
    assert res["position"] == len(PROMPT) + 460
    assert res["peak_bytes_at_128"] is not None and res["peak_bytes_at_128"] > kv_bytes
    assert 0 <= res["peak_bytes_at_last"] - res["peak_bytes_at_128"] < kv_bytes / 16
    assert res["rss_bytes_last"] - res["rss_bytes_start"] < 2**20


def test_kv_buffer_max_length_is_one_error_line(generate, kv_art):
    res = run_generate(generate, kv_art, PROMPT, "-n", 600, check=False)  # 40 + 600 > 512
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("generate: error: max_length 512 exceeded"), lines[0]
    produced = list(res.proc.stdout[len(PROMPT) : -1])  # the partial line ends with a newline
    # the buffer filled to its last slot: 472 tokens consumed after the prompt, the 473rd printed and refused,
    # and they are the Python session's tokens
    expected = list(session(kv_art).generate_ids(PROMPT, 512 - len(PROMPT), temperature=0))
    assert len(produced) == len(expected) + 1
    assert produced[:-1] == expected


# ----------------------------------------------------------------------------------------------------------
# state files of other models
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "target"),
    [
        ("gla-other", "gla-onnxruntime"),
        ("linear-onnxruntime", "gla-onnxruntime"),
        ("gla-onnxruntime", "linear-onnxruntime"),
    ],
)
def test_state_of_another_model_is_refused(generate, artifacts, tmp_path, owner, target):
    other = session(artifacts[owner])
    other.prefill(np.frombuffer(PROMPT, np.uint8).astype(np.int64)[None])
    state_file = tmp_path / f"{owner}.state"
    other.save_state(state_file)

    res = run_generate(generate, artifacts[target], PROMPT2, "-n", 5, "--state-in", state_file, check=False)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("generate: error: ") and "state of another model" in lines[0], lines[0]
    assert str(state_file) in lines[0]
    with pytest.raises(ValueError, match="another model"):  # and Python agrees
        session(artifacts[target]).load_state(state_file)


def test_state_is_shared_between_targets_of_one_checkpoint(generate, artifacts, tmp_path):
    """Same checkpoint, same fingerprint: a state of the fused graphs resumes in the portable ones."""
    state_file = tmp_path / "fused.state"
    run_generate(generate, artifacts["gla-onnxruntime"], PROMPT, "-n", 20, "--state-out", state_file)
    logits_file = tmp_path / "logits.npy"
    res = run_generate(
        generate,
        artifacts["gla-portable"],
        PROMPT2,
        "-n",
        20,
        "--state-in",
        state_file,
        "--dump-logits",
        logits_file,
    )
    ref = session(artifacts["gla-onnxruntime"])
    py_greedy(ref, PROMPT, 20)
    tokens, rows = py_greedy(ref, PROMPT2, 20)
    np.testing.assert_allclose(
        np.load(logits_file), rows, rtol=1e-3, atol=1e-3
    )  # other graphs: float rounding
    assert res.tokens == tokens
