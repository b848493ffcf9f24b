"""The torch backend's steps as a CUDA graph (edgeattn.runtimes.torch): the session's bookkeeping around
the captured step, checked here on the CPU with a stand-in for the capture whose replay runs the model on
the graph's static buffers in place, as a replay does. Against a plain eager session on the same calls:
prefill, steps, a rollback through get_state/set_state, reset. The capture itself runs only on a GPU
(benchmarks/gpu_check.py's decode section: a session's graph steps against its eager ones)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeattn.runtimes import open_session
from edgeattn.runtimes import torch as torch_runtime
from tests.serve_helpers import export_tiny


class EagerReplay:
    """A capture's stand-in: ``replay`` computes the step on the static buffers and writes them in place."""

    def __init__(self, model, g):
        self.model, self.g, self.replays = model, g, 0

    def replay(self):
        self.replays += 1
        with torch.no_grad():
            logits, new = self.model(self.g.ids, self.g.state)
        for d, n in zip(self.g.state, new):
            for k in d:
                d[k].copy_(n[k])
        self.g.logits.copy_(logits)


@pytest.fixture
def captures(monkeypatch):
    made = []

    def capture(torch_, model, state, shape, device):
        static = [{k: v.clone() for k, v in layer.items()} for layer in state]
        g = torch_runtime.StepGraph(None, torch.zeros(shape, dtype=torch.long), static, None)
        g.logits = torch.zeros(shape[0], 1, model.cfg.vocab_size)
        g.graph = EagerReplay(model, g)
        made.append(g)
        return g

    monkeypatch.setattr(torch_runtime, "capture_step", capture)
    return made


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("graph")


@pytest.fixture(scope="module")
def gla(root):
    """Two GLA layers: a fixed-size state, what the torch backend captures by default on CUDA."""
    return export_tiny(root, "gla", dynamic_batch=False)


@pytest.fixture(scope="module")
def hybrid(root):
    """GLA and a softmax layer with a preallocated KV buffer (its state: key, value, position)."""
    return export_tiny(root, "gla,softmax", dynamic_batch=False)


def test_graph_steps_equal_eager_steps_through_prefill_rollback_and_reset(gla, captures):
    graphed = open_session(gla, backend="torch")
    graphed.cuda_graph = True  # what a CUDA device sets; the capture is the stand-in
    eager = open_session(gla, backend="torch")
    assert not eager.cuda_graph  # the default off CUDA
    rng = np.random.default_rng(0)
    vocab = graphed.manifest.vocab_size
    prompt = rng.integers(0, vocab, size=(1, graphed.manifest.prefill_tokens + 3))
    toks = rng.integers(0, vocab, size=12)
    outs = {}
    for name, s in (("graph", graphed), ("eager", eager)):
        got = [s.prefill(prompt)]
        got += [s.step([[t]]) for t in toks[:4]]
        snap, pos = s.get_state(), s.position
        got += [s.step([[t]]) for t in toks[4:7]]
        s.set_state(snap, pos)  # roll back three tokens
        got += [s.step([[t]]) for t in toks[7:10]]
        s.reset()
        got += [s.step([[t]]) for t in toks[10:12]]
        got += [s.prefill(prompt), s.step([[toks[0]]])]
        outs[name] = got
    (g,) = captures
    # every step through the graph, the prefill graph's calls eagerly (a prompt's last 3 tokens are steps)
    assert g.graph.replays == 4 + 3 + 3 + 2 + 1 + 2 * 3
    for i, (a, b) in enumerate(zip(outs["graph"], outs["eager"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"call {i}")
    # the rolled-back steps differ from the first ones after the snapshot: the state is what they read
    assert not np.allclose(outs["eager"][5], outs["eager"][8])


def test_a_failed_capture_leaves_the_session_eager_with_one_warning(gla, monkeypatch):
    calls = []

    def fail(*a):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch_runtime, "capture_step", fail)
    s = open_session(gla, backend="torch")
    s.cuda_graph = True
    ref = open_session(gla, backend="torch")
    with pytest.warns(RuntimeWarning, match="steps eagerly: capturing its step as a CUDA graph failed"):
        a = s.step([[5]])
    b = [s.step([[6]]), s.step([[7]])]
    assert calls == [1]  # not tried again
    for x, y in zip([a, *b], [ref.step([[5]]), ref.step([[6]]), ref.step([[7]])]):
        np.testing.assert_array_equal(x, y)


def test_only_fixed_state_models_without_kv_buffers_are_captured(gla, hybrid):
    from edgeattn.artifact.manifest import Manifest

    assert torch_runtime.graph_obstacle(Manifest.load(gla)) is None
    why = torch_runtime.graph_obstacle(Manifest.load(hybrid))
    assert why and "KV buffers are written at a position read on the host" in why


def test_cuda_graph_option_errors(hybrid):
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device, this session runs on 'cpu'"):
        open_session(hybrid, backend="torch", cuda_graph=True)
    with pytest.raises(
        ValueError, match="cuda_graph is an option of the torch backend, not of 'onnxruntime'"
    ):
        open_session(hybrid, backend="onnxruntime", cuda_graph=False)
    assert open_session(hybrid, backend="torch", cuda_graph=False).cuda_graph is False
