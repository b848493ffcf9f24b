"""edgeattn's CPU attention kernel for ONNX Runtime sessions (``attention.cc``).

ONNX Runtime's CPU GroupQueryAttention reads each KV head once for every query head of its group (4 times
a token in Qwen3.5-0.8B); ``attention.cc`` reads each KV head once for the
group and splits a long context into slices across the threads. It is a custom-op library registered under
the op's own domain and name (``com.microsoft.GroupQueryAttention``), so a CPU session that registers it runs
it in place of ONNX Runtime's kernel for every float32-cache GroupQueryAttention of the graph, and the
artifact stays the stock graph that onnxruntime-genai, the browser and the C++ runtime run.

The library is built from the source on first use with the machine's g++ (``-march=native``: the vector
instructions of the CPU it runs on) against ONNX Runtime's C++ headers (``$ONNXRUNTIME_ROOT/include`` or the
ones ``scripts/fetch_onnxruntime_headers.sh`` unpacks into the repository's ``.third_party``), and cached in
``~/.cache/edgeattn`` by the source's hash, the flags and the CPU's instruction sets. Without g++ or the
headers, a session runs ONNX Runtime's own kernel and says why (``OnnxRuntimeSession.attention``).
``EDGEATTN_ATTENTION=onnxruntime`` turns it off.

The same library holds a kernel for ``com.microsoft.MatMulNBits`` (``matmul.cc``) in the form edgeattn's int4
exports take (4 bits, symmetric, blocks of 32-256, accuracy level 4): it reads the weights as ONNX Runtime
stores them, prefetched, where ONNX Runtime's AVX2 kernel decodes a token at about half the memory's read
rate; on AVX-512 VNNI CPUs its prefill tiles hold two columns a 512-bit register. A session registers it where
every MatMulNBits of its graphs has that form and the CPU is of a kind it was raced on and won (AVX2 and FMA,
AVX-VNNI, AVX-512 VNNI; not AMX CPUs or AVX-512 without VNNI, benchmarks/RESULTS.md);
``EDGEATTN_MATMUL=edgeattn`` or ``onnxruntime`` overrides the CPU's choice. The session config entry
``edgeattn.ops`` tells the library which of its kernels a session registers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("attention.cc")
SOURCES = (SOURCE, Path(__file__).with_name("matmul.cc"))  # one library
HEADERS = (Path(__file__).with_name("kernels.h"),)  # what they share (part of the build's key)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17"]
ENV = "EDGEATTN_ATTENTION"
CHOICES = ("edgeattn", "onnxruntime")
MATMUL_ENV = "EDGEATTN_MATMUL"
BLOCK_SIZES = (32, 64, 128, 256)  # the MatMulNBits block sizes matmul.cc takes (K a multiple of 64 too)

_lock = threading.Lock()
_built: dict[str, tuple[Path | None, str]] = {}


def headers() -> Path | None:
    """The directory holding ONNX Runtime's ``onnxruntime_lite_custom_op.h``, or None."""
    root = Path(__file__).resolve().parents[2]
    for d in (
        Path(os.environ["ONNXRUNTIME_ROOT"]) / "include" if os.environ.get("ONNXRUNTIME_ROOT") else None,
        root / ".third_party" / "debian" / "usr" / "include" / "onnxruntime",
    ):
        if d is not None and (d / "onnxruntime_lite_custom_op.h").is_file():
            return d
    return None


