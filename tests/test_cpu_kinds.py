"""What must not depend on the CPU the suite runs on (issue 38): an Intel Xeon with AVX-512 and AMX, an AMD
EPYC with AVX-512 VNNI (Zen 4), an AMD EPYC with AVX2 only (Zen 3, no VNNI).

- The test checkpoints whose files are pinned bit for bit (tests/test_artifact_identical.py) are drawn on
  a power-of-two grid from numpy's integer generator: made under torch's scalar kernels
  (``ATEN_CPU_CAPABILITY=default``) and its vectorised ones, they are the same bytes.
- int8 and int4 exports give the same logits on a CPU without AVX-512 and VNNI: the ONNX Runtime part runs
  under ``qemu-x86_64 -cpu max`` (user-mode emulation of an x86-64 CPU with AVX2 and FMA, no AVX-512, no
  VNNI: what MLAS dispatches on is the CPUID it reports), compared with the same artifact run natively.
  Before the int8 export's weights became uint8, its logits went 0.56 relative off there (0.20 natively).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeattn.bench import cpu_as, machine
from edgeattn.export.check import default_text, run_logits
from edgeattn.export.exporter import export_model
from edgeattn.export.precision import S8_SATURATES
from edgeattn.runtimes import open_session
from tests.export_helpers import PREFILL, make_checkpoint

REPO = Path(__file__).resolve().parents[1]
QEMU = shutil.which("qemu-x86_64")
needs_qemu = pytest.mark.skipif(
    platform.machine() != "x86_64" or QEMU is None,
    reason="needs qemu-user's qemu-x86_64 on an x86-64 machine (scripts/setup_env.sh installs it)",
)

CHECKPOINT_BYTES = r"""
import hashlib, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.export_helpers import make_checkpoint
out = {}
for mixer in ("kda", "mamba2", "performer", "gla"):
    ck = make_checkpoint(Path(tempfile.mkdtemp()) / "ck", mixer, seed=0, grid=True)
    out[mixer] = hashlib.sha256((Path(ck) / "model.safetensors").read_bytes()).hexdigest()
