"""TensorRT backend: TensorRT 10 (as in JetPack 6), device memory through cuda-python; no torch, no pycuda.

    sess = open_session(artifact_dir, backend="tensorrt")  # or TensorRTSession(manifest, device="cuda:0")

Engines. Each graph (step.onnx, prefill.onnx) becomes one engine: ``trt.OnnxParser`` into a network made with
``builder.create_network(0)`` (explicit batch is the only mode in TensorRT 10), a workspace memory-pool limit,
and the FP16 builder flag when the artifact is fp16 and the GPU has fast fp16. Building takes seconds to
minutes, so the serialized engine is cached (written atomically) under a name made of the graph's sha256,
the TensorRT version, the GPU name and the precision flag; an engine that no longer deserializes is rebuilt.
The cache lives in, first found: the ``cache_dir`` argument, ``$EDGEATTN_TENSORRT_CACHE``,
``<artifact>/tensorrt_engines/`` when the artifact directory is writable,
``$XDG_CACHE_HOME/edgeattn/tensorrt`` (``~/.cache/edgeattn/tensorrt``).

Memory. Every state tensor is allocated twice in device memory; ``binding_plan(manifest, graph, p)`` makes the
graph read buffer ``p`` and write buffer ``1 - p``. One execution context per graph; between calls only the
state tensors' addresses are re-pointed (``set_tensor_address``), so the state never leaves the GPU and is
never copied per token. Per call: token ids host -> device from a pinned buffer, ``execute_async_v3`` on the
session's stream, logits device -> pinned host, one stream synchronize. ``get_state``/``set_state``/``reset``
copy between host and device (``cudaMemcpyAsync``/``cudaMemsetAsync`` on the session's stream, then a
synchronize). Every CUDA and TensorRT call is checked; a failure raises RuntimeError naming the call.

Refused with ValueError (before TensorRT is imported): the ``onnxruntime`` target (its fused
com.microsoft.LinearAttention op would need a TensorRT plugin), int8 artifacts (ONNX Runtime's dynamic
quantization ops), the softmax KV-cache baseline (its state has a dynamic dimension), device "cpu".

The pure parts (refusal checks, device parsing, dtype mapping, cache naming, the binding plan) need neither
TensorRT nor a GPU; tests/test_tensorrt.py runs the session against fake ``tensorrt``/``cudart`` modules.
Every call holds the session's lock (``edgeattn.runtimes.base``: a session may be shared between threads);
``close()`` frees its device memory (also done when it is garbage collected).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np

from edgeattn._atomic import write_bytes
from edgeattn.artifact.manifest import Manifest, sha256_file
from edgeattn.runtimes.base import Session

GRAPHS = ("step", "prefill")
MISSING_MESSAGE = (
    "the tensorrt backend needs TensorRT 10 and cuda-python: pip install 'edgeattn[tensorrt]' "
    "(on Jetson, use the TensorRT that JetPack ships)"
)
CACHE_ENV = "EDGEATTN_TENSORRT_CACHE"
ENGINE_DIR = "tensorrt_engines"  # inside the artifact directory, when it is writable
DEFAULT_WORKSPACE_MB = 1024  # an upper bound for TensorRT's scratch memory, not an allocation

# TensorRT DataType names -> numpy (the engine's I/O dtypes; the names are stable across TensorRT 10.x)
_NUMPY_DTYPES = {
    "FLOAT": np.float32,
    "HALF": np.float16,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
    "UINT8": np.uint8,
}

# A reference to one buffer: ("ids", graph), ("logits", graph) or ("state", index in manifest.state, parity).
BufferRef = tuple


# ----------------------------------------------------------------------------------------------------------
# pure parts: no TensorRT, no GPU
# ----------------------------------------------------------------------------------------------------------


def check_supported(manifest: Manifest) -> None:
    """Raise ValueError for an artifact this backend cannot run."""
    if manifest.target != "portable":
        raise ValueError(
            f"{manifest.root} was exported with --target {manifest.target}: re-export with "
            "`--target portable`: TensorRT needs a plugin for com.microsoft.LinearAttention "
            "(that target's fused op)"
        )
    dynamic = [e.input for e in manifest.state if e.dynamic]
    if dynamic:
        raise ValueError(
            f"{manifest.root} is the softmax KV-cache baseline: its state grows with every token (dynamic "
            f"dimension in {dynamic[0]}), and the tensorrt backend runs fixed-size state only; use "
            "--backend onnxruntime, or a linear-attention or swa model"
        )
    if manifest.dynamic_batch:
        raise ValueError(
            f"{manifest.root} was exported with --dynamic-batch: the tensorrt backend builds static-shape "
            "engines; re-export without --dynamic-batch (--batch N fixes the batch)"
        )
    if manifest.precision == "int8":
        raise ValueError(
            f"{manifest.root} is int8: ONNX Runtime's dynamic quantization (MatMulInteger, "
            "DynamicQuantizeLinear) does not run on TensorRT; re-export with --precision fp16 or fp32"
        )
    wrong = [e.input for e in manifest.state if e.dtype != "float32"]
    if wrong:
        raise ValueError(f"state tensor {wrong[0]} is not float32; every edgeattn state tensor must be")


def parse_device(device: str | None) -> int:
    """CUDA device index from None, "cuda", "gpu" or "cuda:N"."""
    if device is None or device in ("cuda", "gpu"):
        return 0
    m = re.fullmatch(r"cuda:(\d+)", device)
    if m:
        return int(m.group(1))
    if device == "cpu":
        raise ValueError("the tensorrt backend runs on an NVIDIA GPU; for cpu use --backend onnxruntime")
    raise ValueError(f"device must be 'cuda' or 'cuda:N' for the tensorrt backend, got {device!r}")


def numpy_dtype(trt_dtype) -> np.dtype:
    """The numpy dtype of a TensorRT ``DataType`` (or of its name, e.g. "FLOAT")."""
    name = (
        trt_dtype if isinstance(trt_dtype, str) else getattr(trt_dtype, "name", str(trt_dtype).split(".")[-1])
    )
    if name not in _NUMPY_DTYPES:
        raise ValueError(f"TensorRT data type {name} has no numpy equivalent here")
    return np.dtype(_NUMPY_DTYPES[name])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "unknown"


def engine_file_name(graph: str, graph_sha256: str, trt_version: str, gpu_name: str, fp16: bool) -> str:
    """The cache file of one engine: an engine is valid for one graph, TensorRT version, GPU and precision."""
    precision = "fp16" if fp16 else "fp32"
    return f"{graph}-{graph_sha256}-trt{_slug(trt_version)}-{_slug(gpu_name)}-{precision}.engine"


def default_cache_dir(artifact_root: str | os.PathLike) -> Path:
    """``$EDGEATTN_TENSORRT_CACHE``, else ``<artifact>/tensorrt_engines`` if writable, else the user cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = Path(artifact_root)
    if os.access(root, os.W_OK):
        return root / ENGINE_DIR
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edgeattn" / "tensorrt"


