"""Optional dependencies: import them with a message that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

_EXTRA = {
    "torch": "train",
    "triton": "train",
    "onnx": "train",
    "onnxscript": "train",
    "safetensors": "train",
    "matplotlib": "bench",
    "tensorrt": "tensorrt",
    "tokenizers": "tokenizers",
    "jinja2": "tokenizers",
    "fastapi": "serve",
    "uvicorn": "serve",
    "sse_starlette": "serve",
    "starlette": "serve",
    "llguidance": "serve",
    "ray": "ray",
}


class MissingDependency(ImportError):
    pass


def _message(module: str, extra: str) -> str:
    return f"{module} is needed for this; install it with: pip install 'edgeattn[{extra}]'"


def missing_message(module: str) -> str | None:
    """What to install for the optional dependency ``module``; None if it is not one of edgeattn's."""
    extra = _EXTRA.get(module.split(".")[0])
    return None if extra is None else _message(module, extra)


def require(module: str) -> ModuleType:
    """Import ``module`` or raise an ImportError saying which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(_message(module, _EXTRA.get(module.split(".")[0], "train"))) from e
