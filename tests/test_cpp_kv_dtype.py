"""The C++ runtime on reduced KV buffers: a tiny Qwen3.5 (three Gated DeltaNet layers and one attention layer,
tests/hf_helpers.qwen3_5_text as in tests/test_qwen3_5_int4) exported with ``kv_dtype="int8"`` (ONNX Runtime's
PER_CHANNEL quantized cache, the manifest's ``scale``) and ``kv_dtype="float16"``.

The reference is the Python session, ``open_session(artifact, threads=1)``: the same ONNX Runtime library
running the same graphs with the same calls (prompts of whole prefill chunks, so both sides make the same graph
calls), so tokens are equal and logits equal to 1e-5 (bitwise in practice). State files are float32 on both
sides: an int8 slot as ``q * scale``, a float16 one widened; only the slots below the position are converted.
The C++ build is tests/artifact_fixture's (shared with tests/test_cpp.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeattn.runtimes import open_session
from edgeattn.runtimes.base import kv_to_float
from edgeattn.runtimes.state_file import load_state, save_state
from tests.artifact_fixture import build_generate, greedy_logits
from tests.hf_helpers import rel_err

PREFILL = 16
V = 320  # hf_helpers.QWEN_TINY's vocabulary
_rng = np.random.default_rng(5)
PROMPT = _rng.integers(0, V, 48).tolist()  # three prefill chunks
PROMPT2 = _rng.integers(0, V, 32).tolist()  # two, after a loaded state
N = 30
KV_DTYPES = ["int8", "float16"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("onnx", reason="exporting needs onnx (the 'train' extra)")
    from edgeattn.convert import import_model
    from tests.hf_helpers import qwen3_5_text

    root = tmp_path_factory.mktemp("cpp-kv-dtype")
    qwen3_5_text(seed=3, tie_word_embeddings=True).save_pretrained(root / "hf")
    import_model(root / "hf", root / "ckpt")
    return root


def export(root: Path, kv_dtype: str, **kw) -> Path:
    from edgeattn.export import export_model

    name = f"kv-{kv_dtype}" + "".join(f"-{k}" for k in kw)
    if not (root / name).exists():
        export_model(root / "ckpt", root / name, prefill_chunk=PREFILL, kv_dtype=kv_dtype, **kw)
    return root / name


@pytest.fixture(scope="module", params=KV_DTYPES)
def art(request, root) -> Path:
    return export(root, request.param)


@pytest.fixture(scope="module")
def generate() -> Path:
    return build_generate()


class Run:
    """One run of the example with --prompt-ids: ``tokens`` (the printed ids), ``stderr``, ``report``."""

    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode = proc.returncode
        self.stderr = proc.stderr
        self.tokens = [int(t) for t in proc.stdout.split()] if proc.returncode == 0 else None
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("{")]
        self.report = json.loads(lines[-1]) if lines else None


def run_ids(binary: Path, art: Path, prompt: list[int], *args, check: bool = True) -> Run:
    ids = ",".join(map(str, prompt))
    cmd = [str(binary), str(art), "--prompt-ids", ids, "--threads", "1", *map(str, args)]
    res = Run(subprocess.run(cmd, capture_output=True, text=True, timeout=120))
    if check:
        assert res.returncode == 0, res.stderr
    return res


def kv_entries(art: Path) -> list:
    return [e for e in open_session(art, threads=1).manifest.state if e.shared]


# ----------------------------------------------------------------------------------------------------------
# C++ against the Python session
# ----------------------------------------------------------------------------------------------------------


def test_artifacts_have_reduced_kv_buffers(root):
    for kv in KV_DTYPES:
        m = json.loads((export(root, kv) / "edgeattn.json").read_text())
        shared = [e for e in m["state"] if e.get("shared")]
        assert [e["name"] for e in shared] == ["key", "value"] and {e["dtype"] for e in shared} == {kv}
        assert all(("scale" in e) == (kv == "int8") for e in shared)
        assert "position" in {e["name"] for e in m["state"]}
        assert (
            m["graphs"]["prefill"]["tokens"] == PREFILL
            and len(PROMPT) % PREFILL == len(PROMPT2) % PREFILL == 0
        )


def test_greedy_matches_python(generate, art, tmp_path):
    logits_file = tmp_path / "logits.npy"
    res = run_ids(generate, art, PROMPT, "-n", N, "--dump-logits", logits_file)
    tokens, rows = greedy_logits(open_session(art, threads=1), PROMPT, N)
    assert res.tokens == tokens
    assert rel_err(np.load(logits_file), rows) <= 1e-5
    assert np.ptp(rows, axis=0).max() > 0.1  # the logits move from token to token
    assert res.report["position"] == len(PROMPT) + N


def test_cpp_state_loads_in_python(generate, art, tmp_path):
    """The C++ state file equals Python's get_state after the same tokens (float32: int8 slots times their
    scales, float16 widened, zeros past the position), and both continue from it as Python does without it."""
    state_file = tmp_path / "cpp.state"
    res = run_ids(generate, art, PROMPT, "-n", N, "--state-out", state_file)
    ref = open_session(art, threads=1)
    assert greedy_logits(ref, PROMPT, N)[0] == res.tokens
    tensors, meta = load_state(state_file)
    assert int(meta["position"]) == ref.position == len(PROMPT) + N
    state = ref.get_state()
    assert sorted(tensors) == sorted(state)
    for name, value in state.items():  # the same graph calls: bitwise the same state
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    for e in kv_entries(art):
        kv = tensors[e.input]
        assert np.abs(kv[:, :, : ref.position]).max() > 0 and not kv[:, :, ref.position :].any()
        if e.dtype == "int8":  # on the int8 grid of the scales
            scale = np.asarray(e.scale, np.float32)[None, :, None, :]
            q = np.rint(kv / scale)
            assert np.array_equal(kv, q * scale) and np.abs(q).max() <= 128

    expected_tokens, expected_rows = greedy_logits(ref, PROMPT2, N)  # Python, never through a file
    resumed = open_session(art, threads=1)
    resumed.load_state(state_file)
    tokens, rows = greedy_logits(resumed, PROMPT2, N)
    assert tokens == expected_tokens and rel_err(rows, expected_rows) <= 1e-5
    logits_file = tmp_path / "logits.npy"
    again = run_ids(generate, art, PROMPT2, "-n", N, "--state-in", state_file, "--dump-logits", logits_file)
    assert again.tokens == expected_tokens
    assert rel_err(np.load(logits_file), expected_rows) <= 1e-5


def test_python_state_resumes_in_cpp(generate, art, tmp_path):
    sess = open_session(art, threads=1)
    greedy_logits(sess, PROMPT, N)
    state_file = tmp_path / "py.state"
    sess.save_state(state_file)
    tokens, rows = greedy_logits(sess, PROMPT2, N)

    logits_file = tmp_path / "logits.npy"
    res = run_ids(generate, art, PROMPT2, "-n", N, "--state-in", state_file, "--dump-logits", logits_file)
    assert res.tokens == tokens
    assert rel_err(np.load(logits_file), rows) <= 1e-5
    assert res.report["position"] == len(PROMPT) + 2 * N + len(PROMPT2)


def test_cpp_reduces_float32_slots_as_python_does(generate, art, tmp_path):
    """A state whose KV slots sit on rounding ties (int8: x / scale = k + 1/2; float16: halfway between two
    float16 neighbours) and, for int8, past the scales' range: C++ loads it, runs one token and saves, and its
    filled slots are Python's (set_state's int8 or float16 values, read back): rint's half-to-even and the clip
    to [-128, 127], IEEE round to nearest even."""
    sess = open_session(art, threads=1)
    sess.prefill(np.array([PROMPT], np.int64))
    n = sess.position
    state = sess.get_state()
    rng = np.random.default_rng(0)
    ties = {}
    for e in kv_entries(art):
        shape = state[e.input][:, :, :n].shape
        if e.dtype == "int8":
            scale = np.asarray(e.scale, np.float32)[None, :, None, :]
            k = rng.integers(-135, 135, shape).astype(np.float32)
            x = ((k + 0.5) * scale).astype(np.float32)
            q = x / scale
            half_away = np.sign(q) * np.floor(np.abs(q) + 0.5)
            ties[e.input] = (np.rint(q) != half_away).mean()  # where round-half-away-from-zero would differ
        else:
            h = rng.normal(0, 2, shape).astype(np.float16)
            up = np.nextafter(h, np.float16(np.inf))
            x = (h.astype(np.float32) + up.astype(np.float32)) / 2  # exact in float32
            ties[e.input] = (x.astype(np.float16) != h).mean()  # where truncation would differ
        state[e.input][:, :, :n] = x
    assert min(ties.values()) > 0.2  # many slots where another rounding rule gives another value
    crafted = tmp_path / "crafted.state"
    save_state(crafted, state, sess.manifest.fingerprint, n)

    py = open_session(art, threads=1)
    py.load_state(crafted)
    run_ids(generate, art, [7], "-n", 1, "--state-in", crafted, "--state-out", tmp_path / "cpp.state")
    tensors, meta = load_state(tmp_path / "cpp.state")
    assert int(meta["position"]) == n + 2
    for i, e in enumerate(py.manifest.state):
        if e.shared:
            want = kv_to_float(e, py._kv_np[i][:, :, :n])
            np.testing.assert_array_equal(tensors[e.input][:, :, :n], want, err_msg=e.input)
            assert tensors[e.input][:, :, n : n + 2].any()  # the two tokens the C++ run wrote


# ----------------------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------------------


def _edit_manifest(art: Path, dst: Path, edit) -> Path:
    shutil.copytree(art, dst)
    m = json.loads((dst / "edgeattn.json").read_text())
    edit(m)
    (dst / "edgeattn.json").write_text(json.dumps(m))
    return dst


def _drop_scale(m):
    for e in m["state"]:
        e.pop("scale", None)


def _short_scale(m):
    for e in m["state"]:
        if "scale" in e:
            e["scale"] = e["scale"][:-1]


def _zero_scale(m):
    next(e for e in m["state"] if "scale" in e)["scale"][0][3] = 0


def _int8_recurrent_state(m):
    next(e for e in m["state"] if e["name"] == "recurrent_state")["dtype"] = "int8"


@pytest.mark.parametrize(
    "edit,message",
    [
        (_drop_scale, 'is an int8 KV buffer without "scale": 2 rows of 16 positive numbers'),
        (_short_scale, '"scale" must list 2 rows of 16 positive numbers'),
        (_zero_scale, '"scale" must list 2 rows of 16 positive numbers'),
        (
            _int8_recurrent_state,
            "has dtype int8: state tensors are float32 (a shared KV buffer float16 or int8 too)",
        ),
    ],
)
def test_bad_int8_manifest_is_one_error_line(generate, root, tmp_path, edit, message):
    bad = _edit_manifest(export(root, "int8"), tmp_path / "bad", edit)
    res = run_ids(generate, bad, PROMPT, "-n", 2, check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("generate: error: ") and message in lines[0], lines[0]


def test_streams_refuse_a_reduced_kv_buffer(generate, root):
    """Streams batch float32 recurrent state rows; a KV buffer (any dtype) is refused in one line when the
    Streams open, while a Session runs the same artifact."""
    art = export(root, "int8", dynamic_batch=True)
    cmd = [str(generate.parent / "streams"), str(art), "--prompt", "a", "--prompt", "b", "-n", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "streams: error: state past_key_values.3.key is a KV buffer (softmax attention, int8)"
    )
    assert "streams take fixed-size recurrent state only" in lines[0]
    assert run_ids(generate, art, PROMPT, "-n", 2).tokens is not None


def test_cpp_runs_edgeattns_kernels_as_python_does(generate, art, tmp_path, kernels_library):
    """``generate --kernels LIB`` (edgeattn's CPU kernels library, ``python -m edgeattn.runtimes.attention``):
    edgeattn's GroupQueryAttention over the float32 buffer, ONNX Runtime's over float16/int8 (and it says why),
    the same greedy tokens and logits as Python's session on the same kernels."""
    kv = kv_entries(art)[0].dtype
    logits_file = tmp_path / "logits.npy"
    res = run_ids(generate, art, PROMPT, "-n", N, "--dump-logits", logits_file, "--kernels", kernels_library)
    assert res.report["kernels"] == ("GroupQueryAttention" if kv == "float32" else "")
    if kv != "float32":
        assert (
            "GroupQueryAttention,MatMulNBits: not in this artifact in the form the kernels take" in res.stderr
        )
    sess = open_session(art, threads=1)
    assert sess.attention["kernel"] == ("edgeattn" if kv == "float32" else "onnxruntime")
    tokens, rows = greedy_logits(sess, PROMPT, N)
    assert res.tokens == tokens
    assert rel_err(np.load(logits_file), rows) <= 1e-5


def test_cpp_kernels_on_int4(generate, root, tmp_path, kernels_library, monkeypatch):
    """int4 exports (MatMulNBits) with ``--kernels LIB --kernel-ops GroupQueryAttention,MatMulNBits``. A Linear
    Transformer 128 wide (every K a multiple of 64, blocks of 128): edgeattn's MatMulNBits kernel, the same
    greedy tokens and logits as Python's session on it (``EDGEATTN_MATMUL=edgeattn``: on any CPU). The tiny
    Qwen3.5 (96-wide attention output): a form the MatMulNBits kernel refuses, so the session loads with the
    attention kernel alone and says why. A library that is not there: one error line."""
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ck", "linear", seed=0, d_model=128, mlp_ratio=3.0)
    art = export_model(ckpt, tmp_path / "int4", precision="int4", prefill_chunk=PREFILL)
    prompt = [t % 256 for t in PROMPT]  # its vocabulary: bytes
    logits_file = tmp_path / "logits.npy"
    ops = ("--kernels", kernels_library, "--kernel-ops", "GroupQueryAttention,MatMulNBits")
    res = run_ids(generate, art, prompt, "-n", N, "--dump-logits", logits_file, *ops)
    assert res.report["kernels"] == "MatMulNBits", res.stderr
    monkeypatch.setenv("EDGEATTN_MATMUL", "edgeattn")
    sess = open_session(art, threads=1)
    assert sess.matmul == {"kernel": "edgeattn"}
    tokens, rows = greedy_logits(sess, prompt, N)
    assert res.tokens == tokens
    assert rel_err(np.load(logits_file), rows) <= 1e-5
    qwen = export(root, "float32", precision="int4")
    res = run_ids(generate, qwen, PROMPT, "-n", 4, *ops)
    assert res.report["kernels"] == "GroupQueryAttention"
    assert "did not load with GroupQueryAttention,MatMulNBits" in res.stderr
    assert "edgeattn MatMulNBits: unsupported: K not a multiple of block_size" in res.stderr
    bad = run_ids(generate, art, prompt, "--kernels", tmp_path / "nothing.so", check=False)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert "cannot load the kernels library" in bad.stderr
    for args, why in (
        (
            ("--kernels", kernels_library, "--kernel-ops", "MatMul"),
            "kernel_ops: no edgeattn kernel for MatMul",
        ),
        (("--kernel-ops", "MatMulNBits"), "--kernel-ops needs --kernels LIB"),
    ):
        bad = run_ids(generate, art, prompt, *args, check=False)
        assert bad.returncode in (1, 2) and why in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 or "usage:" in bad.stderr, bad.stderr


CHOOSE = r"""
import json, sys
from edgeattn.runtimes import open_session
print(json.dumps(open_session(sys.argv[1], threads=1).matmul))
"""


def test_cpp_chooses_the_matmul_kernel_as_python_does(generate, tmp_path, kernels_library, monkeypatch):
    """Without --kernel-ops the C++ runtime makes Python's choice (``kernels_for_session``): edgeattn's
    MatMulNBits on the CPU kinds it was raced on (AVX2, AVX-VNNI, AVX-512 VNNI), in the forms it takes (blocks of 16: the library
    refuses them at load and the session loads without it). Checked on this CPU as it is and, where
    ``edgeattn.bench.cpu_as`` can narrow it, as an AVX2 CPU: both runtimes in processes that see the same CPUID."""
    from edgeattn.bench import cpu_as
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint

    monkeypatch.delenv("EDGEATTN_MATMUL", raising=False)
    ckpt = make_checkpoint(tmp_path / "ck", "linear", seed=0, d_model=128, mlp_ratio=3.0)
    arts = {
        bs: export_model(
            ckpt,
            tmp_path / f"int4-{bs}",
            precision="int4",
            prefill_chunk=PREFILL,
            quantization={"block_size": bs},
        )
        for bs in (128, 32, 16)
    }
    prompt = [t % 256 for t in PROMPT]
    kinds = [None] + (["avx2"] if cpu_as.unavailable() is None else [])
    for kind in kinds:
        env = cpu_as.environ(kind) if kind else dict(os.environ)
        env.pop("EDGEATTN_MATMUL", None)
        for bs, art in arts.items():
            cpp = subprocess.run(
                [
                    str(generate),
                    str(art),
                    "--prompt-ids",
                    ",".join(map(str, prompt)),
                    "-n",
                    "2",
                    "--kernels",
                    str(kernels_library),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert cpp.returncode == 0, cpp.stderr
            report = json.loads([ln for ln in cpp.stderr.splitlines() if ln.startswith("{")][-1])
            py = subprocess.run(
                [sys.executable, "-c", CHOOSE, str(art)],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert py.returncode == 0, py.stderr
            matmul = json.loads(py.stdout.strip().splitlines()[-1])
            assert (report["kernels"] == "MatMulNBits") == (matmul["kernel"] == "edgeattn"), (
                kind,
                bs,
                cpp.stderr,
            )
            if kind == "avx2":  # an AVX2 CPU: the kernel for blocks of 128 and 32, not for blocks of 16
                assert report["kernels"] == ("MatMulNBits" if bs != 16 else ""), cpp.stderr
                if bs == 16:
                    assert "unsupported: block_size" in cpp.stderr and "block_size 16" in matmul["why"]
            elif "not raced" in matmul.get("why", ""):  # natively on an AMX CPU or AVX-512 without VNNI
                assert "not raced against ONNX Runtime's kernels there" in cpp.stderr, cpp.stderr
