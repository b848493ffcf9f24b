"""The machine under test: a description for results.json and the two rates the theory floors use.

``describe()`` reads only the standard library, psutil and package metadata (no torch, no GPU library);
``measure_bandwidth()`` and ``measure_matmul()`` time numpy on this machine at start-up.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata

import numpy as np

from edgeattn._cpu import _device_tree_model, cpu_flags, cpu_kind, cpu_model, cpu_record

LIBRARIES = (
    "edgeattn",
    "numpy",
    "onnxruntime",
    "onnxruntime-gpu",
    "tensorrt",
    "torch",
    "matplotlib",
    "psutil",
)


def with_cpu(result: dict) -> dict:
    """``result`` with ``cpu`` (``cpu_record()``) added, for a benchmark's JSON line."""
    return {**result, "cpu": cpu_record()}


# llama.cpp's CMake switches for x86 instruction sets, by the /proc/cpuinfo flag each needs
GGML_X86 = (
    ("GGML_AVX", "avx"),
    ("GGML_AVX2", "avx2"),
    ("GGML_FMA", "fma"),
    ("GGML_F16C", "f16c"),
    ("GGML_AVX_VNNI", "avx_vnni"),
    ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512vbmi"),
    ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
)


def ggml_cmake_args(flags: list[str] | None = None) -> str:
    """CMAKE_ARGS for building llama.cpp (llama-cpp-python) for this CPU: each instruction set on only where
    the CPU has it (a build for AVX-512 dies with "Illegal instruction" on an AVX2-only CPU), GGML_NATIVE off
    so the choice is this list's, and AMX off (its kernels crashed on the Intel Xeon here)."""
    have = set(cpu_flags(only=None) if flags is None else flags)
    args = ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in have else 'OFF'}" for opt, flag in GGML_X86]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAVA_BUILD=OFF"]
    return " ".join(args)


def gpus() -> list[dict]:
    """NVIDIA GPUs from nvidia-smi (name, memory); on a Jetson (integrated GPU, no nvidia-smi) the board."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            found = []
            for line in out.strip().splitlines():
                name, mem, driver = (p.strip() for p in line.split(","))
                mem_bytes = int(float(mem) * 2**20) if mem.replace(".", "").isdigit() else None
                found.append({"name": name, "memory_bytes": mem_bytes, "driver": driver})
            if found:
                return found
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    board = _device_tree_model()
    if board and "jetson" in board.lower():
        return [{"name": f"{board} (integrated, shares system memory)", "memory_bytes": None, "driver": None}]
    return []


def library_versions() -> dict[str, str | None]:
    """Installed versions from package metadata: reading them imports nothing."""
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def describe() -> dict:
    import psutil

    try:
        providers = __import__("onnxruntime").get_available_providers()
    except ImportError:
        providers = []
    return {
        "cpu": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_flags": cpu_flags(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "gpus": gpus(),
        "onnxruntime_providers": providers,
        "libraries": library_versions(),
        "python_executable": sys.executable,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def measure_bandwidth(mib: int = 512, repeats: int = 3, slices: int = 4) -> float:
    """Streaming read rate in bytes/s: numpy sum over a ``mib`` MiB float32 array, timed in ``slices`` parts
    (each well above a last-level cache at the default size), best part over ``repeats`` passes. Short
    timings are less likely to be cut by another process on a shared machine."""
    a = np.ones(max(1, mib) * 2**20 // 4, dtype=np.float32)
    a.sum()  # fault the pages in before timing
    n = max(1, a.size // slices)
    best = float("inf")
    for _ in range(repeats):
        for i in range(0, a.size - n + 1, n):
            part = a[i : i + n]
            t0 = time.perf_counter()
            part.sum()
            best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def measure_matmul(n: int = 1024, repeats: int = 5) -> float:
    """float32 matmul rate in FLOP/s: numpy (BLAS, all its threads) n x n @ n x n, best of ``repeats``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
