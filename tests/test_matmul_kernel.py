"""edgeattn's CPU MatMulNBits kernel (edgeattn/runtimes/matmul.cc) against ONNX Runtime's own kernel for the
same node (an independent implementation of the same int8-activation arithmetic, accuracy level 4) and against
the exact float product of the dequantized weights; which sessions get it (the CPU's kind, the graph's forms,
``EDGEATTN_MATMUL``). The Python runtime running it on the real SmolLM2-135M-Instruct: tests/test_smollm.py
``test_matmul_kernel_as_close_to_float32_as_onnxruntimes``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from edgeattn._cpu import cpu_flags
from edgeattn.bench import cpu_as
from edgeattn.runtimes import attention

# (K, N, block_size, A's leading dims): one token (decode), 2-7 rows (batched decode, speculative checks), a
# prefill of 64 and one with rows left over from the 4-row tiles (42), a batch axis; widths with and without
# columns left over from the 4- and 2-column tiles (37, 250, 4099), blocks of 64, 128 and 256
CASES = [
    (1024, 3584, 128, (1, 1)),
    (1024, 3584, 128, (1, 64)),
    (3584, 1024, 128, (1, 1)),
    (3584, 1024, 128, (1, 42)),
    (256, 37, 64, (1, 1)),
    (256, 37, 64, (2, 7)),
    (576, 960, 64, (1, 42)),
    (576, 960, 32, (1, 1)),
    (576, 1537, 32, (1, 42)),
    (1536, 576, 32, (2, 3)),
    (512, 250, 256, (1, 1)),
    (512, 250, 256, (1, 5)),
    (1024, 4099, 128, (1, 3)),
    (1024, 4099, 128, (3, 2)),
]


@pytest.fixture(scope="module")
def lib(kernels_library):
    return kernels_library


def _weights(K, N, bs, seed=0):
    rng = np.random.default_rng(seed)
    B = rng.integers(0, 256, (N, K // bs, bs // 2), dtype=np.uint8)
    S = (rng.random(N * (K // bs), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    return B, S


def _model(K, N, bs, B, S, *, inputs=3, **attrs) -> bytes:
    attrs = {"K": K, "N": N, "bits": 4, "block_size": bs, "accuracy_level": 4, **attrs}
    names = ["x", "B", "S", "zp"][:inputs]
    node = helper.make_node("MatMulNBits", names, ["y"], domain="com.microsoft", **attrs)
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")]
    if inputs > 3:
        inits.append(
            numpy_helper.from_array(np.full((N, -(-K // bs // 2)), 0x88, np.uint8).reshape(-1), "zp")
        )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, ["b", "m", K])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model.SerializeToString()


def _session(model: bytes, library=None, threads: int = 2, ops: str = "MatMulNBits"):
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    if library is not None:
        so.add_session_config_entry("edgeattn.ops", ops)
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _exact(x, B, S, K, N, bs):
    """x @ W^T with W dequantized in float64: element 2j of a block in byte j's low nibble, 2j+1 in its high
    one, minus 8, times the block's scale (the MatMulNBits layout)."""
    lo, hi = (B & 15).astype(np.float64) - 8, (B >> 4).astype(np.float64) - 8
    W = np.stack([lo, hi], -1).reshape(N, K // bs, bs) * S.reshape(N, K // bs, 1)
    return x.astype(np.float64) @ W.reshape(N, K).T


@pytest.mark.parametrize("case", CASES, ids=lambda c: "K{}-N{}-bs{}-{}".format(*c))
def test_kernel_equals_onnxruntimes_matmulnbits(lib, case):
    K, N, bs, lead = case
    B, S = _weights(K, N, bs)
    model = _model(K, N, bs, B, S)
    x = np.random.default_rng(1).standard_t(3, (*lead, K)).astype(np.float32)  # heavy tails: real activations
    ref = _session(model).run(None, {"x": x})[0]
    got = _session(model, lib).run(None, {"x": x})[0]
    exact = _exact(x, B, S, K, N, bs)
    scale = np.abs(exact).max(-1, keepdims=True)
    assert got.shape == ref.shape == (*lead, N)
    # the same arithmetic (activations quantized to int8 per block, integer sums): equal to float rounding
    assert np.abs(got - ref).max() <= 2e-6 * scale.max()
    # and as far from the exact product as ONNX Runtime's kernel (the int8 activations' error), no further
    err_got, err_ref = (np.abs(got - exact) / scale).max(), (np.abs(ref - exact) / scale).max()
    assert err_got <= err_ref * 1.01 + 1e-6 and err_got < 0.05


def test_kernel_output_does_not_depend_on_threads(lib):
    K, N, bs = 1024, 3000, 128
    B, S = _weights(K, N, bs, seed=3)
    model = _model(K, N, bs, B, S)
    for m in (1, 9):
        x = np.random.default_rng(m).standard_normal((1, m, K)).astype(np.float32)
        one = _session(model, lib, threads=1).run(None, {"x": x})[0]
        two = _session(model, lib, threads=2).run(None, {"x": x})[0]
        assert np.array_equal(one, two)


@pytest.mark.skipif(
    cpu_as.unavailable() is not None
    or not {"avx512f", "avx512_vnni", "avx_vnni"} & set(cpu_flags(only=None)),
    reason="natively this CPU already runs the AVX2 build, or edgeattn.bench.cpu_as cannot narrow it",
)
def test_the_avx2_build_equals_onnxruntimes_avx2_kernel(lib):
    """The code an AVX2 CPU (the AMD EPYC of issue 39) builds, vpmaddubsw with no VNNI: the comparisons above
    rerun in a process whose CPUID shows an AVX2 CPU (edgeattn.bench.cpu_as), where the library is built for
    AVX2 (no vpdpbusd in it, as there is in this CPU's own build) and ONNX Runtime runs its AVX2 kernels."""
    env = {**cpu_as.environ("avx2"), "PYTHONPATH": os.pathsep.join(sys.path)}
    probe = "from edgeattn.runtimes import attention; print(attention.library()[0])"
    built = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0 and built.stdout.strip() != "None", built.stderr[-2000:]
    avx2 = built.stdout.strip().splitlines()[-1]
    assert avx2 != str(lib)
    if shutil.which("objdump"):
        code = {
            p: subprocess.run(["objdump", "-d", p], capture_output=True, text=True).stdout
            for p in (lib, avx2)
        }
        assert "vpdpbusd" not in code[avx2] and "vpmaddubsw" in code[avx2]
        assert "vpdpbusd" in code[lib]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "equals_onnx or threads",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    assert f"{len(CASES) + 1} passed" in res.stdout, res.stdout[-1000:]


@pytest.mark.parametrize(
    "form, why",
    [
        ({"block_size": 16}, "edgeattn MatMulNBits: unsupported: block_size"),
        ({"accuracy_level": 0}, "edgeattn MatMulNBits: unsupported: accuracy_level"),
        # the library's op has three inputs: ONNX Runtime refuses a fourth before the kernel sees it
        ({"inputs": 4}, "MatMulNBits:1\\) has input size 4 not in range"),
    ],
)
def test_a_form_it_does_not_take_refuses_at_load(lib, form, why):
    K, N = 256, 16
    bs = form.get("block_size", 64)
    B, S = _weights(K, N, bs)
    model = _model(K, N, bs, B, S, **form)
    _session(model)  # ONNX Runtime's kernel takes it
    with pytest.raises(Exception, match=why):
        _session(model, lib)


def test_the_library_registers_what_the_session_asks_for(lib):
    K, N, bs = 256, 16, 16  # blocks of 16: a form edgeattn's kernel refuses
    B, S = _weights(K, N, bs)
    model = _model(K, N, bs, B, S)
    _session(model, lib, ops="GroupQueryAttention")  # not registered: ONNX Runtime's runs it
    _session(model, lib, ops="")
    with pytest.raises(Exception, match="edgeattn MatMulNBits: unsupported"):
        _session(model, lib, ops="GroupQueryAttention,MatMulNBits")
    with pytest.raises(Exception, match="no kernel for Softmax"):
        _session(model, lib, ops="MatMulNBits,Softmax")


def test_which_graphs_it_takes(tmp_path):
    K, N = 256, 16
    cases = {
        "ok": ({"block_size": 128}, None),
        "b32": ({"block_size": 32}, None),
        "b16": ({"block_size": 16}, "block_size 16 with K 256"),
        "k96": ({"block_size": 32, "K": 96}, "block_size 32 with K 96"),
        "odd": ({"block_size": 128, "K": 192}, "block_size 128 with K 192"),
        "acc": ({"block_size": 64, "accuracy_level": 1}, "accuracy_level 1"),
        "zp": ({"block_size": 64, "inputs": 4}, "zero points"),
        "bits": ({"block_size": 64, "bits": 8}, "8 bits"),
    }
    for name, (form, why) in cases.items():
        form = dict(form)
        bs, k = form.pop("block_size"), form.pop("K", K)
        B, S = _weights(K, N, bs)
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(_model(k, N, bs, B, S, **form))
        got = attention.matmul_unsupported(path)
        assert got is None if why is None else why in got, (name, got)
    (tmp_path / "none.onnx").write_bytes(
        helper.make_model(
            helper.make_graph(
                [helper.make_node("Relu", ["x"], ["y"])],
                "g",
                [helper.make_tensor_value_info("x", TP.FLOAT, [1])],
                [helper.make_tensor_value_info("y", TP.FLOAT, [1])],
            )
        ).SerializeToString()
    )
    assert attention.matmul_unsupported(tmp_path / "none.onnx") == "no MatMulNBits in the graph"
    (tmp_path / "junk.onnx").write_bytes(b"not a graph")
    assert attention.matmul_unsupported(tmp_path / "junk.onnx").startswith("cannot read junk.onnx")


def test_the_cpus_kind_chooses_and_the_environment_overrides(monkeypatch):
    import edgeattn._cpu as cpu

    monkeypatch.delenv(attention.MATMUL_ENV, raising=False)
    vnni512 = ["avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512_vnni"]
    flags = {  # kind: (flags, the kernel, why not)
        "avx2": (["sse4_2", "avx2", "fma"], "edgeattn", ""),
        "avx-vnni": (["avx2", "fma", "avx_vnni"], "edgeattn", ""),
        "avx512-vnni": (vnni512, "edgeattn", ""),
        "avx512": (["avx2", "fma", "avx512f", "avx512bw"], "onnxruntime", "AVX-512 without VNNI: not raced"),
        "amx": ([*vnni512, "amx_tile", "amx_int8"], "onnxruntime", "an AMX CPU: not raced"),
        "old": (["sse4_2"], "onnxruntime", "the CPU lacks AVX2 or FMA"),
    }
    for kind, (have, want, why_not) in flags.items():
        monkeypatch.setattr(cpu, "cpu_flags", lambda path="/proc/cpuinfo", only=None, have=have: have)
        got, why = attention.matmul_chosen()
        assert got == want and why.startswith(why_not) and (why == "") == (want == "edgeattn"), (kind, why)
    monkeypatch.setenv(attention.MATMUL_ENV, "edgeattn")
    assert attention.matmul_chosen() == ("edgeattn", "EDGEATTN_MATMUL=edgeattn")  # the AVX-512 CPU above too
    monkeypatch.setenv(attention.MATMUL_ENV, "OnnxRuntime")
    assert attention.matmul_chosen() == ("onnxruntime", "EDGEATTN_MATMUL=onnxruntime")
    monkeypatch.setenv(attention.MATMUL_ENV, "mlas")
    with pytest.raises(ValueError, match="EDGEATTN_MATMUL must be one of edgeattn, onnxruntime, got 'mlas'"):
        attention.matmul_chosen()


def test_check_runs_an_int4_export_on_it_against_pytorch(kernels_library, tmp_path, monkeypatch):
    """`edgeattn export --precision int4` of a small random Linear Transformer (128 wide, MLP 384: blocks of
    128), then `edgeattn check` (the artifact against the PyTorch checkpoint) on each MatMulNBits kernel: the
    report says which kernel ran, and ours is no further from PyTorch than ONNX Runtime's (random weights at
    int4 are far from float32 on either, about 0.4 of the largest logit, so the tolerance is set past it;
    accuracy is the tests above and tests/test_smollm.py)."""
    from typer.testing import CliRunner

    from edgeattn.cli.main import app
    from tests.export_helpers import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ck", "linear", seed=0, d_model=128, mlp_ratio=3.0)  # blocks of 128
    r = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "a"), "--precision", "int4"])
    assert r.exit_code == 0, r.output
    from edgeattn.export.check import check_artifact

    diffs = {}
    for kernel, note in [
        ("edgeattn", "MatMulNBits ran on edgeattn's CPU kernel"),
        ("onnxruntime", "MatMulNBits ran on ONNX Runtime's kernel: EDGEATTN_MATMUL=onnxruntime"),
    ]:
        monkeypatch.setenv(attention.MATMUL_ENV, kernel)
        cmd = ["check", str(tmp_path / "a"), "--tokens", "40", "--tolerance", "2"]
        r = CliRunner().invoke(app, cmd, terminal_width=300)
        assert r.exit_code == 0, r.output
        assert note in " ".join(r.output.split()), r.output
        report = check_artifact(tmp_path / "a", tokens=40, tolerance=2.0)
        assert report.matmul["kernel"] == kernel
        diffs[kernel] = max(g["rel"] for g in report.graphs.values() if g["tokens"])
    assert diffs["edgeattn"] <= 1.1 * diffs["onnxruntime"], diffs
