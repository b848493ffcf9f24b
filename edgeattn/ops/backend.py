"""The one place that chooses between the PyTorch chunk forms and the Triton kernels.

``backend`` is "auto" (Triton for CUDA tensors when triton imports, PyTorch otherwise), "torch" or
"triton". The environment variable ``EDGEATTN_KERNELS`` sets the default; an explicit argument wins.
Nothing is chosen at import time: the choice is made per call, from the tensors' device.
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "EDGEATTN_KERNELS"


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
