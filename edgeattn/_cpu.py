"""The CPU this process runs on: its name, its instruction-set flags and the kind of kernels they give
(``cpu_kind``). Standard library only: every layer may import it (``edgeattn check`` names the CPU it ran
on; every benchmark's JSON line carries ``cpu_record()``, ``edgeattn.bench.machine.with_cpu``)."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo on x86, the device-tree model on Jetson and other ARM boards."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    board = _device_tree_model()
    return board or platform.processor() or platform.machine()


def _device_tree_model() -> str | None:
    try:
        with open("/proc/device-tree/model", "rb") as f:
            return f.read().rstrip(b"\0").decode(errors="replace").strip() or None
    except OSError:
        return None


# The instruction-set flags (as /proc/cpuinfo spells them) that change which kernels ONNX Runtime's MLAS,
# llama.cpp's ggml and torch pick on x86-64, and so the speed and the low bits of the results.
ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
)


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's ISA_FLAGS that the kernel reports (x86 ``flags``, ARM ``Features``), in ISA_FLAGS' order."""
    try:
        with open(path) as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in have]
    except OSError:
        pass
    return []


def cpu_kind(flags: list[str] | None = None) -> str:
    """One word for the int8 and float kernels this CPU gets: ``amx`` (AMX tiles, AVX-512 VNNI),
    ``avx512-vnni``, ``avx-vnni`` (AVX2 with VNNI), ``avx512`` (no VNNI: int8 through 16-bit sums),
    ``avx2``, ``arm64-dotprod``, ``arm64``, else the machine name. Figures of different kinds are never
    compared."""
    have = set(cpu_flags() if flags is None else flags)
    for kind, need in (
        ("amx", {"amx_int8", "amx_tile"}),
        ("avx512-vnni", {"avx512_vnni"}),
        ("avx-vnni", {"avx_vnni", "avx2"}),
        ("avx512", {"avx512bw"}),
        ("avx2", {"avx2"}),
        ("arm64-dotprod", {"asimddp"}),
        ("arm64", {"asimd"}),
    ):
        if need <= have:
            return kind
    return platform.machine() or "unknown"


def cpu_record() -> dict:
    """What every benchmark's JSON line carries about the CPU: its model, kind and ISA flags."""
    flags = cpu_flags()
    return {"model": cpu_model(), "kind": cpu_kind(flags), "flags": flags}