def graph_tokens(manifest: Manifest, graph: str) -> int:
    return 1 if graph == "step" else manifest.prefill_tokens


def io_spec(manifest: Manifest, graph: str) -> dict[str, tuple[bool, tuple[int, ...], str]]:
    """Every I/O tensor of ``graph``: name -> (is_input, shape, kind); kind is "ids", "logits" or "state"."""
    B, T, V = manifest.batch_size, graph_tokens(manifest, graph), manifest.vocab_size
    spec = {
        manifest.input_ids_name: (True, (B, T), "ids"),
        manifest.logits_name: (False, (B, T, V), "logits"),
    }
    for e in manifest.state:
        spec[e.input] = (True, tuple(e.shape), "state")
        spec[e.output] = (False, tuple(e.shape), "state")
    if len(spec) != 2 + 2 * len(manifest.state):
        raise ValueError(f"{manifest.root}: the manifest gives two graph tensors the same name")
    return spec


def binding_plan(manifest: Manifest, graph: str, parity: int) -> dict[str, BufferRef]:
    """The buffer of each I/O tensor of ``graph`` while the current state lives in buffers ``parity``:
    state inputs read ``("state", i, parity)``, state outputs write ``("state", i, 1 - parity)``."""
    if parity not in (0, 1):
        raise ValueError(f"parity must be 0 or 1, got {parity}")
    plan = {manifest.input_ids_name: ("ids", graph), manifest.logits_name: ("logits", graph)}
    for i, e in enumerate(manifest.state):
        plan[e.input] = ("state", i, parity)
        plan[e.output] = ("state", i, 1 - parity)
    if len(plan) != 2 + 2 * len(manifest.state):
        raise ValueError(f"{manifest.root}: the manifest gives two graph tensors the same name")
    return plan


