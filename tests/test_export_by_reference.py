"""The large-model helpers of the export (``edgeattn.export.graph``'s by-reference initializers, and the
exporter's ``_write_weights`` after torch wrote placeholders): values checked against numpy and against
``onnx.load`` with its own external-data loading."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from edgeattn.export import exporter, graph


def _model(arrays: dict):
    """A graph of Identity nodes reading the initializers ``arrays``."""
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in arrays]
    outs = [helper.make_tensor_value_info(f"{n}_out", 1, list(a.shape)) for n, a in arrays.items()]
    return helper.make_model(helper.make_graph(nodes, "g", [], outs, initializer=inits))


def test_by_reference_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(graph, "BY_REFERENCE_ELEMENTS", 100)
    rng = np.random.default_rng(0)
    arrays = {
        "big": rng.standard_normal((30, 20), np.float32),
        "small": rng.standard_normal(8).astype(np.float32),
    }
    path = tmp_path / "g.onnx"
    # torch's layout for large models: every tensor over 1 KB in a file of its own beside the graph
    onnx.save(
        _model(arrays), str(path), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0
    )
    m = graph.load_by_reference(path)
    inits = {i.name: i for i in m.graph.initializer}
    assert graph.is_by_reference(inits["big"]) and not inits["big"].raw_data
    assert not inits["small"].external_data and inits["small"].raw_data  # small ones come inline
    for n, a in arrays.items():
        assert np.array_equal(graph.initializer_array(inits[n]), a)
    # a pass adds a large inline weight; reference_large moves it to a file and returns a new message
    m.graph.initializer.append(numpy_helper.from_array(arrays["big"] * 2, "fused"))
    spilled = graph.reference_large(m, tmp_path / "spill.bin")
    fused = next(i for i in spilled.graph.initializer if i.name == "fused")
    assert graph.is_by_reference(fused) and np.array_equal(graph.initializer_array(fused), arrays["big"] * 2)
    assert spilled.ByteSize() < 30 * 20 * 4  # no large values in the message
    graph.materialize(spilled)
    assert not any(graph.is_by_reference(i) for i in spilled.graph.initializer)
    again = {i.name: numpy_helper.to_array(i) for i in spilled.graph.initializer}
    assert np.array_equal(again["fused"], arrays["big"] * 2) and np.array_equal(again["big"], arrays["big"])


def test_write_weights_fills_torch_placeholders_with_the_real_tensors(tmp_path):
    rng = np.random.default_rng(1)
    table = torch.from_numpy(rng.standard_normal((40, 24), np.float32))
    real = {"w": torch.from_numpy(rng.standard_normal((24, 16), np.float32)), "t": table.t()}  # t: a view
    zeros = {n: np.zeros(tuple(t.shape), np.float32) for n, t in real.items()}
    path = tmp_path / "g.onnx"
    onnx.save(
        _model(zeros), str(path), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0
    )
    exporter._write_weights(path, real, chunk_bytes=100)  # chunks of a few rows
    loaded = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    for n, t in real.items():
        assert np.array_equal(loaded[n], t.numpy()), n


def test_write_weights_refuses_an_inline_or_absent_weight(tmp_path):
    path = tmp_path / "g.onnx"
    onnx.save(_model({"w": np.zeros((4, 4), np.float32)}), str(path))  # inline
    with pytest.raises(RuntimeError, match="inline"):
        exporter._write_weights(path, {"w": torch.ones(4, 4)})
    with pytest.raises(RuntimeError, match="not in the traced graph"):
        exporter._write_weights(path, {"other": torch.ones(4, 4)})
