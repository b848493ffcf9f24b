"""TensorRT backend (edgeattn.runtimes.tensorrt) without TensorRT: pure parts, and the session on fakes.

The real TensorRT path is NOT exercised in CI: this machine has no NVIDIA GPU and TensorRT cannot be
installed, so no test here builds a real engine, touches real device memory or checks fp16 numerics on a GPU.
The calls' names and argument order are written against the TensorRT 10 and cuda-python documentation, and
the fakes below mirror them; only a GPU run proves them (``test_real_tensorrt_matches_onnxruntime`` does; it
is skipped unless ``tensorrt``, ``cuda-python`` and a CUDA device are there).

What runs here:
- the pure parts: refusal checks, device parsing, dtype mapping, the engine cache's file names and directory,
  atomic writes, the binding plan for both buffer parities, the engine I/O check;
- the one-line error without TensorRT (``open_session`` and the CLI);
- the session's own control flow against fake ``tensorrt`` and ``cudart`` modules put in ``sys.modules``.
  ``FakeCudart`` keeps "device memory" in numpy byte arrays (real host addresses, registered as device
  allocations, filled with NaN bytes like uninitialised memory); its copies check direction and bounds, and
  its async calls wait in a per-stream queue until ``cudaStreamSynchronize``, so a missing synchronize reads
  stale data. The fake ``tensorrt`` parser refuses ops outside the TensorRT 10 list
  (``edgeattn.export.compat``); its "serialized engine" is a header plus the ONNX bytes; its
  ``execute_async_v3`` checks that every I/O tensor is bound to a large-enough device buffer with no
  input/output aliasing, reads the addresses at enqueue time and, when the stream runs, executes the graph
  with onnxruntime on the bound buffers. So engine build/cache/deserialize, address binding, the two-buffer
  state swap, prefill/step, get/set/reset state and the error paths all run, and the logits are compared with
  the onnxruntime session on exported artifacts.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import json
import os
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from edgeattn.export.manifest import Manifest
from edgeattn.runtimes import open_session
from edgeattn.runtimes import tensorrt as rt
from edgeattn.runtimes.tensorrt import (
    MISSING_MESSAGE,
    TensorRTSession,
    binding_plan,
    check_engine_io,
    default_cache_dir,
    engine_file_name,
    io_spec,
    numpy_dtype,
    parse_device,
)

SHA = "0123456789abcdef" * 4


# ----------------------------------------------------------------------------------------------------------
# fake cuda-python runtime
# ----------------------------------------------------------------------------------------------------------


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidResourceHandle = 400


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class FakeStream:
    def __init__(self, handle: int):
        self.handle = handle
        self.queue: list = []

    def __int__(self):
        return self.handle


class FakeCudart(types.ModuleType):
    """The slice of ``cuda.bindings.runtime`` the session uses; every call returns ``(error, *values)``."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind

    def __init__(self, gpu_name: str = "Fake GPU 9000", n_devices: int = 1):
        super().__init__("cuda.bindings.runtime")
        self.gpu_name = gpu_name
        self.n_devices = n_devices
        self.device_mem: dict[int, np.ndarray] = {}
        self.pinned: dict[int, np.ndarray] = {}
        self.streams: dict[int, FakeStream] = {}
        self.calls: collections.Counter = collections.Counter()
        self.copies: list[str] = []  # the kind of every memcpy
        self.fail: dict[str, cudaError_t] = {}  # call name -> the error it returns

    def _enter(self, name):
        self.calls[name] += 1
        return self.fail.get(name)

    @staticmethod
    def _find(table, addr, nbytes):
        for base, arr in table.items():
            if base <= addr < base + arr.nbytes:
                return addr + nbytes <= base + arr.nbytes
        return None

    def region(self, addr: int, nbytes: int) -> str:
        """'device', 'pinned' or 'host' (pageable, unchecked); 'bad' for a range past an allocation's end."""
        for name, table in (("device", self.device_mem), ("pinned", self.pinned)):
            inside = self._find(table, addr, nbytes)
            if inside is not None:
                return name if inside else "bad"
        return "host"

    def _stream(self, stream):
        return self.streams.get(int(stream))

    def _flush(self, stream=None):
        for s in [stream] if stream is not None else list(self.streams.values()):
            while s.queue:
                s.queue.pop(0)()

    # device and properties
    def cudaSetDevice(self, device):
        if err := self._enter("cudaSetDevice"):
            return (err,)
        return (
            cudaError_t.cudaSuccess if 0 <= device < self.n_devices else cudaError_t.cudaErrorInvalidDevice,
        )

    def cudaGetDeviceProperties(self, device):
        if err := self._enter("cudaGetDeviceProperties"):
            return (err, None)
        return (cudaError_t.cudaSuccess, types.SimpleNamespace(name=self.gpu_name.encode() + b"\x00" * 8))

    def cudaGetErrorName(self, err):
        return (cudaError_t.cudaSuccess, cudaError_t(err).name.encode())

    # memory
    def cudaMalloc(self, nbytes):
        if err := self._enter("cudaMalloc"):
            return (err, 0)
        arr = np.full(max(int(nbytes), 1), 0xFF, np.uint8)  # NaN bytes: uninitialised memory
        self.device_mem[arr.ctypes.data] = arr
        return (cudaError_t.cudaSuccess, arr.ctypes.data)

    def cudaFree(self, ptr):
        if err := self._enter("cudaFree"):
            return (err,)
        self._flush()
        return (
            cudaError_t.cudaSuccess
            if self.device_mem.pop(ptr, None) is not None
            else cudaError_t.cudaErrorInvalidValue,
        )

    def cudaMallocHost(self, nbytes):
        if err := self._enter("cudaMallocHost"):
            return (err, 0)
        arr = np.full(max(int(nbytes), 1), 0xFF, np.uint8)
        self.pinned[arr.ctypes.data] = arr
        return (cudaError_t.cudaSuccess, arr.ctypes.data)

    def cudaFreeHost(self, ptr):
        if err := self._enter("cudaFreeHost"):
            return (err,)
        self._flush()
        return (
            cudaError_t.cudaSuccess
            if self.pinned.pop(ptr, None) is not None
            else cudaError_t.cudaErrorInvalidValue,
        )

    # streams
    def cudaStreamCreate(self):
        if err := self._enter("cudaStreamCreate"):
            return (err, None)
        s = FakeStream(0x5000 + len(self.streams) + self.calls["cudaStreamCreate"])
        self.streams[s.handle] = s
        return (cudaError_t.cudaSuccess, s)

    def cudaStreamSynchronize(self, stream):
        if err := self._enter("cudaStreamSynchronize"):
            return (err,)
        s = self._stream(stream)
        if s is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        self._flush(s)
        return (cudaError_t.cudaSuccess,)

    def cudaStreamDestroy(self, stream):
        if err := self._enter("cudaStreamDestroy"):
            return (err,)
        s = self.streams.pop(int(stream), None)
        if s is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        self._flush(s)
        return (cudaError_t.cudaSuccess,)

    # copies
    def _copy_op(self, dst, src, nbytes, kind):
        dst, src, nbytes, kind = int(dst), int(src), int(nbytes), cudaMemcpyKind(kind)
        want = {
            cudaMemcpyKind.cudaMemcpyHostToDevice: (("device",), ("host", "pinned")),
            cudaMemcpyKind.cudaMemcpyDeviceToHost: (("host", "pinned"), ("device",)),
            cudaMemcpyKind.cudaMemcpyDeviceToDevice: (("device",), ("device",)),
            cudaMemcpyKind.cudaMemcpyHostToHost: (("host", "pinned"), ("host", "pinned")),
        }[kind]
        if self.region(dst, nbytes) not in want[0] or self.region(src, nbytes) not in want[1]:
            return None
        self.copies.append(kind.name)
        return lambda: ctypes.memmove(dst, src, nbytes)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        if err := self._enter("cudaMemcpyAsync"):
            return (err,)
        s, op = self._stream(stream), self._copy_op(dst, src, nbytes, kind)
        if s is None or op is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        s.queue.append(op)
        return (cudaError_t.cudaSuccess,)

    def cudaMemcpy(self, dst, src, nbytes, kind):
        if err := self._enter("cudaMemcpy"):
            return (err,)
        op = self._copy_op(dst, src, nbytes, kind)
        if op is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        self._flush()
        op()
        return (cudaError_t.cudaSuccess,)

    def cudaMemsetAsync(self, ptr, value, nbytes, stream):
        if err := self._enter("cudaMemsetAsync"):
            return (err,)
        s = self._stream(stream)
        if s is None or self.region(int(ptr), int(nbytes)) != "device":
            return (cudaError_t.cudaErrorInvalidValue,)
        s.queue.append(lambda: ctypes.memset(int(ptr), int(value), int(nbytes)))
        return (cudaError_t.cudaSuccess,)

    def read(self, addr: int, shape, dtype) -> np.ndarray:
        """A copy of device memory, for the fake engine."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer(ctypes.string_at(addr, n), dtype=dtype).reshape(shape).copy()


# ----------------------------------------------------------------------------------------------------------
# fake TensorRT 10
# ----------------------------------------------------------------------------------------------------------

MAGIC = b"FAKE-TRT-ENGINE\n"
ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 7: "INT64", 6: "INT32", 9: "BOOL", 3: "INT8", 2: "UINT8"}


def make_fake_tensorrt(cudart: FakeCudart, version: str = "10.3.0.26", fast_fp16: bool = True):
    """A ``tensorrt`` module whose engines run their ONNX graph with onnxruntime on ``cudart``'s memory."""
    import onnx
    import onnxruntime as ort

    from edgeattn.export.compat import TENSORRT10_OPS

    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.stats = collections.Counter()
    trt.configs = []  # every BuilderConfig that built an engine
    trt.network_flags = []
    trt.fail = set()  # "build", "execute"
    trt.fast_fp16 = fast_fp16

    class ILogger:
        class Severity(enum.IntEnum):
            INTERNAL_ERROR = 0
            ERROR = 1
            WARNING = 2
            INFO = 3
            VERBOSE = 4

        def __init__(self):
            pass

        def log(self, severity, msg):
            pass

    DataType = enum.Enum("DataType", "FLOAT HALF INT8 INT32 BOOL UINT8 FP8 BF16 INT64 INT4")
    TensorIOMode = enum.Enum("TensorIOMode", "NONE INPUT OUTPUT")
    MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE DLA_MANAGED_SRAM")
    BuilderFlag = enum.Enum("BuilderFlag", "FP16 INT8 BF16 STRICT_TYPES")

    class Network:
        def __init__(self):
            self.onnx = None

    class ParserError:
        def __init__(self, text):
            self.text = text

        def __str__(self):
            return self.text

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.logger, self.errors = network, logger, []

        def parse_from_file(self, path):
            # external weights (weights.bin) resolve beside the file, and the engine holds them, as TensorRT's do
            model = onnx.load(str(path))
            data = model.SerializeToString()
            for i, n in enumerate(model.graph.node):
                if n.domain not in ("", "ai.onnx") or n.op_type not in TENSORRT10_OPS:
                    self.errors.append(
                        ParserError(
                            f"In node {i} with name: {n.name} and operator: {n.op_type} "
                            f"(importFallbackPluginImporter): UNSUPPORTED_NODE: no importer for {n.op_type}"
                        )
                    )
            for e in self.errors:
                self.logger.log(ILogger.Severity.ERROR, str(e))
            if not self.errors:
                self.network.onnx = data
            return not self.errors

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

    class BuilderConfig:
        def __init__(self):
            self.pools, self.flags = {}, set()

        def set_memory_pool_limit(self, pool, nbytes):
            self.pools[pool] = nbytes

        def set_flag(self, flag):
            self.flags.add(flag)

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        @property
        def platform_has_fast_fp16(self):
            return trt.fast_fp16

        def create_network(self, flags):
            trt.network_flags.append(flags)
            return Network()

        def create_builder_config(self):
            return BuilderConfig()

        def build_serialized_network(self, network, config):
            trt.stats["build"] += 1
            trt.configs.append(config)
            if "build" in trt.fail or network.onnx is None:
                self.logger.log(ILogger.Severity.ERROR, "fake: out of device memory while building")
                return None
            header = json.dumps({"gpu": cudart.gpu_name, "fp16": BuilderFlag.FP16 in config.flags})
            return memoryview(MAGIC + header.encode() + b"\n" + network.onnx)  # a buffer, like IHostMemory

    class Engine:
        def __init__(self, header, model_bytes):
            self.header = header
            model = onnx.load_from_string(model_bytes)
            self.io = {}  # name -> (mode, dtype, shape)
            for mode, values in (
                (TensorIOMode.INPUT, model.graph.input),
                (TensorIOMode.OUTPUT, model.graph.output),
            ):
                for v in values:
                    t = v.type.tensor_type
                    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
                    self.io[v.name] = (mode, DataType[ONNX_TO_TRT[t.elem_type]], shape)
            self.names = list(self.io)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            self.session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])

        @property
        def num_io_tensors(self):
            return len(self.names)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return self.io[name][0]

        def get_tensor_dtype(self, name):
            return self.io[name][1]

        def get_tensor_shape(self, name):
            return self.io[name][2]

        def create_execution_context(self):
            return ExecutionContext(self)

    class ExecutionContext:
        def __init__(self, engine):
            self.engine, self.addresses = engine, {}

        def set_tensor_address(self, name, ptr):
            trt.stats["set_tensor_address"] += 1
            if name not in self.engine.io:
                return False
            self.addresses[name] = int(ptr)
            return True

        def execute_async_v3(self, stream_handle):
            trt.stats["execute"] += 1
            stream = cudart.streams.get(int(stream_handle))
            if "execute" in trt.fail or stream is None:
                return False
            spans = {}
            for name, (mode, dtype, shape) in self.engine.io.items():
                nbytes = int(np.prod(shape)) * numpy_dtype(dtype.name).itemsize
                addr = self.addresses.get(name)
                assert addr is not None, f"{name} is not bound"
                assert cudart.region(addr, nbytes) == "device", (
                    f"{name} is not bound to a large-enough device buffer"
                )
                spans[name] = (mode, addr, nbytes)
            ins = [s for s in spans.values() if s[0] == TensorIOMode.INPUT]
            for name, (mode, addr, nbytes) in spans.items():
                if mode == TensorIOMode.OUTPUT:
                    assert all(addr + nbytes <= a or a + n <= addr for _, a, n in ins), (
                        f"{name} aliases an input"
                    )
            bound = dict(self.addresses)  # TensorRT reads the addresses when the work is enqueued
            io = self.engine.io

            def run():
                feeds = {
                    n: cudart.read(bound[n], io[n][2], numpy_dtype(io[n][1].name))
                    for n in io
                    if io[n][0] == TensorIOMode.INPUT
                }
                outs = [n for n in io if io[n][0] == TensorIOMode.OUTPUT]
                for n, value in zip(outs, self.engine.session.run(outs, feeds)):
                    value = np.ascontiguousarray(value, dtype=numpy_dtype(io[n][1].name))
                    ctypes.memmove(bound[n], value.ctypes.data, value.nbytes)

            stream.queue.append(run)
            return True

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            trt.stats["deserialize"] += 1
            data = bytes(data)
            if not data.startswith(MAGIC):
                self.logger.log(ILogger.Severity.ERROR, "fake: the engine plan file is corrupt")
                return None
            header, model = data[len(MAGIC) :].split(b"\n", 1)
            if json.loads(header)["gpu"] != cudart.gpu_name:
                self.logger.log(ILogger.Severity.ERROR, "fake: the engine was built for another GPU")
                return None
            return Engine(json.loads(header), model)

    for name, value in dict(
        ILogger=ILogger,
        Logger=ILogger,
        DataType=DataType,
        TensorIOMode=TensorIOMode,
        MemoryPoolType=MemoryPoolType,
        BuilderFlag=BuilderFlag,
        Builder=Builder,
        OnnxParser=OnnxParser,
        Runtime=Runtime,
    ).items():
        setattr(trt, name, value)
    return trt