print(out)
"""


def test_grid_checkpoints_are_the_same_bytes_under_torch_scalar_and_vector_kernels():
    """The families whose random init differed between an Intel Xeon and an AMD EPYC (kda's dt_bias,
    mamba2's A_log) and two others: the same bytes with torch's vectorised kernels (this CPU's) and its
    scalar ones, where a plain ``normal_`` init gives other bits."""
    runs = {}
    for cap in ("default", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if cap:
            env["ATEN_CPU_CAPABILITY"] = cap
        res = subprocess.run(
            [sys.executable, "-c", CHECKPOINT_BYTES, str(REPO)], env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr[-2000:]
        runs[cap] = res.stdout.strip().splitlines()[-1]
    assert runs["default"] == runs[None]


def test_a_plain_init_does_depend_on_the_kernels(tmp_path):
    """The reason for the grid: without it the same seed gives other bytes under torch's scalar kernels
    (the check above can tell the two apart)."""
    code = (
        "import sys, torch; torch.manual_seed(0); "
        "sys.stdout.write(torch.empty(4096).normal_().numpy().tobytes().hex()[:4096])"
    )
    outs = set()
    for cap in ("default", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        outs.add(res.stdout)
    if machine.cpu_kind() in ("avx2", "avx-vnni", "avx512", "avx512-vnni", "amx"):
        assert len(outs) == 2


def test_cpu_kind_from_flags():
    assert (
        machine.cpu_kind(["avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"])
        == "amx"
    )
    assert machine.cpu_kind(["avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"]) == "avx512-vnni"
    assert machine.cpu_kind(["avx", "avx2", "fma", "avx512f", "avx512bw"]) == "avx512"
    assert machine.cpu_kind(["avx", "avx2", "fma", "avx_vnni"]) == "avx-vnni"
    assert machine.cpu_kind(["avx", "avx2", "fma"]) == "avx2"
    assert machine.cpu_kind(["asimd", "asimddp"]) == "arm64-dotprod"


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma avx512f bmi2 avx512_vnni\n"
    )
    assert machine.cpu_flags(str(info)) == ["avx2", "fma", "avx512f", "avx512_vnni"]
    assert machine.cpu_flags(str(tmp_path / "missing")) == []
    rec = machine.cpu_record()
    assert set(rec) == {"model", "kind", "flags"} and rec["model"] == machine.cpu_model()


EMULATED_LOGITS = r"""
import json, sys
import numpy as np
from numpy._core._multiarray_umath import __cpu_features__ as features
sys.path.insert(0, sys.argv[1])
from edgeattn.export.check import run_logits
from edgeattn.runtimes import open_session
ids = np.load(sys.argv[2])
out = {"avx2": bool(features["AVX2"]), "avx512f": bool(features["AVX512F"]),
       "vnni": bool(features["AVX512VNNI"]), "logits": {}}
for art in sys.argv[3:]:
    got = run_logits(open_session(art, backend="onnxruntime", threads=2), ids)
    np.savez(art + ".emulated.npz", prefill=got["prefill"], step=got["step"])
print(json.dumps(out))
"""


@needs_qemu
def test_int8_and_int4_exports_give_the_same_logits_on_a_cpu_without_avx512_or_vnni(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ck", "gla", seed=0)
    ids = np.frombuffer(default_text(121), dtype=np.uint8).astype(np.int64)[None, :-1]
    ref = run_logits(
        open_session(
            export_model(ckpt, tmp_path / "fp32", prefill_chunk=PREFILL, prefill_logits="all"), "torch"
        ),
        ids,
    )
    arts, native = {}, {}
    for precision, q in (("int8", {"weights": "u8"}), ("int8-blocks", None), ("int4", None)):
        # every position compared (prefill_logits "all"); int8-blocks: the default int8, 8-bit MatMulNBits
        arts[precision] = export_model(
            ckpt,
            tmp_path / precision,
            precision=precision.split("-")[0],
            prefill_chunk=PREFILL,
            prefill_logits="all",
            quantization=q,
        )
        native[precision] = run_logits(open_session(arts[precision], threads=2), ids)
    np.save(tmp_path / "ids.npy", ids)
    res = subprocess.run(
        [QEMU, "-cpu", "max", sys.executable, "-c", EMULATED_LOGITS, str(REPO), str(tmp_path / "ids.npy")]
        + [str(a) for a in arts.values()],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    cpu = json.loads(res.stdout.strip().splitlines()[-1])
    assert cpu["avx2"] and not cpu["avx512f"] and not cpu["vnni"]  # the kind of CPU emulated
    for precision, art in arts.items():
        emulated = np.load(f"{art}.emulated.npz")
        for graph in ("prefill", "step"):
            want = ref[graph]
            rel = {
                "native": np.abs(native[precision][graph] - want).max() / np.abs(want).max(),
                "emulated": np.abs(emulated[graph] - want).max() / np.abs(want).max(),
            }
            # the same error on both CPU kinds (int8 was 0.56 emulated against 0.20 native) ...
            assert abs(rel["emulated"] - rel["native"]) <= 0.01 * max(rel["native"], 1e-3) + 1e-4, (
                precision,
                graph,
                rel,
            )
            # ... and within the int8 bound test_export states (int4's is the check's default for int4)
            if precision.startswith("int8"):
                assert rel["emulated"] <= 0.3, (graph, rel)


@pytest.fixture(scope="module")
def int8_arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    ckpt = make_checkpoint(root / "ck", "gla", seed=0)
    return {
        w: export_model(ckpt, root / w, precision="int8", prefill_chunk=PREFILL, quantization={"weights": w})
        for w in ("u8", "s8")
    }


def test_int8_weights_are_blocks_by_default_and_unsigned_or_signed_on_request(tmp_path, int8_arts):
    import onnx

    from edgeattn.artifact.manifest import Manifest
    from edgeattn.export.check import int8_weights

    ckpt = make_checkpoint(tmp_path / "ck", "gla", seed=1)
    default = export_model(ckpt, tmp_path / "default", precision="int8", prefill_chunk=PREFILL)
    graph = onnx.load(str(Manifest.load(default).graph_path("step")), load_external_data=False).graph
    assert int8_weights(graph) == "blocks"  # weight-only: no integer MatMul whose weights could saturate
    assert not [n for n in graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    # the portable target has no MatMulNBits: its int8 default stays the dynamic quantization, unsigned
    portable = export_model(
        ckpt, tmp_path / "portable", target="portable", precision="int8", prefill_chunk=PREFILL
    )
    graph = onnx.load(str(Manifest.load(portable).graph_path("step")), load_external_data=False).graph
    assert int8_weights(graph) == "u8"
    for art, want in ((int8_arts["u8"], "u8"), (int8_arts["s8"], "s8")):
        m = Manifest.load(art)
        for g in ("step", "prefill"):
            graph = onnx.load(str(m.graph_path(g)), load_external_data=False).graph
            assert int8_weights(graph) == want
            weights = {i.name: i.data_type for i in graph.initializer}
            quantized = [n.input[1] for n in graph.node if n.op_type == "MatMulInteger"]
            assert quantized and {weights[w] for w in quantized} == {
                onnx.TensorProto.UINT8 if want == "u8" else onnx.TensorProto.INT8
            }


@pytest.mark.parametrize(
    "kind, weights, noted",
    [
        ("avx2", "s8", True),
        ("avx512", "s8", True),
        ("avx512-vnni", "s8", False),
        ("amx", "s8", False),
        ("avx2", "u8", False),
    ],
)
def test_check_says_when_signed_int8_weights_saturate_on_this_cpu(
    monkeypatch, int8_arts, kind, weights, noted
):
    import edgeattn.export.check as check

    monkeypatch.setattr(check, "cpu_record", lambda: {"model": "Some CPU", "kind": kind, "flags": []})
    report = check.check_artifact(int8_arts[weights], tokens=40)
    assert report.cpu["kind"] == kind
    assert any("saturating" in n and "--int8-weights u8" in n for n in report.notes) == noted


def test_cli_check_names_the_cpu_and_export_takes_int8_weights(tmp_path):
    from typer.testing import CliRunner

    from edgeattn.cli.main import app
    from edgeattn.export.check import int8_weights

    ckpt = make_checkpoint(tmp_path / "ck", "gla", seed=0)
    r = CliRunner().invoke(
        app,
        ["export", str(ckpt), "--out", str(tmp_path / "a"), "--precision", "int8", "--int8-weights", "s8"],
    )
    assert r.exit_code == 0, r.output
    import onnx

    assert int8_weights(onnx.load(str(tmp_path / "a" / "step.onnx"), load_external_data=False).graph) == "s8"
    # on a CPU kind whose int8 kernel saturates with signed weights (AVX2, AVX-512 without VNNI) the s8 artifact
    # is further from PyTorch than check's default 0.3 accepts: the report says why (the tolerance lets it pass)
    saturates = machine.cpu_kind() in S8_SATURATES
    cmd = ["check", str(tmp_path / "a"), "--tokens", "40", *(["--tolerance", "5"] if saturates else [])]
    r = CliRunner().invoke(app, cmd, terminal_width=200)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert f"({machine.cpu_kind()})" in out
    assert ("ONNX Runtime multiplies them with 16-bit saturating sums" in out) == saturates, out
    r = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "b"), "--int8-weights", "s4"])
    assert r.exit_code == 2 and "s4" in r.output and not (tmp_path / "b").exists()


def test_llama_cpp_is_built_for_the_instruction_sets_the_cpu_has():
    avx2 = machine.ggml_cmake_args(["fpu", "avx", "avx2", "fma", "f16c"])
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_VNNI=OFF" in avx2
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_AMX_INT8=OFF" in avx2
    zen4 = machine.ggml_cmake_args(["avx", "avx2", "fma", "f16c", "avx512f", "avx512vbmi", "avx512_vnni"])
    assert "-DGGML_AVX512=ON" in zen4 and "-DGGML_AVX512_VNNI=ON" in zen4 and "-DGGML_AVX512_BF16=OFF" in zen4
    here = machine.ggml_cmake_args()
    assert ("-DGGML_AVX512=ON" in here) == ("avx512f" in machine.cpu_flags())


SAVED_LOGITS = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from edgeattn.export.check import run_logits
from edgeattn.runtimes import open_session
got = run_logits(open_session(sys.argv[3], backend="onnxruntime", threads=2), np.load(sys.argv[2]))
np.savez(sys.argv[4], prefill=got["prefill"], step=got["step"])
"""


@needs_qemu
@pytest.mark.skipif(cpu_as.unavailable() is not None, reason=str(cpu_as.unavailable()))
def test_cpu_as_runs_the_kernels_of_qemus_avx2_cpu(tmp_path, int8_arts):
    """edgeattn.bench.cpu_as (this CPU, AVX-512 and VNNI hidden from CPUID) against qemu's emulated AVX2
    CPU: the signed int8 export, whose 16-bit sums saturate without VNNI, gives the same logits bit for bit,
    and other ones than this CPU's own kernels where it has VNNI."""
    ids = np.frombuffer(default_text(121), dtype=np.uint8).astype(np.int64)[None, :-1]
    np.save(tmp_path / "ids.npy", ids)
    args = ["-c", SAVED_LOGITS, str(REPO), str(tmp_path / "ids.npy"), str(int8_arts["s8"])]
    runs = {
        "qemu": ([QEMU, "-cpu", "max", sys.executable], os.environ),
        "cpu_as": ([sys.executable], cpu_as.environ("avx2")),
        "native": ([sys.executable], os.environ),
    }
    got = {}
    for name, (cmd, env) in runs.items():
        res = subprocess.run(
            cmd + args + [str(tmp_path / f"{name}.npz")], env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, (name, res.stderr[-2000:])
        got[name] = np.load(tmp_path / f"{name}.npz")
    for graph in ("prefill", "step"):
        assert np.array_equal(got["cpu_as"][graph], got["qemu"][graph]), graph
        if "avx512_vnni" in machine.cpu_flags():
            assert not np.array_equal(got["cpu_as"][graph], got["native"][graph]), graph
