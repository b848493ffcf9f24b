"""ONNX Runtime backend. The state never leaves ONNX Runtime between tokens: each fixed-size state tensor
lives in two pre-allocated OrtValues, and each graph has two IOBindings (A -> B and B -> A), so a step
only writes the token id and runs. A preallocated KV buffer (the softmax baseline on the onnxruntime
target, manifest ``"shared": true``) is one buffer bound as both past and present: GroupQueryAttention
writes the new tokens into it in place. A growing KV cache (the portable target's softmax) is fed back
from the outputs ONNX Runtime allocated.

Weights: when the manifest names one graph file for both step and prefill (the ``onnxruntime``
target, fp32 or int4, models of fused recurrences and KV-buffer softmax layers: a dynamic token axis), that file is loaded once, in one InferenceSession with
prepacking on (one packed copy of the weights); both graph names use it, each with its own bindings.
In an fp32 artifact with two graphs that keep their initializers in one shared file (the manifest's
``"weights"``), each tensor is mapped from that file once (numpy memmap, no copy) and handed to both
sessions as the same OrtValue (``SessionOptions.add_initializer``), with prepacking off: each session
would otherwise keep a packed copy of every matrix of its own (ONNX Runtime's Python API has no shared
prepacked-weights container). Unpacked decode measured 9-50% slower than prepacked on a loaded 2-core
CPU (benchmarks/RESULTS.md): ``share_weights=False`` trades the memory back for that speed (each
session loads and prepacks its own copy). Quantized graphs (int8, int4) always prepack; with two graphs
each session keeps its own copy: MatMulNBits without its packed form ran 35x slower (92.5M GLA, 1 thread).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from edgeattn.artifact.manifest import Manifest
from edgeattn.runtimes.attention import kernels_for_session
from edgeattn.runtimes.base import Session, _locked, kv_from_float, kv_to_float, kv_zeros


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int8)": "int8",
    "tensor(int64)": "int64",
}


def _io(args) -> dict[str, tuple]:
    """ONNX Runtime's NodeArgs -> name -> (element type, shape), as ``Manifest.check_graph_io`` takes them."""
    return {a.name: (_ORT_TYPES.get(a.type, a.type), tuple(a.shape)) for a in args}


def pick_providers(device: str | None = None) -> list[str]:
    """CUDA when onnxruntime-gpu and a GPU are present (or asked for), CPU otherwise."""
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        raise ValueError("device 'cuda' needs onnxruntime-gpu and a GPU: pip install 'edgeattn[gpu]'")
    return ["CPUExecutionProvider"]


SHARED_PRECISIONS = ("fp32",)  # precisions whose sessions share one in-memory copy of the weights


def shared_initializers(manifest: Manifest) -> dict[str, ort.OrtValue]:
    """One read-only OrtValue per tensor of the shared weights file, by every initializer name it serves."""
    info = manifest.weights
    path = manifest.root / info["path"]
    data = np.memmap(path, dtype=np.uint8, mode="r")
    values = {}
    for t in info["tensors"]:
        if t["dtype"] in ("uint4", "int4"):  # no numpy dtype: the session reads it from the file itself
            continue
        start, length = int(t["offset"]), int(t["length"])
        if start < 0 or start + length > data.size:
            raise ValueError(
                f"{path}: tensor {t['names'][0]!r} lies outside the file (manifest and file disagree)"
            )
        array = data[start : start + length].view(np.dtype(t["dtype"])).reshape(t["shape"])
        value = ort.OrtValue.ortvalue_from_numpy(array)
        for name in t["names"]:
            values[name] = value
    return values


