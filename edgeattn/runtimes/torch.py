"""PyTorch backend: the checkpoint stored in the artifact, run eagerly. The reference for `check`."""

from __future__ import annotations

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

    def __init__(self, manifest: Manifest, *, threads: int | None = None, device: str | None = None):
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
        self._reset_state()

    def _run(self, graph: str, ids: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            logits, self._state = self.model(self.torch.from_numpy(ids).to(self.device), self._state)
        return logits.float().cpu().numpy()

    def _get_state(self) -> dict[str, np.ndarray]:
        return {name: self._state[layer][key].cpu().numpy().copy() for name, layer, key in self.specs}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        new = [dict() for _ in self.model.mixers]
        for name, layer, key in self.specs:
            new[layer][key] = self.torch.from_numpy(np.array(state[name])).to(self.device)
        self._state = new

    def _reset_state(self) -> None:
        self._state = self.model.init_state(self.manifest.batch_size, self.device)
