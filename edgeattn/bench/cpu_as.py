"""Run a command on this x86-64 CPU as a CPU of a smaller kind: AVX-512, VNNI and AMX hidden from CPUID.

ONNX Runtime's MLAS, llama.cpp's ggml, torch and numpy pick their kernels from CPUID. ``cpu_as.c``,
loaded with LD_PRELOAD, turns on Linux's CPUID faulting and answers each CPUID with those bits cleared,
so the command runs the kernels an AVX2-only CPU (an AMD EPYC of Zen 2/3's kind) gets, natively and at
full speed, where ``qemu-x86_64 -cpu max`` runs them 10-100x slower. It needs a CPU with CPUID faulting
(``cpuid_fault`` in /proc/cpuinfo: Intel's since Ivy Bridge, also under KVM) and gcc.

What it is not: that other CPU. The cores, caches and memory stay this machine's, so a figure measured
this way says which kernels an AVX2 CPU runs and how they compare with each other here, not how fast an
EPYC runs them; ``edgeattn._cpu`` names the CPU "<model> as avx2 (...)" in every record made under it.

    python -m edgeattn.bench.cpu_as avx2 -- python benchmarks/imported.py ...
    python -m edgeattn.bench.cpu_as --check            # can this machine do it (exit 0) or why not (exit 2)

``avx-vnni`` keeps AVX-VNNI (an Intel client CPU's kind). The glibc in the process picked its string
functions before the library loads; GLIBC_TUNABLES hides AVX-512 from those too.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from edgeattn._cpu import HIDDEN, cpu_flags
from edgeattn.bench.args import ArgumentParser

SOURCE = Path(__file__).with_name("cpu_as.c")
KINDS = tuple(HIDDEN)
GLIBC_HIDE = "glibc.cpu.hwcaps=-AVX512F,-AVX512CD,-AVX512BW,-AVX512DQ,-AVX512VL,-AVX512ER,-AVX512PF"


class CpuAsError(RuntimeError):
    """This machine cannot narrow its CPUID (no CPUID faulting, not x86-64 Linux, no compiler)."""


def unavailable(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """Why this machine cannot run a command through cpu_as, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"cpu_as needs x86-64 Linux (this is {sys.platform} on {platform.machine()})"
    if "cpuid_fault" not in cpu_flags(cpuinfo, only=None):
        return (
            "cpu_as needs CPUID faulting, and this CPU or kernel has none (no cpuid_fault in /proc/cpuinfo)"
        )
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
        return "cpu_as builds its library with a C compiler, and there is none (gcc, cc or $CC)"
    return None


def library(cache: Path | None = None) -> Path:
    """The shared library, built from cpu_as.c on first use (cached by the source's hash)."""
    why = unavailable()
    if why:
        raise CpuAsError(why)
    src = SOURCE.read_bytes()
    root = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeattn"
    out = root / f"libcpu_as-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if out.is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC") or shutil.which("gcc") or "cc"
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        part = Path(tmp) / out.name
        res = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(part), str(SOURCE)], capture_output=True, text=True
        )
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CpuAsError(f"cpu_as: {cc} could not build {SOURCE.name}: {last}")
        os.replace(part, out)  # whole or not at all
    return out


def environ(kind: str, env: dict | None = None) -> dict:
    """``env`` (default os.environ) for a process whose CPUID reports ``kind``."""
    if kind not in KINDS:
        raise CpuAsError(f"cpu_as: the kind must be one of {', '.join(KINDS)}, got {kind!r}")
    env = dict(os.environ if env is None else env)
    lib = str(library())
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "libcpu_as" not in p]
    env["LD_PRELOAD"] = ":".join([lib, *preload])
    env["EDGEATTN_CPU_AS"] = kind
    tunables = [
        t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.cpu.hwcaps")
    ]
    env["GLIBC_TUNABLES"] = ":".join([*tunables, GLIBC_HIDE])
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = ArgumentParser(
        prog="python -m edgeattn.bench.cpu_as",
        usage="python -m edgeattn.bench.cpu_as {avx2,avx-vnni} -- COMMAND [ARGS...] | --check",
        description="Run COMMAND with AVX-512, VNNI and AMX hidden from CPUID (see the module's docstring).",
    )
    ap.add_argument(
        "--check", action="store_true", help="say whether this machine can (exit 0) or why not (2)"
    )
    ap.add_argument("kind", nargs="?", choices=KINDS)
    split = argv.index("--") if "--" in argv else len(argv)
    args, cmd = ap.parse_args(argv[:split]), argv[split + 1 :]
    if args.check:
        why = unavailable()
        print(why or "cpu_as: this machine can hide AVX-512, VNNI and AMX from CPUID", file=sys.stderr)
        return 2 if why else 0
    if args.kind is None or not cmd:
        ap.error(
            "give a kind and a command after --: python -m edgeattn.bench.cpu_as avx2 -- COMMAND [ARGS...]"
        )
    try:
        env = environ(args.kind)
    except CpuAsError as exc:
        ap.error(str(exc))
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"error: cpu_as cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
