"""The CPU this process runs on: its name, its instruction-set flags and the kind of kernels they give
(``cpu_kind``). Standard library only: every layer may import it (``edgeattn check`` names the CPU it ran
on; every benchmark's JSON line carries ``cpu_record()``, ``edgeattn.bench.machine.with_cpu``).

A process run through ``edgeattn.bench.cpu_as`` sees a CPU whose CPUID hides AVX-512, VNNI and AMX: its
flags here are the ones that CPUID reports (``HIDDEN`` removed) and its model says so, so that no figure
measured that way is taken for one of the real CPU kind."""

from __future__ import annotations

import os
import platform

# What edgeattn.bench.cpu_as hides from CPUID, by the kind it makes of the CPU (/proc/cpuinfo's spelling)
_AVX512 = (
    "avx512f",
    "avx512dq",
    "avx512ifma",
    "avx512pf",
    "avx512er",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512_bitalg",
    "avx512_vpopcntdq",
    "avx512_4vnniw",
    "avx512_4fmaps",
    "avx512_vp2intersect",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
    "amx_fp16",
    "avx_ifma",
    "avx_vnni_int8",
    "avx_ne_convert",
)
HIDDEN = {"avx2": frozenset(_AVX512 + ("avx_vnni",)), "avx-vnni": frozenset(_AVX512)}


def cpu_as() -> str | None:
    """The kind this process's CPUID was narrowed to by ``edgeattn.bench.cpu_as`` (``avx2``,
    ``avx-vnni``), or None. Trusted only with its library mapped into this process: the variable alone,
    inherited by a process that does not load it, says nothing."""
    kind = os.environ.get("EDGEATTN_CPU_AS_ACTIVE")
    if kind not in HIDDEN:
        return None
    try:
        with open("/proc/self/maps") as f:
            return kind if any("libcpu_as" in line for line in f) else None
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo on x86, the device-tree model on Jetson and other ARM boards; under
    ``cpu_as`` followed by what it hides."""
    name = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or _device_tree_model() or platform.processor() or platform.machine()
    narrowed = cpu_as()
    if narrowed:
        shown = "AVX-512 and AMX" if narrowed == "avx-vnni" else "AVX-512, VNNI and AMX"
        name += f" as {narrowed} ({shown} hidden from CPUID by edgeattn.bench.cpu_as)"
    return name


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


def cpu_flags(path: str = "/proc/cpuinfo", only: tuple[str, ...] | None = ISA_FLAGS) -> list[str]:
    """The CPU's ISA_FLAGS (all its flags with ``only=None``) that the kernel reports (x86 ``flags``, ARM
    ``Features``), in ISA_FLAGS' (the kernel's) order; under ``cpu_as`` less what it hides (this CPU's own
    /proc/cpuinfo only: another file describes another CPU)."""
    hidden = HIDDEN.get(cpu_as(), frozenset()) if path == "/proc/cpuinfo" else frozenset()
    try:
        with open(path) as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    have = [x for x in line.split(":", 1)[1].split() if x not in hidden]
                    return have if only is None else [flag for flag in only if flag in set(have)]
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