def release_mapped_pages(root) -> int:
    """Drop from this process's resident set the pages of the files under ``root`` that ONNX Runtime maps
    (the weights file) where none was written (no ``Anonymous`` pages: each page still equals the file's).
    Prepacking reads every matrix through the mapping, and a table that a Gather also reads, such as a
    tied int4 embedding, stays mapped with all its pages resident; dropped, they stay in the page cache and
    fault back in when read, so a Gather holds only the rows it reads. Linux only (``/proc/self/smaps``,
    ``madvise``); returns the bytes advised, 0 elsewhere."""
    import ctypes
    import os

    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MADV_DONTNEED = 4
    root = os.path.realpath(root) + os.sep
    maps, current = [], None  # [start, end, anonymous kB] of the mappings of files under root
    for line in lines:
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
            current = None
            if len(parts) >= 6 and parts[5].startswith(root):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                current = [start, end, None]
                maps.append(current)
        elif current is not None and parts[0] == "Anonymous:":
            current[2] = int(parts[1])
    advised = 0
    for start, end, anonymous in maps:
        if anonymous == 0 and libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            advised += end - start
    return advised


HUGE_PAGE_KV_HEAD = 8 << 20  # bytes of one KV head's slots from which a session's buffer takes huge pages


def session_kv_zeros(shape, dtype) -> np.ndarray:
    """Zeros for a session's KV buffer [B, Hkv, L, D]: ``np.zeros`` (numpy asks for 2 MiB transparent huge
    pages) where one head's L slots take at least ``HUGE_PAGE_KV_HEAD`` bytes, since huge pages make one
    stream's reads faster at long context (decode at 4096 tokens of the Qwen3.5-0.8B int4 shape, 16 MiB a
    head: 41.5 ms with them, 45.5-46.0 ms in 4 KiB pages); else ``kv_zeros`` (4 KiB pages). A head smaller
    than that fits in one or a few huge pages, which its first token commits whole: SmolLM2-135M's 3 KV
    heads of 8040 x 64 float32 slots (2 MiB each, 30 layers) held 432 MiB after 128 tokens, 234 MiB of it
    huge pages (benchmarks/RESULTS.md, issue 32 item 6)."""
    head = int(shape[-2]) * int(shape[-1]) * np.dtype(dtype).itemsize if len(shape) >= 2 else 0
    return np.zeros(shape, dtype) if head >= HUGE_PAGE_KV_HEAD else kv_zeros(shape, dtype)


def _token_axis(sess: ort.InferenceSession, name: str) -> bool:
    """Whether the graph's token-id input ``name`` has a symbolic token axis."""
    shape = next(i.shape for i in sess.get_inputs() if i.name == name)
    return len(shape) == 2 and not isinstance(shape[1], int)