def install_fakes(monkeypatch, cudart: FakeCudart, trt=None, *, old_cuda_python: bool = False):
    """Put fake ``tensorrt`` and ``cuda-python`` in ``sys.modules`` (the layout of cuda-python >= 12.6, or the
    older ``from cuda import cudart`` one)."""
    trt = trt or make_fake_tensorrt(cudart)
    cuda = types.ModuleType("cuda")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    if old_cuda_python:
        cuda.cudart = cudart
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # "No module named cuda.bindings"
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)
    else:
        bindings = types.ModuleType("cuda.bindings")
        bindings.runtime = cudart
        cuda.bindings = bindings
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cudart)
    return trt


@pytest.fixture
def fake(monkeypatch):
    cudart = FakeCudart()
    trt = install_fakes(monkeypatch, cudart)
    return types.SimpleNamespace(cudart=cudart, trt=trt)


# ----------------------------------------------------------------------------------------------------------
# artifacts
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gla_art(tmp_path_factory):
    pytest.importorskip("torch")
    from edgeattn.export import export_model
    from tests.export_helpers import PREFILL, make_checkpoint

    root = tmp_path_factory.mktemp("trt_gla")
    return export_model(
        make_checkpoint(root / "ckpt", "gla"), root / "art", target="portable", prefill_chunk=PREFILL
    )


