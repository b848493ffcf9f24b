"""A tied embedding stored once (edgeattn.export.optimize.share_tied_embedding) and int4 embeddings in the
shared weights file: sizes against the torch model's parameter bytes, logits against the un-deduplicated
export and the torch model."""

import json

import numpy as np
import onnx
import pytest
import torch

from edgeattn.export import export_model
from edgeattn.export.manifest import Manifest
from edgeattn.export.optimize import share_tied_embedding
from edgeattn.models import EdgeLM
from edgeattn.runtimes.onnxruntime import shared_initializers
from tests.export_helpers import PREFILL, make_checkpoint, text_ids
from tests.test_optimize import run

V, D = 256, 32  # tiny_config's vocabulary and width


def stored(art) -> dict:
    """Bytes of the weights file's tensors and how many of them are the embedding or its transpose."""
    tensors = json.loads((art / "edgeattn.json").read_text())["weights"]["tensors"]
    return {
        "bytes": sum(t["length"] for t in tensors),
        "embeddings": sum(sorted(t["shape"]) == [D, V] for t in tensors),
    }


def param_bytes(ckpt) -> int:
    model = EdgeLM.load(ckpt)
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied tensor counted once


def torch_logits(ckpt, ids) -> np.ndarray:
    model = EdgeLM.load(ckpt).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids))[0][:, -1].numpy()  # the last token's [B, V]


@pytest.mark.parametrize(
    "target, one_graph", [("onnxruntime", False), ("portable", None), ("onnxruntime", None)]
)
def test_tied_embedding_stored_once_same_logits(tmp_path, target, one_graph):
    """Stored once (the Gather reads E^T by column) except in the fp32 graph ONNX Runtime loads once, which
    keeps E for a row Gather (ONNX Runtime then maps only the rows read, and releases E^T once prepacked)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    arts = {
        opt: export_model(
            ckpt,
            tmp_path / f"a{opt}",
            target=target,
            prefill_chunk=PREFILL,
            optimize=opt,
            one_graph=one_graph,
        )
        for opt in (False, True)
    }
    rows = target == "onnxruntime" and one_graph is None
    assert sorted(p.name for p in arts[True].glob("*.onnx")) == (
        ["step.onnx"] if rows else ["prefill.onnx", "step.onnx"]
    )
    before, after = stored(arts[False]), stored(arts[True])
    assert before["embeddings"] == 2 and after["embeddings"] == (2 if rows else 1)
    assert before["bytes"] - after["bytes"] == (0 if rows else V * D * 4)
    assert after["bytes"] <= param_bytes(ckpt) + (V * D * 4 if rows else 0)  # small ones stay in the graphs
    for g in arts[True].glob("*.onnx"):
        graph = onnx.load(str(g))
        gathers = [n for n in graph.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
        axes = [onnx.helper.get_attribute_value(n.attribute[0]) if n.attribute else 0 for n in gathers]
        assert axes == [0 if rows else 1]
        shapes = {i.name: list(i.dims) for i in graph.graph.initializer}
        assert shapes[gathers[0].input[0]] == ([V, D] if rows else [D, V])
    ids = text_ids(PREFILL + 5)
    (ref, ref_state), (got, got_state) = (run(arts[opt], ids, 4) for opt in (False, True))
    scale = max(1.0, np.abs(ref).max())
    assert np.abs(got - ref).max() <= 1e-5 * scale
    for name, s in ref_state.items():
        assert np.abs(got_state[name] - s).max() <= 1e-5 * max(1.0, np.abs(s).max()), name
    # against the torch model: the prefill's logits of every token
    from edgeattn.runtimes import open_session

    want = torch_logits(ckpt, ids[:, :PREFILL])
    have = open_session(arts[True], threads=1).prefill(ids[:, :PREFILL])
    assert np.abs(have - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def test_untied_model_unchanged(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tie_embeddings=False)
    art = export_model(ckpt, tmp_path / "a", prefill_chunk=PREFILL)
    assert stored(art)["embeddings"] == 2  # the embedding and the head: two different tensors
    graph = onnx.load(str(art / "step.onnx"))
    nodes = len(graph.graph.node)
    assert share_tied_embedding(graph) == 0 and len(graph.graph.node) == nodes


def test_int4_embedding_moves_to_the_weights_file(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    apart = {"share_embedding": False}  # the embedding's own int4 table (a tied one reads the head's)
    art = export_model(ckpt, tmp_path / "a", precision="int4", prefill_chunk=PREFILL, quantization=apart)
    tensors = json.loads((art / "edgeattn.json").read_text())["weights"]["tensors"]
    packed = [t for t in tensors if t["dtype"] in ("int4", "uint4")]
    assert [(t["shape"], t["length"]) for t in packed] == [([V, D], V * D // 2)]
    for g in art.glob("*.onnx"):
        graph = onnx.load(str(g), load_external_data=False)
        q4 = [i for i in graph.graph.initializer if i.data_type in (21, 22)]
        assert q4 and all(i.data_location == onnx.TensorProto.EXTERNAL for i in q4)
        assert g.stat().st_size < V * D // 2 * 8  # no weights inside
    # the Python runtime's shared-initializer table skips the packed tensor instead of failing on it
    manifest = Manifest.load(art)
    assert set(shared_initializers(manifest)).isdisjoint({n for t in packed for n in t["names"]})
    # same logits as the layout before (the int4 tensor inside each graph)
    import edgeattn.export.weights as weights

    old = {k: v for k, v in weights.ONNX_DTYPES.items() if v not in ("int4", "uint4")}
    monkeypatch.setattr(weights, "ONNX_DTYPES", old)
    inside = export_model(ckpt, tmp_path / "b", precision="int4", prefill_chunk=PREFILL, quantization=apart)
    assert all(t["dtype"] not in ("int4", "uint4") for t in Manifest.load(inside).weights["tensors"])
    ids = text_ids(PREFILL + 5)
    (got, got_state), (ref, ref_state) = run(art, ids, 4), run(inside, ids, 4)
    assert np.array_equal(got, ref) and all(np.array_equal(got_state[k], v) for k, v in ref_state.items())