class OnnxRuntimeSession(Session):
    backend = "onnxruntime"

    def __init__(
        self,
        manifest: Manifest,
        *,
        threads: int | None = None,
        device: str | None = None,
        share_weights: bool = True,
    ):
        super().__init__(manifest)
        need = manifest.data.get("requires", {}).get("onnxruntime", "0")
        if _version_tuple(ort.__version__) < _version_tuple(need):
            raise ValueError(
                f"this artifact (target {manifest.target!r}) needs onnxruntime >= {need} for its fused "
                f"com.microsoft.LinearAttention op, found {ort.__version__}; upgrade onnxruntime or "
                "re-export with --target portable"
            )
        providers = pick_providers(device)
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        self._weights = None  # the shared initializers; they must outlive the sessions
        paths = {g: manifest.graph_path(g) for g in ("step", "prefill")}
        one = paths["step"] == paths["prefill"]  # one graph with a dynamic token axis: one session
        shared = manifest.weights is not None and manifest.precision in SHARED_PRECISIONS
        if share_weights and shared and self.device == "cpu" and not one:
            self._weights = shared_initializers(manifest)

        def options(library=None, ops=()):
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.log_severity_level = 3  # errors only: fp16 graphs make the optimizer chatty
            if threads:
                so.intra_op_num_threads = threads
                so.inter_op_num_threads = 1
            if self._weights is not None:
                so.add_session_config_entry("session.disable_prepacking", "1")
                for name, value in self._weights.items():
                    so.add_initializer(name, value)
            if library is not None:
                so.add_session_config_entry("edgeattn.ops", ",".join(ops))
                so.register_custom_ops_library(str(library))
            return so

        # edgeattn's GroupQueryAttention kernel over float32 KV buffers on CPU and its MatMulNBits kernel on the CPU
        # kinds it was raced on (edgeattn/runtimes/attention.py); ONNX Runtime's own where they do not apply,
        # cannot be built, or the graph will not load with them
        lib, self.attention, self.matmul = kernels_for_session(manifest, self.device, paths.values())
        ops = [
            op
            for op, k in (("GroupQueryAttention", self.attention), ("MatMulNBits", self.matmul))
            if k["kernel"] == "edgeattn"
        ]
        self.sessions, errors = None, {}
        # all of them, else one at a time (the first that loads), else none
        for attempt in [ops, *([op] for op in ops)] if len(ops) > 1 else [ops] if ops else []:
            try:
                self.sessions = self._load(paths, options(lib, attempt), providers)
                break
            except Exception as e:  # a form of an op the kernels do not take: ONNX Runtime's kernel
                errors[tuple(attempt)] = str(e).strip().splitlines()[0][:300]
        for op in ops:
            if self.sessions is None or op not in attempt:
                why = errors.get((op,)) or errors.get(tuple(ops), "")
                if op == "GroupQueryAttention":
                    self.attention = {"kernel": "onnxruntime", "why": why}
                else:
                    self.matmul = {"kernel": "onnxruntime", "why": why}
        try:
            if self.sessions is None:
                self.sessions = self._load(paths, options(), providers)
        except Exception as e:  # ORT raises its own exception types for invalid graphs
            raise ValueError(f"onnxruntime cannot load {manifest.root}: {str(e).splitlines()[0]}") from e
        for g, sess in self.sessions.items():  # the manifest against the graphs, before anything runs
            manifest.check_graph_io(g, _io(sess.get_inputs()), _io(sess.get_outputs()))
        if self.device == "cpu" and self._weights is None:  # (shared numpy maps are read as a whole anyway)
            release_mapped_pages(manifest.root)
        self.dynamic = any(e.dynamic for e in manifest.state)
        # one graph that takes any number of tokens: prefill needs no fixed-size chunks (CPU: numpy buffers)
        self.any_tokens = (
            one
            and not self.dynamic
            and self.device == "cpu"
            and _token_axis(self.sessions["step"], manifest.input_ids_name)
        )
        B, V = manifest.batch_size, manifest.vocab_size
        # On CPU an OrtValue made from a numpy array uses the array's memory: the per-token work is a write
        # into one array and a copy out of another (no OrtValue calls).
        self._ids_np = {g: np.zeros((B, self._tokens(g)), np.int64) for g in ("step", "prefill")}
        last = manifest.prefill_logits == "last"  # a call returns its last token's logits only
        self._logits_np = {
            g: np.zeros((B, 1 if last else self._tokens(g), V), np.float32) for g in ("step", "prefill")
        }
        self._ids = {g: self._alloc_from(a) for g, a in self._ids_np.items()}
        self._logits = {g: self._alloc_from(a) for g, a in self._logits_np.items()}
        # a KV buffer's numpy array on CPU (None elsewhere): its pages stay unmapped until written, and only
        # the slots below the position are ever written or read, so it costs what it holds (session_kv_zeros:
        # 2 MiB huge pages where a KV head's slots are large, 4 KiB pages where they are small); the batch
        # buffers of Streams, written row by row, use kv_zeros
        self._kv_np: list[np.ndarray | None] = []
        self._calls = 0  # graph calls run (what _rewind checks)
        self._steps = None  # the last call's state after each token (verify_states, _keep)
        if self.dynamic:
            self._state = None
            self._reset_state()
            return
        # Two buffers per state tensor; bindings[g][p] reads buffer p and writes buffer 1 - p. A shared
        # entry (a preallocated KV buffer, GroupQueryAttention) has one buffer, read and written in place.
        self._bufs = []
        for e in manifest.state:
            kv = session_kv_zeros(e.shape, e.dtype) if e.shared and self.device == "cpu" else None
            first = self._alloc_from(kv) if kv is not None else self._alloc(e.shape, e.dtype)
            self._bufs.append([first, first if e.shared else self._alloc(e.shape, np.float32)])
            self._kv_np.append(kv)
        self._cur = 0
        self._bindings = {g: [self._bind(g, p) for p in (0, 1)] for g in ("step", "prefill")}

    @staticmethod
    def _load(paths: dict, so, providers) -> dict:
        loaded = {}  # path -> session: a graph that serves as step and prefill is loaded once
        for path in paths.values():
            if path not in loaded:
                loaded[path] = ort.InferenceSession(str(path), so, providers=providers)
        return {g: loaded[path] for g, path in paths.items()}

    @_locked
    def prefill(self, ids, *, chunk: int | None = None) -> np.ndarray:
        """Consume ids [B, T] in chunks of the manifest's prefill tokens; with one graph for any number of
        tokens the rest is one call, not single steps. (Longer calls prefilled up to 1.3x faster at 2 threads,
        benchmarks/RESULTS.md, but ONNX Runtime's arena keeps the activations of the longest call: the
        chunk bounds the memory; export with a larger --prefill-chunk for longer calls.)

        ``chunk``: tokens per call instead of the manifest's, with one graph for any number of tokens only
        (a prefill graph of fixed length takes its own length)."""
        if not self.any_tokens:
            return Session.prefill.__wrapped__(self, ids, chunk=chunk)
        self._check_chunk(chunk, any_tokens=True)
        ids = self._check_ids(ids)
        T = ids.shape[1]
        if T == 0:
            raise ValueError("prefill needs at least one token")
        n = int(chunk or self.manifest.prefill_tokens)
        for c in range(0, T, n):
            logits = self._run_tokens(ids[:, c : c + n])
            self.position += ids[:, c : c + n].shape[1]
        return logits[:, -1]

    def _run_tokens(self, ids: np.ndarray, every: bool = False, steps: bool = False) -> np.ndarray:
        """Run the one graph on ids [B, n] (any n), advancing the state; logits [B, n, V] (an artifact whose
        calls return their last token's logits: [B, 1, V], or with ``every`` [B, n, V] through its
        ``logits_count`` input). ``steps`` (a ``verify_states`` artifact): the state after each token is kept
        for ``_keep``."""
        m = self.manifest
        # count: the logits_count input's name, where a last-only graph is asked for every position's logits
        count = None
        if every and m.prefill_logits == "last" and ids.shape[1] > 1:
            count = m.logits_count
            if count is None:
                raise ValueError(
                    f"{m.root}: this artifact returns a call's last logits only (no logits_count input)"
                )
        if ids.shape[1] == m.prefill_tokens and count is None:
            return self._run("prefill", ids)
        ids = np.ascontiguousarray(ids, np.int64)
        n = 1 if m.prefill_logits == "last" and count is None else ids.shape[1]
        logits = np.empty((ids.shape[0], n, m.vocab_size), np.float32)
        io = self.sessions["prefill"].io_binding()
        io.bind_ortvalue_input(m.input_ids_name, self._alloc_from(ids))
        io.bind_ortvalue_output(m.logits_name, self._alloc_from(logits))
        if count is not None:
            n_np = np.array([n], np.int64)
            io.bind_ortvalue_input(count, self._alloc_from(n_np))
        for e, bufs in zip(self.manifest.state, self._bufs):
            io.bind_ortvalue_input(e.input, bufs[self._cur])
            io.bind_ortvalue_output(e.output, bufs[1 - self._cur])
        self._steps = None
        if steps:
            B, T = ids.shape
            self._steps = [
                np.empty((B, T, *e.shape[1:]), np.float32) if e.steps else None for e in self.manifest.state
            ]
            for e, a in zip(self.manifest.state, self._steps):
                if a is not None:
                    io.bind_ortvalue_output(e.steps, self._alloc_from(a))
        self.sessions["prefill"].run_with_iobinding(io)
        self._cur = 1 - self._cur
        self._calls += 1
        return logits

    # ---- speculative decoding (edgeattn.runtimes.speculative): one call on many tokens, and its undo ----

    def speculative_refusal(self) -> str | None:
        """Why this session cannot verify drafts (None: it can). Verifying k drafts takes one call on k + 1
        tokens that returns the logits of each, and rolling back takes the state as it was before that call:
        the one graph for any number of tokens, its logits at every position, and the double-buffered state."""
        if not self.any_tokens:
            return (
                f"{self.manifest.root}: speculative decoding needs a one-graph artifact for any number of tokens "
                "on the CPU (the onnxruntime target, fp32 or int4, fused recurrences and KV-buffer softmax "
                "layers; export without --target portable)"
            )
        if self.manifest.prefill_logits == "last" and not self.manifest.logits_count:
            return (
                f"{self.manifest.root}: speculative decoding reads the logits of every drafted position; this "
                "artifact returns the last one only and has no logits_count input (exported with --prefill-logits "
                "last by an older edgeattn): export it again"
            )
        return None

    def _mark(self) -> tuple[int, int, int]:
        """What ``_rewind`` restores: which of the two state buffers holds the state, the position, and the
        count of graph calls so far (a rewind past more than one call is refused)."""
        return self._cur, self.position, self._calls

    def _rewind(self, mark: tuple[int, int, int]) -> None:
        """Back to the state at ``mark``, undoing the one graph call made since: the fixed-size state tensors
        are still in the buffer that call read (it wrote the other), and a KV buffer's slots past the restored
        position are never read before they are written again (its position state is double-buffered)."""
        cur, position, calls = mark
        if self._calls - calls > 1:
            raise RuntimeError(f"cannot rewind {self._calls - calls} graph calls; one at most")
        self._cur, self.position, self._calls = cur, position, calls

    def _keep(self, mark: tuple[int, int, int], n: int) -> None:
        """Keep the first ``n`` tokens of the call made since ``mark`` (run with ``steps``): every fixed-size
        state tensor becomes its value after token n (the call's ``steps`` outputs), and the position mark's
        + n (a KV buffer's slots past it are never read before they are written again)."""
        cur, position, calls = mark
        if self._calls - calls != 1 or self._steps is None or not 1 <= n:
            raise RuntimeError("_keep follows one call run with steps, keeping at least one of its tokens")
        for a, bufs in zip(self._steps, self._bufs):
            if a is not None:
                bufs[self._cur].update_inplace(np.ascontiguousarray(a[:, n - 1]))
        self.position = position + n
        self._steps = None

    def _advance_every(self, ids: np.ndarray) -> np.ndarray:
        logits = self._run_tokens(ids, every=True)
        self.position += ids.shape[1]
        return logits

    def forward(self, ids) -> np.ndarray:
        """Run ids [B, n] (any n) through the one graph from the current state, advancing it, and return every
        position's logits [B, n, V] (a ``--prefill-logits last`` artifact's through its ``logits_count``
        input): prompt scoring, speculative decoding's verify call. ``speculative_refusal`` says why an
        artifact cannot (None: it can)."""
        why = self.speculative_refusal()
        if why is not None:
            raise ValueError(why)
        with self.lock:
            return self._verify(ids)

    def _verify(self, ids, steps: bool = False) -> np.ndarray:
        """Run the one graph on ids [B, n] (checked), advancing the state; the logits of every position [B, n, V].
        ``steps``: keep the state after each token (``_keep``; n > 1, a ``verify_states`` artifact)."""
        ids = self._check_ids(ids)
        # one token: the step graph's bindings, made once (a call on another length binds its own buffers)
        if ids.shape[1] == 1 and not steps:
            logits = self._run("step", ids)
        else:
            logits = self._run_tokens(ids, every=True, steps=steps)
        self.position += ids.shape[1]
        return logits

    def _tokens(self, graph: str) -> int:
        return 1 if graph == "step" else self.manifest.prefill_tokens

    def _alloc(self, shape, dtype) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype), self.device, 0)

    def _alloc_from(self, array: np.ndarray) -> ort.OrtValue:
        """An OrtValue over ``array`` itself on CPU (the array must outlive it), a device copy otherwise."""
        return ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)

    def _write_ids(self, graph: str, ids: np.ndarray) -> None:
        if self.device == "cpu":
            self._ids_np[graph][...] = ids
        else:
            self._ids[graph].update_inplace(np.ascontiguousarray(ids))

    def _read_logits(self, graph: str) -> np.ndarray:
        if self.device == "cpu":
            return self._logits_np[graph].copy()
        return self._logits[graph].numpy()  # a host copy of the device buffer

    def _bind(self, graph: str, p: int):
        io = self.sessions[graph].io_binding()
        io.bind_ortvalue_input(self.manifest.input_ids_name, self._ids[graph])
        io.bind_ortvalue_output(self.manifest.logits_name, self._logits[graph])
        for e, bufs in zip(self.manifest.state, self._bufs):
            io.bind_ortvalue_input(e.input, bufs[p])
            io.bind_ortvalue_output(e.output, bufs[1 - p])
        return io

    def _run(self, graph: str, ids: np.ndarray) -> np.ndarray:
        self._write_ids(graph, ids)
        if not self.dynamic:
            self.sessions[graph].run_with_iobinding(self._bindings[graph][self._cur])
            self._cur = 1 - self._cur
            self._calls += 1
            return self._read_logits(graph)
        io = self.sessions[graph].io_binding()
        io.bind_ortvalue_input(self.manifest.input_ids_name, self._ids[graph])
        io.bind_ortvalue_output(self.manifest.logits_name, self._logits[graph])
        for e, val in zip(self.manifest.state, self._state):
            io.bind_ortvalue_input(e.input, val)
            io.bind_output(e.output, self.device)
        self.sessions[graph].run_with_iobinding(io)
        self._state = io.get_outputs()[1:]
        return self._read_logits(graph)

    def _current(self) -> list[ort.OrtValue]:
        return self._state if self.dynamic else [bufs[self._cur] for bufs in self._bufs]

    def _filled(self, state: dict[str, np.ndarray]) -> int:
        """Slots of the KV buffers that ``state`` fills: its largest position (GroupQueryAttention reads and
        writes no slot at or past it before the position moves on)."""
        pos = [state[e.input] for e in self.manifest.state if e.name == "position"]
        return int(np.ceil(max((float(p.max()) for p in pos if p.size), default=0.0)))

    def _get_state(self, native: bool = False) -> dict[str, np.ndarray]:
        """float32 copies (a float16 KV buffer widened, an int8 one times its scales); with ``native`` the KV
        buffers' copies in their own dtype, as the graph holds them (what ``Streams`` writes into its batch
        rows: no float32 round trip)."""
        kvs = self._kv_np or [None] * len(self.manifest.state)
        out = {
            e.input: v.numpy().copy() if native else kv_to_float(e, v.numpy())  # numpy(): a view on CPU
            for e, v, kv in zip(self.manifest.state, self._current(), kvs)
            if kv is None
        }
        n = self._filled(out)
        for e, kv in zip(self.manifest.state, kvs):
            if kv is not None:  # the filled slots only; those past the position hold stale tokens, never
                a = kv_zeros(kv.shape, kv.dtype if native else np.float32)  # read: zeros (uncommitted pages)
                a[:, :, :n] = kv[:, :, :n] if native else kv_to_float(e, kv[:, :, :n])
                out[e.input] = a
        return {e.input: out[e.input] for e in self.manifest.state}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        if self.dynamic:
            self._state = [
                ort.OrtValue.ortvalue_from_numpy(kv_from_float(e, state[e.input]), self.device, 0)
                for e in self.manifest.state
            ]
            return
        n = self._filled(state)
        for e, v, kv in zip(self.manifest.state, self._current(), self._kv_np):
            if kv is None:
                v.update_inplace(kv_from_float(e, state[e.input]))
            else:  # only the filled slots: a reset or a short context leaves the rest of the buffer unmapped
                kv[:, :, :n] = kv_from_float(e, state[e.input][:, :, :n])

    def _reset_state(self) -> None:
        zeros = {
            e.input: np.zeros([0 if isinstance(d, str) else d for d in e.shape], np.float32)
            for e in self.manifest.state
        }
        self._set_state(zeros)
