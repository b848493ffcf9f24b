"""Runtimes behind one Session API: ``open_session(artifact_dir, backend=...)``.

Backends: "onnxruntime" (base install), "torch" (train extra: the checkpoint stored in the artifact),
"tensorrt" (tensorrt extra, NVIDIA GPUs and Jetson). The backend is always chosen by argument.
``Streams(artifact_dir)`` (ONNX Runtime) decodes many independent streams in one graph call per token.
"""

from __future__ import annotations

import os

from edgeattn.artifact.manifest import Manifest
from edgeattn.runtimes.base import Session
from edgeattn.runtimes.streams import Streams

BACKENDS = ("onnxruntime", "torch", "tensorrt")


def open_session(
    artifact_dir: str | os.PathLike,
    backend: str = "onnxruntime",
    *,
    threads: int | None = None,
    device: str | None = None,
    cuda_graph: bool | None = None,
) -> Session:
    """A session on the artifact in ``artifact_dir``. ``cuda_graph`` (torch backend): steps as a CUDA graph,
    the default on CUDA for a fixed-size state (``TorchSession``); False keeps them eager."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if cuda_graph is not None and backend != "torch":
        raise ValueError(f"cuda_graph is an option of the torch backend, not of {backend!r}")
    manifest = Manifest.load(artifact_dir)
    if backend == "onnxruntime":
        from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession

        return OnnxRuntimeSession(manifest, threads=threads, device=device)
    if backend == "torch":
        from edgeattn.runtimes.torch import TorchSession

        return TorchSession(manifest, threads=threads, device=device, cuda_graph=cuda_graph)
    from edgeattn.runtimes.tensorrt import TensorRTSession

    return TensorRTSession(manifest, device=device)


__all__ = ["BACKENDS", "Session", "Streams", "open_session"]
