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
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17"]
ENV = "EDGEATTN_ATTENTION"
CHOICES = ("edgeattn", "onnxruntime")

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
    src = SOURCE.read_bytes()
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
                    [cxx, *FLAGS, f"-I{inc}", str(SOURCE), "-o", str(part)],
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