_ENGINE_DTYPES = {"ids": (np.int64, np.int32), "logits": (np.float32, np.float16), "state": (np.float32,)}


def check_engine_io(graph: str, engine_io: dict[str, tuple[bool, np.dtype, tuple]], spec: dict) -> None:
    """Compare an engine's I/O (name -> (is_input, dtype, shape)) with the manifest's ``io_spec``."""
    missing, extra = sorted(set(spec) - set(engine_io)), sorted(set(engine_io) - set(spec))
    if missing or extra:
        raise RuntimeError(
            f"the {graph} engine's I/O tensors differ from the manifest: missing {missing}, extra {extra}"
        )
    for name, (is_input, shape, kind) in spec.items():
        got_input, dtype, got_shape = engine_io[name]
        if got_input != is_input:
            raise RuntimeError(
                f"{graph} engine: {name} is an {'input' if got_input else 'output'}, the manifest disagrees"
            )
        if tuple(got_shape) != tuple(shape):
            raise RuntimeError(
                f"{graph} engine: {name} has shape {list(got_shape)}, the manifest says {list(shape)} "
                "(the tensorrt backend needs static shapes)"
            )
        if dtype not in _ENGINE_DTYPES[kind]:
            raise RuntimeError(
                f"{graph} engine: {name} is {np.dtype(dtype).name}, expected one of "
                f"{[np.dtype(d).name for d in _ENGINE_DTYPES[kind]]}"
            )


def _version_major(version: str) -> int:
    m = re.match(r"\d+", version)
    return int(m.group()) if m else 0


# ----------------------------------------------------------------------------------------------------------
# TensorRT and CUDA
# ----------------------------------------------------------------------------------------------------------


def _import_backends():
    """(tensorrt, cudart) or the one-line ValueError the CLI prints."""
    try:
        import tensorrt as trt

        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # older cuda-python
    except ImportError as e:
        raise ValueError(MISSING_MESSAGE) from e
    version = getattr(trt, "__version__", "0")
    if _version_major(version) < 10:
        raise ValueError(f"{MISSING_MESSAGE}; found TensorRT {version}")
    return trt, cudart


_LOGGER: tuple | None = None  # (tensorrt module, logger): TensorRT wants one logger per process


def _logger(trt):
    """A TensorRT logger that prints warnings and errors to stderr and remembers errors for our messages."""
    global _LOGGER
    if _LOGGER is not None and _LOGGER[0] is trt:
        return _LOGGER[1]

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.last_error = ""
            self.n_errors = 0

        def log(self, severity, msg):
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                self.last_error = str(msg)
                self.n_errors += 1
            if level <= int(trt.ILogger.Severity.WARNING):
                print(f"[TensorRT] {getattr(severity, 'name', severity)}: {msg}", file=sys.stderr)

    _LOGGER = (trt, _Logger())
    return _LOGGER[1]


