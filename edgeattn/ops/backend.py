"""The one place that chooses how an op runs: its form (``mode="auto"``) and its chunk implementation.

Forms. An op called with ``mode="auto"`` (what the layers call) runs, as ``choose_form`` decides:
"fused" while an export installed a contrib op for it (``use_contrib_ops``: the export for the
``onnxruntime`` target installs ``edgeattn.export.contrib``'s, which trace to one ONNX Runtime contrib node
each), "step" (the exported single-token function) for one token, "chunk" otherwise. Outside such an
export no contrib op is installed: ops never import the export code, they only look here.

Kernels. ``backend`` is "auto" (Triton for CUDA tensors when triton imports, PyTorch otherwise), "torch" or
"triton". The environment variable ``EDGEATTN_KERNELS`` sets the default; an explicit argument wins.
Nothing is chosen at import time: the choice is made per call, from the tensors' device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "EDGEATTN_KERNELS"

# The contrib ops installed by the export, by op name ("linear_attention", "delta_rule", "short_conv",
# "gated_delta_gates", "gated_rms_norm"); None outside an export for the onnxruntime target.
_CONTRIB: ContextVar[Mapping[str, Callable] | None] = ContextVar("edgeattn_contrib_ops", default=None)


@contextlib.contextmanager
def use_contrib_ops(ops: Mapping[str, Callable] | None) -> Iterator[None]:
    """Within this block the ops named in ``ops`` run (and trace) as the given implementations; None: none."""
    token = _CONTRIB.set(ops)
    try:
        yield
    finally:
        _CONTRIB.reset(token)


def contrib_op(name: str) -> Callable | None:
    """The installed contrib implementation of op ``name``, or None."""
    ops = _CONTRIB.get()
    return None if ops is None else ops.get(name)


def choose_form(mode: str, tokens: int, op: str) -> str:
    """The form a call runs: ``mode`` as given, or for "auto": "fused" while a contrib op ``op`` is
    installed, "step" for one token, "chunk" otherwise."""
    if mode != "auto":
        return mode
    if contrib_op(op) is not None:
        return "fused"
    return "step" if tokens == 1 else "chunk"


def resolve_backend(device_type: str, backend: str | None = None) -> str:
    """Return "torch" or "triton" for tensors on ``device_type``."""
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or {ENV_VAR}), got {choice!r}")
    if choice == "auto":
        if device_type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if choice == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ValueError("backend='triton' needs triton: pip install 'edgeattn[train]'") from e
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported"
            )
    return choice


def use_kernel(device_type: str, backend: str | None, uncovered: dict[str, bool], kernel: str) -> bool:
    """Whether a chunk-form call runs its Triton ``kernel``. ``uncovered`` maps each case the kernel does
    not handle ("an initial state", ...) to whether this call is in it. Such a call runs the PyTorch form,
    except with an explicit backend="triton", where it is a ValueError rather than a silent torch run."""
    if resolve_backend(device_type, backend) != "triton":
        return False
    missing = [name for name, bad in uncovered.items() if bad]
    if missing and backend == "triton":
        raise ValueError(f"the Triton {kernel} cannot take {', '.join(missing)}; use backend='torch'")
    return not missing