@pytest.fixture(scope="module")
def synth_art(tmp_path_factory):
    pytest.importorskip("onnx")
    from tests.artifact_fixture import build_artifact

    return build_artifact(tmp_path_factory.mktemp("trt_synth") / "art", prefill_tokens=4)


@pytest.fixture(params=["gla", "synthetic"])
def art(request):
    return request.getfixturevalue("gla_art" if request.param == "gla" else "synth_art")


def manifest_of(**overrides) -> Manifest:
    """A manifest in memory (no files): two state tensors, prefill 4."""
    data = {
        "format": "edgeattn",
        "format_version": 1,
        "fingerprint": "f" * 64,
        "vocab_size": 256,
        "batch_size": 1,
        "target": "portable",
        "precision": "fp32",
        "max_length": None,
        "graphs": {
            "step": {"path": "step.onnx", "tokens": 1},
            "prefill": {"path": "prefill.onnx", "tokens": 4},
        },
        "state": [
            {
                "input": "past_key_values.0.recurrent_state",
                "output": "present.0.recurrent_state",
                "layer": 0,
                "name": "recurrent_state",
                "shape": [1, 2, 4, 4],
                "dtype": "float32",
            },
            {
                "input": "past_key_values.1.normalizer",
                "output": "present.1.normalizer",
                "layer": 1,
                "name": "normalizer",
                "shape": [1, 2, 4],
                "dtype": "float32",
            },
        ],
        "files": {},
    }
    data.update(overrides)
    return Manifest(Path("/nonexistent/art"), data)


