"""edgeattn.bench.cpu_as: a command run on this CPU with AVX-512, VNNI and AMX hidden from CPUID (issue 39:
the AVX2 kernels, natively). Checked against the libraries' own CPU detection (numpy, torch) and against
``qemu-x86_64 -cpu max``'s AVX2 CPU in tests/test_cpu_kinds.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgeattn._cpu import cpu_as as cpu_as_active
from edgeattn._cpu import cpu_record
from edgeattn.bench import cpu_as

needs_cpu_as = pytest.mark.skipif(cpu_as.unavailable() is not None, reason=str(cpu_as.unavailable()))

PROBE = r"""
import json, torch
from numpy._core._multiarray_umath import __cpu_features__ as f
from edgeattn._cpu import cpu_as as cpu_as_active
from edgeattn._cpu import cpu_record
from edgeattn.bench.machine import ggml_cmake_args
print(json.dumps({"numpy": {k: bool(f[k]) for k in ("AVX2", "FMA3", "AVX512F", "AVX512_SKX", "AVX512VNNI")},
                  "torch": torch.backends.cpu.get_cpu_capability(), "cpu": cpu_record(),
                  "ggml": ggml_cmake_args()}))
"""


def probe(env) -> tuple[dict, str]:
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@needs_cpu_as
def test_numpy_torch_and_the_records_see_an_avx2_cpu():
    native, _ = probe(dict(os.environ))
    env = {**cpu_as.environ("avx2"), "EDGEATTN_CPU_AS_COUNT": "1"}
    got, err = probe(env)
    assert got["numpy"]["AVX2"] and got["numpy"]["FMA3"]
    assert not got["numpy"]["AVX512F"] and not got["numpy"]["AVX512_SKX"] and not got["numpy"]["AVX512VNNI"]
    assert got["torch"] == "AVX2"
    assert got["cpu"]["kind"] == "avx2" and "as avx2" in got["cpu"]["model"]
    assert got["cpu"]["flags"] == [f for f in native["cpu"]["flags"] if f in ("avx", "avx2", "fma", "f16c")]
    assert "-DGGML_AVX2=ON" in got["ggml"] and "-DGGML_AVX512=OFF" in got["ggml"]
    assert "-DGGML_AVX512_VNNI=OFF" in got["ggml"] and "-DGGML_AVX_VNNI=OFF" in got["ggml"]
    answered = [line for line in err.splitlines() if line.startswith("cpu_as:")]
    assert answered and int(answered[-1].split()[1]) > 0  # the CPUIDs went through the handler
    if "avx512f" in native["cpu"]["flags"]:  # the test can tell: natively the same libraries see AVX-512
        assert native["numpy"]["AVX512F"] and native["torch"] in ("AVX512", "AVX512_BF16", "AMX")


@needs_cpu_as
def test_avx_vnni_keeps_only_avx_vnni():
    got, _ = probe(cpu_as.environ("avx-vnni"))
    assert not got["numpy"]["AVX512F"] and got["cpu"]["kind"] in ("avx-vnni", "avx2")
    if "avx_vnni" in open("/proc/cpuinfo").read():
        assert got["cpu"]["kind"] == "avx-vnni" and "avx_vnni" in got["cpu"]["flags"]


@pytest.mark.skipif(
    cpu_as_active() is not None, reason="the suite itself runs under cpu_as: its record is narrowed"
)
def test_the_variable_alone_narrows_nothing():
    """A process that inherits EDGEATTN_CPU_AS_ACTIVE without the library keeps the CPU's own record."""
    env = {**os.environ, "EDGEATTN_CPU_AS_ACTIVE": "avx2"}
    env.pop("LD_PRELOAD", None)
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from edgeattn._cpu import cpu_record; print(json.dumps(cpu_record()))",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == cpu_record()


@needs_cpu_as
def test_a_real_fault_still_reaches_faulthandler():
    """The library keeps its SIGSEGV handler first (faulthandler, which pytest turns on, installs its own
    later) and hands every fault that is not a CPUID to it: a crash still crashes, with Python's report."""
    res = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", "import ctypes; ctypes.string_at(0)"],
        env=cpu_as.environ("avx2"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -11, (res.returncode, res.stderr[-1000:])
    assert "Fatal Python error: Segmentation fault" in res.stderr


def run_main(*args):
    return subprocess.run(
        [sys.executable, "-m", "edgeattn.bench.cpu_as", *args], capture_output=True, text=True, timeout=300
    )


def test_bad_arguments_are_one_line():
    for args, code in ((["avx512", "--", "true"], 2), (["avx2", "true"], 2), ([], 2)):
        res = run_main(*args)
        assert res.returncode == code, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    if cpu_as.unavailable() is None:
        res = run_main("avx2", "--", "no-such-command-here")
        assert res.returncode == 127 and res.stderr.strip().count("\n") == 0, res.stderr
        assert "no-such-command-here" in res.stderr
        res = run_main(
            "avx2", "--", sys.executable, "-c", "import os; print(os.environ['EDGEATTN_CPU_AS_ACTIVE'])"
        )
        assert res.returncode == 0 and res.stdout.strip() == "avx2", res.stderr


def test_a_cpu_without_cpuid_faulting_is_refused_in_one_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f\n")
    why = cpu_as.unavailable(str(info))
    if why is not None and "x86-64 Linux" in why:
        pytest.skip(why)
    assert why is not None and "cpuid_fault" in why
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma cpuid_fault\n")
    why = cpu_as.unavailable(str(info))
    assert why is None or "compiler" in why, why  # only a missing C compiler may still stand in the way


@needs_cpu_as
def test_a_failed_build_is_one_line_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(cpu_as.CpuAsError, match="could not build") as err:
        cpu_as.library(tmp_path)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.rglob("*.so"))
    monkeypatch.delenv("CC")
    built = cpu_as.library(tmp_path)  # the real compiler: built once, then reused
    assert built.is_file() and cpu_as.library(tmp_path) == built