def chosen() -> str:
    """The kernel asked for: ``$EDGEATTN_ATTENTION`` (edgeattn, the default, or onnxruntime)."""
    value = os.environ.get(ENV, "edgeattn").strip().lower() or "edgeattn"
    if value not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def library(cache: Path | None = None) -> tuple[Path | None, str]:
    """(the built library, "") or (None, why not). Built once per process and cached on disk."""
    from edgeattn._cpu import cpu_flags

    inc = headers()
    if inc is None:
        return None, (
            "ONNX Runtime's C++ headers are not here (bash scripts/fetch_onnxruntime_headers.sh, or "
            "$ONNXRUNTIME_ROOT/include)"
        )
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        return None, "no C++ compiler (g++ or $CXX) to build it"
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    key = hashlib.sha256(src + " ".join([cxx, *FLAGS, str(inc), *cpu_flags(only=None)]).encode()).hexdigest()[
        :16
    ]
    with _lock:
        if key in _built:
            return _built[key]
        root = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeattn"
        out = root / f"libedgeattn_attention-{key}.so"
        if out.is_file():
            _built[key] = (out, "")
            return _built[key]
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                part = Path(tmp) / out.name
                res = subprocess.run(
                    [cxx, *FLAGS, f"-I{inc}", *map(str, SOURCES), "-o", str(part)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if res.returncode != 0:
                    last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
                    _built[key] = (None, f"{Path(cxx).name} could not build {SOURCE.name}: {last}")
                    return _built[key]
                os.replace(part, out)  # whole or not at all
        except (OSError, subprocess.SubprocessError) as e:
            _built[key] = (None, f"could not build {SOURCE.name}: {e}")
            return _built[key]
        _built[key] = (out, "")
        return _built[key]


def for_session(manifest, device: str) -> tuple[Path | None, str]:
    """The library for a session of ``manifest`` on ``device`` (None and why where it does not apply): a CPU
    session of a graph with float32 KV buffers (GroupQueryAttention), unless ``$EDGEATTN_ATTENTION`` says
    onnxruntime."""
    if chosen() == "onnxruntime":
        return None, f"{ENV}=onnxruntime"
    kv = [e for e in manifest.state if e.shared]
    if not kv:
        return None, "no KV buffer (no GroupQueryAttention)"
    if device != "cpu":
        return None, f"runs on {device}"
    other = sorted({str(e.dtype) for e in kv} - {"float32"})
    if other:
        return None, f"the KV buffer is {other[0]} (the kernel takes float32)"
    return library()


def matmul_chosen() -> tuple[str, str]:
    """(kernel, why) for MatMulNBits: ``$EDGEATTN_MATMUL`` (edgeattn or onnxruntime), else edgeattn's on the CPU
    kinds it was raced against ONNX Runtime's on and won (AVX2 and FMA without AVX-512, with AVX-VNNI, or with
    AVX-512 VNNI: benchmarks/RESULTS.md), ONNX Runtime's elsewhere (AMX CPUs and AVX-512 without VNNI: not
    raced there)."""
    from edgeattn._cpu import cpu_flags

    value = os.environ.get(MATMUL_ENV, "").strip().lower()
    if value:
        if value not in CHOICES:
            raise ValueError(f"{MATMUL_ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
        return value, f"{MATMUL_ENV}={value}"
    have = set(cpu_flags(only=None))
    if not {"avx2", "fma"} <= have:
        return "onnxruntime", "the CPU lacks AVX2 or FMA"
    if {"amx_int8", "amx_tile"} & have:
        return (
            "onnxruntime",
            f"an AMX CPU: not raced against ONNX Runtime's kernels there ({MATMUL_ENV}=edgeattn)",
        )
    if "avx512f" in have and not {"avx512bw", "avx512dq", "avx512_vnni"} <= have:
        return (
            "onnxruntime",
            f"AVX-512 without VNNI: not raced against ONNX Runtime's kernels there ({MATMUL_ENV}=edgeattn)",
        )
    return "edgeattn", ""


def matmul_unsupported(path: Path) -> str | None:
    """Why ``matmul.cc`` cannot take a MatMulNBits of the graph at ``path`` (None: it takes every one, and the
    graph has at least one). Reads the graph without its weights."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a graph ONNX Runtime will refuse anyway: its own error, later
        return f"cannot read {Path(path).name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    if not nodes:
        return "no MatMulNBits in the graph"
    for n in nodes:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        bs, k = a.get("block_size", 0), a.get("K", 0)
        if a.get("bits", 4) != 4:
            return f"{n.name}: {a.get('bits')} bits (the kernel takes 4)"
        if bs not in BLOCK_SIZES or k <= 0 or k % bs or k % 64:
            return (
                f"{n.name}: block_size {bs} with K {k} (the kernel takes {BLOCK_SIZES} dividing K, K of 64s)"
            )
        if a.get("accuracy_level", 0) != 4:
            return (
                f"{n.name}: accuracy_level {a.get('accuracy_level', 0)} (the kernel quantizes activations: 4)"
            )
        if len([i for i in n.input if i]) != 3 or len(n.input) != 3:
            return f"{n.name}: zero points, g_idx or bias (the kernel takes symmetric weights alone)"
    return None


def kernels_for_session(manifest, device: str, graphs) -> tuple[Path | None, dict, dict]:
    """(library, attention, matmul) for a session of ``manifest`` on ``device`` over the graph files
    ``graphs``: the library where one of its kernels applies (else None), and for each op {"kernel":
    "edgeattn"} or {"kernel": "onnxruntime", "why": ...}."""
    lib, why = for_session(manifest, device)
    attention = {"kernel": "edgeattn"} if lib is not None else {"kernel": "onnxruntime", "why": why}
    kind, why = matmul_chosen()
    if manifest.precision != "int4":
        kind, why = "onnxruntime", f"no MatMulNBits (precision {manifest.precision})"
    elif kind == "edgeattn" and device != "cpu":
        kind, why = "onnxruntime", f"runs on {device}"
    if kind == "edgeattn":
        why = next((w for w in (matmul_unsupported(p) for p in dict.fromkeys(graphs)) if w), "")
        kind = "onnxruntime" if why else kind
    if kind == "edgeattn" and lib is None:  # the library for MatMulNBits alone (built once either way)
        lib, why = library()
        kind = "edgeattn" if lib is not None else "onnxruntime"
    matmul = {"kernel": "edgeattn"} if kind == "edgeattn" else {"kernel": "onnxruntime", "why": why}
    return lib, attention, matmul


if __name__ == "__main__":  # python -m edgeattn.runtimes.attention: build the library, print its path
    import sys

    path, why = library()
    if path is None:
        sys.exit(f"error: {why}")
    print(path)