def open_both(art, cache_dir, **kw):
    return open_session(art, backend="onnxruntime", threads=1), TensorRTSession(
        Manifest.load(art), cache_dir=cache_dir, **kw
    )


def assert_close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    scale = max(float(np.abs(b).max()), 1.0)
    assert float(np.abs(a - b).max()) <= tol * scale, float(np.abs(a - b).max())


# ----------------------------------------------------------------------------------------------------------
# pure parts
# ----------------------------------------------------------------------------------------------------------


def test_binding_plan_reads_one_parity_and_writes_the_other():
    m = manifest_of()
    for graph in ("step", "prefill"):
        p0, p1 = binding_plan(m, graph, 0), binding_plan(m, graph, 1)
        assert p0["input_ids"] == p1["input_ids"] == ("ids", graph)
        assert p0["logits"] == p1["logits"] == ("logits", graph)
        for i, e in enumerate(m.state):
            assert p0[e.input] == ("state", i, 0) and p0[e.output] == ("state", i, 1)
            assert p1[e.input] == ("state", i, 1) and p1[e.output] == ("state", i, 0)
        assert set(p0) == set(io_spec(m, graph)) and len(p0) == 2 + 2 * len(m.state)
    with pytest.raises(ValueError, match="parity"):
        binding_plan(m, "step", 2)
    clash = manifest_of()
    clash.data["outputs"] = {"logits": "present.0.recurrent_state"}
    with pytest.raises(ValueError, match="same name"):
        binding_plan(clash, "step", 0)