class TensorRTSession(Session):
    backend = "tensorrt"

    def __init__(
        self,
        manifest: Manifest,
        *,
        device: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        workspace_mb: int = DEFAULT_WORKSPACE_MB,
        rebuild: bool = False,
    ):
        super().__init__(manifest)
        check_supported(manifest)
        self.device_index = parse_device(device)
        self.device = f"cuda:{self.device_index}"
        trt, cudart = _import_backends()
        self._trt, self._cudart = trt, cudart
        self._log = _logger(trt)
        self._errors_seen = self._log.n_errors
        # Everything close() releases, created empty first so that a failed __init__ can release what it made.
        self._stream = None
        self._device_ptrs: list[int] = []
        self._host_ptrs: list[int] = []
        # ("ids" | "logits", graph) -> a numpy view of its pinned host buffer
        self._host: dict[tuple[str, str], np.ndarray] = {}
        self._contexts: dict = {}
        self._engines: dict = {}
        self._runtime = None
        try:
            self._setup(
                Path(cache_dir) if cache_dir is not None else default_cache_dir(manifest.root),
                workspace_mb,
                rebuild,
            )
        except BaseException:
            self.close()
            raise

    # ---- setup ----

    def _setup(self, cache_dir: Path, workspace_mb: int, rebuild: bool) -> None:
        trt, m = self._trt, self.manifest
        self._cuda("cudaSetDevice", self.device_index)
        props = self._cuda("cudaGetDeviceProperties", self.device_index)
        name = props.name
        self.gpu_name = (
            (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\x00").strip()
        )
        self.trt_version = trt.__version__
        self.cache_dir = cache_dir
        self._workspace = int(workspace_mb) << 20
        self._stream = self._cuda("cudaStreamCreate")
        self._stream_handle = int(self._stream)
        self._runtime = self._check("trt.Runtime", trt.Runtime(self._log))

        self.engine_paths: dict[str, Path] = {}
        self.engine_sources: dict[str, str] = {}  # graph -> "cache" | "built"
        engine_io = {}
        for g in GRAPHS:
            self._engines[g] = self._load_engine(g, rebuild)
            engine_io[g] = self._engine_io(self._engines[g])
            check_engine_io(g, engine_io[g], io_spec(m, g))
            self._contexts[g] = self._check(
                "create_execution_context", self._engines[g].create_execution_context()
            )

        # Two device buffers per state tensor, one ids and one logits buffer per graph (device + pinned host).
        self._state_bufs = [
            [self._malloc(self._nbytes(e.shape, np.float32)) for _ in range(2)] for e in m.state
        ]
        buffers: dict[BufferRef, int] = {}
        for g in GRAPHS:
            for kind, name in (("ids", m.input_ids_name), ("logits", m.logits_name)):
                _, dtype, shape = engine_io[g][name]
                nbytes = self._nbytes(shape, dtype)
                buffers[(kind, g)] = self._malloc(nbytes)
                host_ptr = self._cuda("cudaMallocHost", nbytes)
                self._host_ptrs.append(host_ptr)
                self._host[(kind, g)] = _host_view(host_ptr, shape, dtype)
        for i, bufs in enumerate(self._state_bufs):
            buffers[("state", i, 0)], buffers[("state", i, 1)] = bufs
        self._buffers = buffers

        # ids and logits are bound once; the state addresses for each parity are kept to re-point per call.
        self._state_addresses = {}
        self._bound: dict[str, int] = {}
        for g in GRAPHS:
            for p in (0, 1):
                plan = binding_plan(m, g, p)
                self._state_addresses[(g, p)] = [
                    (n, buffers[ref]) for n, ref in plan.items() if ref[0] == "state"
                ]
            for name, ref in binding_plan(m, g, 0).items():
                if ref[0] != "state":
                    self._set_address(g, name, buffers[ref])
            self._bind_state(g, 0)
        self._cur = 0  # the current state lives in buffers self._cur
        self._reset_state()

    def _load_engine(self, graph: str, rebuild: bool):
        """Deserialize the cached engine of ``graph``, or build it and cache it."""
        trt, m = self._trt, self.manifest
        info = m.data.get("files", {}).get(m.data["graphs"][graph]["path"], {})
        sha = info.get("sha256") or sha256_file(m.graph_path(graph))
        if m.weights:  # the graph names its weights by byte range only: the engine depends on their file too
            w = m.data.get("files", {}).get(m.weights["path"], {}).get("sha256")
            w = w or sha256_file(m.root / m.weights["path"])
            sha = hashlib.sha256(f"{sha}:{w}".encode()).hexdigest()
        fp16 = m.precision == "fp16"
        path = self.cache_dir / engine_file_name(graph, sha, trt.__version__, self.gpu_name, fp16)
        self.engine_paths[graph] = path
        if not rebuild and path.is_file():
            engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is not None:
                self.engine_sources[graph] = "cache"
                return engine
            warnings.warn(
                f"the cached TensorRT engine {path} does not deserialize; rebuilding it", stacklevel=3
            )
        data = self._build(graph, fp16)
        try:
            write_bytes(path, data)
        except OSError as e:
            warnings.warn(f"cannot cache the TensorRT engine in {path.parent}: {e}", stacklevel=3)
        self.engine_sources[graph] = "built"
        return self._check("deserialize_cuda_engine", self._runtime.deserialize_cuda_engine(data))

    def _build(self, graph: str, fp16: bool) -> bytes:
        trt, path = self._trt, self.manifest.graph_path(graph)
        # Minutes on a Jetson: say so once, on stderr (stdout may be generated text).
        print(
            f"edgeattn: building the TensorRT engine of {path.name}, cached in {self.cache_dir}",
            file=sys.stderr,
        )
        builder = self._check("trt.Builder", trt.Builder(self._log))
        network = self._check("create_network", builder.create_network(0))
        parser = self._check("trt.OnnxParser", trt.OnnxParser(network, self._log))
        if not parser.parse_from_file(str(path)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)] or ["(no error reported)"]
            raise ValueError(
                f"TensorRT's ONNX parser rejected {path} ({len(errors)} error(s)): {errors[0]}\n"
                + "\n".join(errors)
            )
        config = self._check("create_builder_config", builder.create_builder_config())
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self._workspace)
        if fp16 and getattr(builder, "platform_has_fast_fp16", True):
            config.set_flag(trt.BuilderFlag.FP16)
        serialized = self._check(
            f"build_serialized_network ({graph})", builder.build_serialized_network(network, config)
        )
        return bytes(serialized)

    def _engine_io(self, engine) -> dict[str, tuple[bool, np.dtype, tuple]]:
        trt = self._trt
        io = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            io[name] = (
                is_input,
                numpy_dtype(engine.get_tensor_dtype(name)),
                tuple(engine.get_tensor_shape(name)),
            )
        return io

    # ---- helpers ----

    def _cuda(self, call: str, *args):
        """Call ``cudart.<call>`` and check its status; return the value(s) after the status."""
        cudart = self._cudart
        out = getattr(cudart, call)(*args)
        out = out if isinstance(out, tuple) else (out,)
        err = out[0]
        if err != cudart.cudaError_t.cudaSuccess:
            try:
                name = cudart.cudaGetErrorName(err)[1]
                name = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:  # the error name is a courtesy; the failure is what matters
                name = str(err)
            raise RuntimeError(f"{call} failed: {name}")
        rest = out[1:]
        return rest[0] if len(rest) == 1 else (rest or None)

    def _check(self, call: str, result):
        """TensorRT returns None or False on failure and logs why: the message quotes its latest new error."""
        if result is None or result is False:
            new = self._log.n_errors > self._errors_seen
            self._errors_seen = self._log.n_errors
            why = f": {self._log.last_error}" if new else " (see the TensorRT log)"
            raise RuntimeError(f"TensorRT {call} failed{why}")
        return result

    @staticmethod
    def _nbytes(shape, dtype) -> int:
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

    def _malloc(self, nbytes: int) -> int:
        ptr = self._cuda("cudaMalloc", nbytes)
        self._device_ptrs.append(ptr)
        return ptr

    def _set_address(self, graph: str, name: str, ptr: int) -> None:
        self._check(f"set_tensor_address({name!r})", self._contexts[graph].set_tensor_address(name, ptr))

    def _bind_state(self, graph: str, parity: int) -> None:
        for name, ptr in self._state_addresses[(graph, parity)]:
            self._set_address(graph, name, ptr)
        self._bound[graph] = parity

    def _memcpy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        self._cuda(
            "cudaMemcpyAsync", dst, src, nbytes, getattr(self._cudart.cudaMemcpyKind, kind), self._stream
        )

    def _sync(self) -> None:
        self._cuda("cudaStreamSynchronize", self._stream)

    # ---- the Session backend ----

    def _open(self) -> None:
        if self._cudart is None:
            raise RuntimeError("this TensorRT session is closed")

    def _run(self, graph: str, ids: np.ndarray) -> np.ndarray:
        self._open()
        host_ids, host_logits = self._host[("ids", graph)], self._host[("logits", graph)]
        host_ids[...] = ids  # cast to the engine's id dtype
        if self._bound[graph] != self._cur:
            self._bind_state(graph, self._cur)
        self._memcpy(
            self._buffers[("ids", graph)], host_ids.ctypes.data, host_ids.nbytes, "cudaMemcpyHostToDevice"
        )
        self._check(
            f"execute_async_v3 ({graph})", self._contexts[graph].execute_async_v3(self._stream_handle)
        )
        self._memcpy(
            host_logits.ctypes.data,
            self._buffers[("logits", graph)],
            host_logits.nbytes,
            "cudaMemcpyDeviceToHost",
        )
        self._sync()
        self._cur = 1 - self._cur
        return host_logits.astype(np.float32)  # a copy: the pinned buffer is reused by the next call

    def _get_state(self) -> dict[str, np.ndarray]:
        self._open()
        out = {}
        for e, bufs in zip(self.manifest.state, self._state_bufs):
            arr = np.empty(e.shape, np.float32)
            self._memcpy(arr.ctypes.data, bufs[self._cur], arr.nbytes, "cudaMemcpyDeviceToHost")
            out[e.input] = arr
        self._sync()
        return out

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        self._open()
        keep = []  # the host arrays must live until the copies are done
        for e, bufs in zip(self.manifest.state, self._state_bufs):
            arr = np.ascontiguousarray(state[e.input], dtype=np.float32)
            keep.append(arr)
            self._memcpy(bufs[self._cur], arr.ctypes.data, arr.nbytes, "cudaMemcpyHostToDevice")
        self._sync()

    def _reset_state(self) -> None:
        self._open()
        for e, bufs in zip(self.manifest.state, self._state_bufs):
            self._cuda("cudaMemsetAsync", bufs[self._cur], 0, self._nbytes(e.shape, np.float32), self._stream)
        self._sync()

    # ---- cleanup ----

    def close(self) -> None:
        """Free the engines, device and pinned memory and the stream (idempotent)."""
        if getattr(self, "_cudart", None) is None:
            return
        self._host = {}  # views of pinned memory, dropped before it is freed
        self._contexts.clear()
        self._engines.clear()
        self._runtime = None
        first_error = None
        releases = [("cudaStreamSynchronize", self._stream)] if self._stream is not None else []
        releases += [("cudaFree", p) for p in self._device_ptrs] + [
            ("cudaFreeHost", p) for p in self._host_ptrs
        ]
        releases += [("cudaStreamDestroy", self._stream)] if self._stream is not None else []
        self._device_ptrs, self._host_ptrs, self._stream = [], [], None
        for call, arg in releases:
            try:
                self._cuda(call, arg)
            except RuntimeError as e:  # release the rest, then report the first failure
                first_error = first_error or e
        self._cudart = None
        if first_error is not None:
            raise first_error

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _host_view(ptr: int, shape, dtype) -> np.ndarray:
    """A numpy array over ``nbytes`` of pinned host memory at ``ptr`` (no copy)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = (ctypes.c_byte * (n * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
