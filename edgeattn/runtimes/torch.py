"""PyTorch backend: the checkpoint stored in the artifact. The reference for `check`.

On CUDA a one-token step runs as a CUDA graph (``TorchSession.cuda_graph``), by default for models whose
every layer keeps a fixed-size state (softmax layers step eagerly: a growing cache changes shape, a
preallocated buffer is written at a position read on the host; ``graph_obstacle``): the model's step
captured once, at the first step, over static state buffers that each replay reads and writes in place.
On an H200 the 92.5M GLA's step took 1.14 ms as a graph against 8.9 ms eagerly (RESULTS.md, issue 36).
Prefill calls run eagerly; a state they leave (or ``set_state``/``reset``) is copied into the static
buffers at the next step. A capture that fails leaves the session eager, with one warning.
"""

from __future__ import annotations

import warnings

import numpy as np

from edgeattn._deps import require
from edgeattn.artifact.manifest import Manifest
from edgeattn.runtimes.base import Session


def check_model(manifest: Manifest, model) -> None:
    """The manifest against the checkpoint this backend runs: vocabulary and state tensors (ValueError)."""
    where = f"{manifest.root}/edgeattn.json"
    if manifest.vocab_size != model.cfg.vocab_size:
        raise ValueError(
            f"{where} says vocab_size {manifest.vocab_size}, its checkpoint has {model.cfg.vocab_size}"
        )
    specs = [
        (layer, s)
        for layer, layer_specs in enumerate(model.state_spec(manifest.batch_size))
        for s in layer_specs
    ]
    entries = [(e.layer, e.name, tuple(e.shape)) for e in manifest.state]
    expected = [(layer, s.name, tuple(s.shape)) for layer, s in specs]
    if entries != expected:
        diff = next(
            (f"{a} != {b}" for a, b in zip(entries, expected) if a != b),
            f"{len(entries)} entries != {len(expected)}",
        )
        raise ValueError(f"{where}: the state list does not match its checkpoint's state ({diff})")


class TorchSession(Session):
    backend = "torch"

    def __init__(
        self,
        manifest: Manifest,
        *,
        threads: int | None = None,
        device: str | None = None,
        cuda_graph: bool | None = None,
    ):
        super().__init__(manifest)
        self.torch = torch = require("torch")
        from edgeattn.models import EdgeLM

        ckpt = manifest.data.get("checkpoint")
        if not ckpt:
            raise ValueError(
                f"{manifest.root} was exported with --no-checkpoint: the torch backend needs the checkpoint "
                "inside the artifact (export again without --no-checkpoint)"
            )
        if threads:
            torch.set_num_threads(threads)
        self.device = device or "cpu"
        self.model = EdgeLM.load(manifest.root / ckpt).to(self.device).eval()
        shared = {e.layer for e in manifest.state if e.shared}  # the graphs' preallocated KV buffers
        if shared:
            self.model.set_kv_buffers(manifest.max_length, layers=shared)
        check_model(manifest, self.model)
        self.specs = [(e.input, e.layer, e.name) for e in manifest.state]
        # steps as a CUDA graph: the default on CUDA (None) where the step can be captured, never elsewhere
        cuda = self.device.startswith("cuda")
        why_not = graph_obstacle(manifest)
        if cuda_graph and not cuda:
            raise ValueError(f"cuda_graph needs a CUDA device, this session runs on {self.device!r}")
        if cuda_graph and why_not:
            raise ValueError(f"{manifest.root}: {why_not}")
        self.cuda_graph = cuda and not why_not and (cuda_graph is None or bool(cuda_graph))
        self._graph = None  # the captured step: StepGraph, or the reason its capture failed (a str)
        self._reset_state()

    def _run(self, graph: str, ids: np.ndarray) -> np.ndarray:
        if graph == "step" and self.cuda_graph and not isinstance(self._graph, str):
            logits = self._graph_step(ids)
            if logits is not None:
                return logits
        with self.torch.no_grad():
            logits, self._state = self.model(self.torch.from_numpy(ids).to(self.device), self._state)
        return logits.float().cpu().numpy()

    def _graph_step(self, ids: np.ndarray) -> np.ndarray | None:
        """One step through the captured graph (captured now if not yet); None if it cannot be captured."""
        if self._graph is None:
            try:
                self._graph = capture_step(self.torch, self.model, self._state, ids.shape, self.device)
            except Exception as e:  # noqa: BLE001 -- any capture failure: the session stays eager
                self._graph = f"{type(e).__name__}: {e}"
                warnings.warn(f"the torch backend steps eagerly: capturing its step as a CUDA graph failed "
                              f"({self._graph})", RuntimeWarning, stacklevel=4)  # fmt: skip
                return None
        g = self._graph
        if tuple(ids.shape) != tuple(g.ids.shape):  # another batch (a dynamic-batch artifact): eagerly
            return None
        if self._state is not g.state:  # a prefill, set_state or reset left other tensors: copy them in
            pairs = [
                (v, current[k]) for static, current in zip(g.state, self._state) for k, v in static.items()
            ]
            if any(v.shape != c.shape for v, c in pairs):
                return None
            for v, c in pairs:
                v.copy_(c)
            self._state = g.state
        g.ids.copy_(self.torch.from_numpy(ids))
        g.graph.replay()
        return g.logits.float().to("cpu", copy=True).numpy()  # a copy: the next replay overwrites logits

    def _get_state(self) -> dict[str, np.ndarray]:
        return {name: self._state[layer][key].cpu().numpy().copy() for name, layer, key in self.specs}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        new = [dict() for _ in self.model.mixers]
        for name, layer, key in self.specs:
            new[layer][key] = self.torch.from_numpy(np.array(state[name])).to(self.device)
        self._state = new

    def _reset_state(self) -> None:
        self._state = self.model.init_state(self.manifest.batch_size, self.device)


def graph_obstacle(manifest: Manifest) -> str | None:
    """Why this artifact's step cannot run as a CUDA graph, or None: a growing state (a softmax layer's
    KV cache) changes shape every step; a preallocated KV buffer is written at a position read on the host."""
    if not all(isinstance(d, int) for e in manifest.state for d in e.shape[1:]):
        return "its state grows (a softmax layer's KV cache): a CUDA graph needs a fixed-size state"
    if any(e.shared for e in manifest.state):
        return (
            "its softmax layers' KV buffers are written at a position read on the host: a CUDA graph "
            "cannot hold that step"
        )
    return None


class StepGraph:
    """A model's one-token step captured as a CUDA graph: ``graph.replay()`` reads ``ids`` [B, 1] and
    ``state`` (static tensors, the model's state layout) and writes ``logits`` and the next state (into
    ``state``)."""

    def __init__(self, graph, ids, state, logits):
        self.graph, self.ids, self.state, self.logits = graph, ids, state, logits


def capture_step(torch, model, state: list[dict], shape: tuple, device: str) -> StepGraph:
    """Capture ``model``'s step for ids of ``shape`` ([B, 1]) over static copies of ``state``. Two eager
    warm-up steps on a side stream first (the allocator and lazy initialisations, as PyTorch's guide says);
    they and the capture run on copies, so ``state`` itself is not advanced."""
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    static = [{k: v.clone() for k, v in layer.items()} for layer in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            model(ids, [{k: v.clone() for k, v in layer.items()} for layer in static])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        logits, new = model(ids, static)
        for d, n in zip(static, new):
            for k in d:
                d[k].copy_(n[k])
    return StepGraph(graph, ids, static, logits)