def test_io_spec_and_engine_io_check():
    m = manifest_of()
    spec = io_spec(m, "prefill")
    assert spec["input_ids"] == (True, (1, 4), "ids") and spec["logits"] == (False, (1, 4, 256), "logits")
    assert spec["present.1.normalizer"] == (False, (1, 2, 4), "state")
    assert io_spec(m, "step")["input_ids"] == (True, (1, 1), "ids")
    good = {n: (inp, np.dtype({"ids": np.int64}.get(k, np.float32)), s) for n, (inp, s, k) in spec.items()}
    check_engine_io("prefill", good, spec)
    check_engine_io(
        "prefill", {**good, "input_ids": (True, np.dtype(np.int32), (1, 4))}, spec
    )  # int32 ids: ok
    bad = [
        (
            {k: v for k, v in good.items() if k != "present.1.normalizer"},
            "missing \\['present.1.normalizer'\\]",
        ),
        ({**good, "extra": (False, np.dtype(np.float32), (1,))}, "extra \\['extra'\\]"),
        ({**good, "logits": (True, np.dtype(np.float32), (1, 4, 256))}, "logits is an input"),
        ({**good, "input_ids": (True, np.dtype(np.int64), (-1, 4))}, "static shapes"),
        ({**good, "present.0.recurrent_state": (False, np.dtype(np.float16), (1, 2, 4, 4))}, "float16"),
    ]
    for io, message in bad:
        with pytest.raises(RuntimeError, match=message):
            check_engine_io("prefill", io, spec)


def test_engine_file_name_keys_graph_tensorrt_gpu_and_precision():
    name = engine_file_name("step", SHA, "10.3.0.26", "NVIDIA Jetson Orin (nvgpu)", False)
    assert name == f"step-{SHA}-trt10.3.0.26-nvidia-jetson-orin-nvgpu-fp32.engine"
    variants = {
        engine_file_name("prefill", SHA, "10.3.0.26", "Orin", False),
        engine_file_name("step", "f" * 64, "10.3.0.26", "Orin", False),
        engine_file_name("step", SHA, "10.7.0", "Orin", False),
        engine_file_name("step", SHA, "10.3.0.26", "NVIDIA H100 80GB HBM3", False),
        engine_file_name("step", SHA, "10.3.0.26", "Orin", True),
        engine_file_name("step", SHA, "10.3.0.26", "Orin", False),
    }
    assert len(variants) == 6
    assert all(n == os.path.basename(n) and " " not in n and "/" not in n for n in variants)
    assert engine_file_name("step", SHA, "10", "../../etc", False).count("/") == 0


def test_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(rt.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir(tmp_path) == tmp_path / "tensorrt_engines"
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # a read-only artifact
    assert default_cache_dir(tmp_path) == tmp_path / "xdg" / "edgeattn" / "tensorrt"
    monkeypatch.setenv(rt.CACHE_ENV, str(tmp_path / "env"))
    assert default_cache_dir(tmp_path) == tmp_path / "env"


def test_numpy_dtype_and_parse_device():
    assert numpy_dtype("FLOAT") == np.float32 and numpy_dtype("HALF") == np.float16
    assert (
        numpy_dtype("INT64") == np.int64
        and numpy_dtype("INT32") == np.int32
        and numpy_dtype("BOOL") == np.bool_
    )
    assert numpy_dtype(enum.Enum("DataType", "FLOAT INT64").INT64) == np.int64  # by the enum member's name
    with pytest.raises(ValueError, match="FP8"):
        numpy_dtype("FP8")
    assert parse_device(None) == 0 and parse_device("cuda") == 0 and parse_device("cuda:1") == 1
    with pytest.raises(ValueError, match="onnxruntime"):
        parse_device("cpu")
    with pytest.raises(ValueError, match="cuda:N"):
        parse_device("npu")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"target": "onnxruntime"},
            "re-export with `--target portable`: TensorRT needs a plugin for com.microsoft",
        ),
        ({"precision": "int8"}, "MatMulInteger"),
        ({"dynamic_batch": True}, "exported with --dynamic-batch"),
        (
            {
                "state": [
                    {
                        "input": "past_key_values.0.key",
                        "output": "present.0.key",
                        "layer": 0,
                        "name": "key",
                        "shape": [1, 2, "past_length", 8],
                        "dtype": "float32",
                    }
                ]
            },
            "softmax KV-cache baseline",
        ),
    ],
)
def test_refuses_what_tensorrt_cannot_run(overrides, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # refused before TensorRT is needed
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        TensorRTSession(manifest_of(**overrides))
    assert "\n" not in str(info.value)


def test_without_tensorrt_open_session_raises_one_line(synth_art, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as if not installed, even where it is
    with pytest.raises(ValueError) as info:
        open_session(synth_art, backend="tensorrt")
    assert str(info.value) == MISSING_MESSAGE and "\n" not in MISSING_MESSAGE
    with pytest.raises(ValueError, match="onnxruntime"):
        open_session(synth_art, backend="tensorrt", device="cpu")


def test_without_cuda_python_or_with_old_tensorrt(synth_art, monkeypatch):
    cudart = FakeCudart()
    install_fakes(monkeypatch, cudart)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    with pytest.raises(ValueError) as info:
        open_session(synth_art, backend="tensorrt")
    assert str(info.value) == MISSING_MESSAGE
    install_fakes(monkeypatch, cudart, make_fake_tensorrt(cudart, version="8.6.1"))
    with pytest.raises(ValueError, match="found TensorRT 8.6.1"):
        open_session(synth_art, backend="tensorrt")


def test_cli_run_without_tensorrt_prints_one_line(synth_art, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from edgeattn.cli import run

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    app = typer.Typer()
    run.register(app)
    app.command("noop")(lambda: None)  # two commands, so that "run" is addressed by name
    res = CliRunner().invoke(app, ["run", str(synth_art), "--backend", "tensorrt", "-n", "1"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == [f"error: {MISSING_MESSAGE}"], res.output


# ----------------------------------------------------------------------------------------------------------
# the session on the fakes
# ----------------------------------------------------------------------------------------------------------


def test_session_matches_onnxruntime(art, fake, tmp_path):
    from edgeattn.export.check import run_logits

    ref, sess = open_both(art, tmp_path)
    assert sess.backend == "tensorrt" and sess.device == "cuda:0" and sess.gpu_name == "Fake GPU 9000"
    C = sess.manifest.prefill_tokens
    ids = np.random.default_rng(1).integers(0, 256, (1, 3 * C - 1), dtype=np.int64)
    got, want = run_logits(sess, ids), run_logits(ref, ids)  # every position: prefill chunks, then steps
    assert got["prefill"].shape[1] == 2 * C and got["step"].shape[1] == C - 1
    for g in ("prefill", "step"):
        assert got[g].dtype == np.float32
        assert_close(got[g], want[g])
    for name, value in ref.get_state().items():
        assert_close(sess.get_state()[name], value)
    # the public API, switching graphs at odd parities: prefill, steps, prefill again, generation
    for s in (sess, ref):
        s.reset()
    assert_close(sess.prefill(ids[:, : C + 3]), ref.prefill(ids[:, : C + 3]))
    for t in range(5):
        assert_close(sess.step(ids[:, t : t + 1]), ref.step(ids[:, t : t + 1]))
    assert_close(sess.prefill(ids[:, :C]), ref.prefill(ids[:, :C]))
    assert sess.position == ref.position == 2 * C + 8
    assert sess.generate("def f(x):", 12, temperature=0) == ref.generate("def f(x):", 12, temperature=0)
    sess.close()


def test_state_get_set_reset_and_state_files(gla_art, fake, tmp_path):
    ref, sess = open_both(gla_art, tmp_path)
    ids = np.random.default_rng(2).integers(0, 256, (1, 21), dtype=np.int64)
    fresh = sess.prefill(ids)
    assert all(not np.isnan(v).any() for v in sess.get_state().values())
    sess.reset()
    assert all(np.all(v == 0) for v in sess.get_state().values())
    assert sess.position == 0
    np.testing.assert_array_equal(sess.prefill(ids), fresh)  # reset really starts over

    ref.reset()
    ref.prefill(ids[:, :13])
    sess.set_state(ref.get_state(), position=13)  # a state from another backend continues identically
    assert_close(sess.prefill(ids[:, 13:]), ref.prefill(ids[:, 13:]))
    sess.step(ids[:, :1])  # the current state now lives in the other buffer parity
    state = sess.get_state()
    ref.set_state(state, position=sess.position)
    assert_close(sess.step(ids[:, 1:2]), ref.step(ids[:, 1:2]))

    path = tmp_path / "s.state"
    ref.save_state(path)
    sess.reset()
    sess.load_state(path)
    assert sess.position == ref.position
    assert_close(sess.step(ids[:, 2:3]), ref.step(ids[:, 2:3]))
    sess.save_state(path)
    ref.reset()
    ref.load_state(path)
    assert_close(ref.step(ids[:, 3:4]), sess.step(ids[:, 3:4]))
    with pytest.raises(ValueError, match="must hold exactly"):
        sess.set_state({})


def test_no_state_copy_per_token(synth_art, fake, tmp_path):
    sess = TensorRTSession(Manifest.load(synth_art), cache_dir=tmp_path)
    n_state = len(sess.manifest.state)
    # two device buffers per state tensor, and ids + logits per graph (device and pinned host)
    assert fake.cudart.calls["cudaMalloc"] == 2 * n_state + 4 and fake.cudart.calls["cudaMallocHost"] == 4
    sess.prefill(np.arange(4)[None])
    fake.cudart.calls.clear()
    fake.cudart.copies.clear()
    fake.trt.stats.clear()
    for t in range(6):
        sess.step(np.array([[t]]))
    # per token: token ids in, logits out, one execute, one synchronize, the state re-pointed, nothing else
    assert fake.cudart.copies == ["cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost"] * 6
    assert dict(fake.cudart.calls) == {"cudaMemcpyAsync": 12, "cudaStreamSynchronize": 6}
    assert fake.trt.stats == {"execute": 6, "set_tensor_address": 6 * 2 * n_state}
    assert len(fake.cudart.device_mem) == 2 * n_state + 4


def test_engine_cache(synth_art, fake, tmp_path):
    cache = tmp_path / "cache"
    sess = TensorRTSession(Manifest.load(synth_art), cache_dir=cache)
    assert sess.engine_sources == {"step": "built", "prefill": "built"} and fake.trt.stats["build"] == 2
    files = json.loads((synth_art / "edgeattn.json").read_text())["files"]
    for g in ("step", "prefill"):
        expected = engine_file_name(g, files[f"{g}.onnx"]["sha256"], "10.3.0.26", "Fake GPU 9000", False)
        assert sess.engine_paths[g] == cache / expected
    assert sorted(os.listdir(cache)) == sorted(p.name for p in sess.engine_paths.values())  # no temp files
    logits = sess.prefill(np.arange(6)[None])
    sess.close()

    again = TensorRTSession(Manifest.load(synth_art), cache_dir=cache)
    assert again.engine_sources == {"step": "cache", "prefill": "cache"} and fake.trt.stats["build"] == 2
    np.testing.assert_array_equal(again.prefill(np.arange(6)[None]), logits)
    again.close()

    again.engine_paths["step"].write_bytes(b"not an engine")
    with pytest.warns(UserWarning, match="does not deserialize; rebuilding"):
        rebuilt = TensorRTSession(Manifest.load(synth_art), cache_dir=cache)
    assert rebuilt.engine_sources == {"step": "built", "prefill": "cache"}
    assert rebuilt.engine_paths["step"].read_bytes().startswith(MAGIC)
    rebuilt.close()
    forced = TensorRTSession(Manifest.load(synth_art), cache_dir=cache, rebuild=True)
    assert forced.engine_sources == {"step": "built", "prefill": "built"}
    forced.close()

    fake.cudart.gpu_name = "Other GPU"  # another GPU gets its own engines beside the first ones
    other = TensorRTSession(Manifest.load(synth_art), cache_dir=cache)
    assert other.engine_sources == {"step": "built", "prefill": "built"} and len(os.listdir(cache)) == 4
    other.close()


def test_default_cache_is_inside_a_writable_artifact(synth_art, fake, tmp_path, monkeypatch):
    monkeypatch.delenv(rt.CACHE_ENV, raising=False)
    art = shutil.copytree(synth_art, tmp_path / "art")
    sess = open_session(art, backend="tensorrt")
    assert isinstance(sess, TensorRTSession)
    assert all(p.parent == art / "tensorrt_engines" and p.is_file() for p in sess.engine_paths.values())
    Manifest.load(art)  # the extra directory leaves the artifact valid
    sess.close()
    with pytest.warns(UserWarning, match="cannot cache"):  # an unwritable cache still gives a session
        blocked = TensorRTSession(Manifest.load(art), cache_dir=art / "edgeattn.json" / "sub", rebuild=True)
    assert blocked.prefill(np.arange(4)[None]).shape == (1, 256)
    blocked.close()


def test_builder_settings(synth_art, fake, tmp_path):
    m = Manifest.load(synth_art)
    TensorRTSession(m, cache_dir=tmp_path / "a", workspace_mb=64).close()
    assert fake.trt.network_flags == [0, 0]  # explicit batch, the only mode of TensorRT 10
    for cfg in fake.trt.configs:
        assert cfg.pools == {fake.trt.MemoryPoolType.WORKSPACE: 64 << 20} and cfg.flags == set()
    m.data["precision"] = "fp16"  # the flag follows the artifact's precision ...
    fake.trt.configs.clear()
    sess = TensorRTSession(m, cache_dir=tmp_path / "b")
    assert (
        all(cfg.flags == {fake.trt.BuilderFlag.FP16} for cfg in fake.trt.configs)
        and len(fake.trt.configs) == 2
    )
    assert all(p.name.endswith("-fp16.engine") for p in sess.engine_paths.values())
    sess.close()
    fake.trt.fast_fp16 = False  # ... and the GPU's fast fp16
    fake.trt.configs.clear()
    TensorRTSession(m, cache_dir=tmp_path / "c").close()
    assert all(cfg.flags == set() for cfg in fake.trt.configs)


def test_parser_errors_are_reported(fake, tmp_path):
    pytest.importorskip("torch")
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint

    art = export_model(
        make_checkpoint(tmp_path / "ckpt", "gla"), tmp_path / "art", target="onnxruntime", prefill_chunk=16
    )
    m = Manifest.load(art)
    with pytest.raises(ValueError, match="--target portable"):
        TensorRTSession(m, cache_dir=tmp_path / "c")
    m.data["target"] = "portable"  # a graph the parser refuses, as if mislabelled
    with pytest.raises(ValueError) as info:
        TensorRTSession(m, cache_dir=tmp_path / "c")
    first, *rest = str(info.value).splitlines()
    assert "TensorRT's ONNX parser rejected" in first and "step.onnx" in first
    assert "LinearAttention" in str(info.value)  # among the refused ops (the fused norms come first)
    assert len(rest) >= 2 and all("UNSUPPORTED_NODE" in line for line in rest)  # the whole list follows
    assert not fake.cudart.device_mem and not fake.cudart.streams  # nothing left allocated


def test_cuda_failures_name_the_call_and_free_everything(synth_art, fake, tmp_path):
    m = Manifest.load(synth_art)
    fake.cudart.fail["cudaMallocHost"] = cudaError_t.cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="^cudaMallocHost failed: cudaErrorMemoryAllocation$"):
        TensorRTSession(m, cache_dir=tmp_path)
    assert fake.cudart.calls["cudaMalloc"] > 0
    assert not fake.cudart.device_mem and not fake.cudart.pinned and not fake.cudart.streams
    fake.cudart.fail.clear()
    with pytest.raises(RuntimeError, match="cudaSetDevice failed: cudaErrorInvalidDevice"):
        TensorRTSession(m, cache_dir=tmp_path, device="cuda:1")

    sess = TensorRTSession(m, cache_dir=tmp_path)
    sess.step(np.array([[1]]))
    before = sess.get_state()
    fake.cudart.fail["cudaMemcpyAsync"] = cudaError_t.cudaErrorInvalidValue
    with pytest.raises(RuntimeError, match="cudaMemcpyAsync failed: cudaErrorInvalidValue"):
        sess.step(np.array([[2]]))
    fake.cudart.fail.clear()
    for name, value in sess.get_state().items():  # a failed call does not advance the state
        np.testing.assert_array_equal(value, before[name])
    sess.close()


def test_tensorrt_failures_name_the_call(synth_art, fake, tmp_path):
    m = Manifest.load(synth_art)
    fake.trt.fail.add("build")
    with pytest.raises(
        RuntimeError, match="build_serialized_network \\(step\\) failed: fake: out of device memory"
    ):
        TensorRTSession(m, cache_dir=tmp_path)
    fake.trt.fail.clear()
    assert not fake.cudart.streams and not os.listdir(tmp_path)

    ref = open_session(synth_art, threads=1)
    sess = TensorRTSession(m, cache_dir=tmp_path)
    ids = np.array([[5]])
    sess.step(ids), ref.step(ids)
    fake.trt.fail.add("execute")
    with pytest.raises(RuntimeError, match="execute_async_v3 \\(step\\) failed"):
        sess.step(ids)
    fake.trt.fail.clear()
    assert sess.position == 1
    assert_close(sess.step(ids), ref.step(ids))  # the state was not advanced by the failed call
    sess.close()


def test_close_frees_everything(synth_art, fake, tmp_path):
    sess = TensorRTSession(Manifest.load(synth_art), cache_dir=tmp_path)
    assert fake.cudart.device_mem and fake.cudart.pinned and fake.cudart.streams
    sess.close()
    assert not fake.cudart.device_mem and not fake.cudart.pinned and not fake.cudart.streams
    sess.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sess.step(np.array([[1]]))
    with pytest.raises(RuntimeError, match="closed"):
        sess.get_state()


def test_older_cuda_python_layout(synth_art, monkeypatch, tmp_path):
    cudart = FakeCudart()
    install_fakes(monkeypatch, cudart, old_cuda_python=True)  # `from cuda import cudart`
    sess = TensorRTSession(Manifest.load(synth_art), cache_dir=tmp_path)
    assert sess._cudart is cudart
    ref = open_session(synth_art, threads=1)
    assert_close(sess.prefill(np.arange(9)[None]), ref.prefill(np.arange(9)[None]))
    sess.close()


# ----------------------------------------------------------------------------------------------------------
# real TensorRT: runs only where TensorRT 10, cuda-python and an NVIDIA GPU are present
# ----------------------------------------------------------------------------------------------------------


def test_real_tensorrt_matches_onnxruntime(gla_art, tmp_path):
    pytest.importorskip("tensorrt")
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        cudart = pytest.importorskip("cuda").cudart
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        pytest.skip("no CUDA device")
    from edgeattn.export.check import run_logits

    ref, sess = open_both(gla_art, tmp_path)
    ids = np.random.default_rng(3).integers(0, 256, (1, 45), dtype=np.int64)
    got, want = run_logits(sess, ids), run_logits(ref, ids)
    for g in ("prefill", "step"):
        assert_close(got[g], want[g], tol=1e-2)  # TensorRT uses TF32 kernels for fp32 by default
    for name, value in ref.get_state().items():
        assert_close(sess.get_state()[name], value, tol=1e-2)
    again = TensorRTSession(Manifest.load(gla_art), cache_dir=tmp_path)
    assert again.engine_sources == {"step": "cache", "prefill": "cache"}
    sess.close()
    again.close()


def test_engine_cache_tells_apart_two_models_whose_graphs_differ_only_in_weights(fake, tmp_path):
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint, text_ids

    arts = [
        export_model(
            make_checkpoint(tmp_path / f"c{s}", "gla", seed=s), tmp_path / f"a{s}", target="portable"
        )
        for s in (0, 1)
    ]
    # the weights live in weights.bin: the graph files of two models of one config are the same bytes
    assert (arts[0] / "step.onnx").read_bytes() == (arts[1] / "step.onnx").read_bytes()
    cache = tmp_path / "cache"
    TensorRTSession(Manifest.load(arts[0]), cache_dir=cache).close()
    second = TensorRTSession(Manifest.load(arts[1]), cache_dir=cache)
    assert second.engine_sources == {"step": "built", "prefill": "built"}
    ids = text_ids(70)
    assert_close(second.prefill(ids), open_session(arts[1]).prefill(ids))
    second.close()
