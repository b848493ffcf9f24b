"""benchmarks/profile_ops.py on a tiny edgeattn artifact: kernel time by op type, by layer and by layer kind
(each layer's mixer from the manifest beside the graph)."""

import sys
from pathlib import Path

from edgeattn.export import export_model
from tests.export_helpers import make_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from profile_ops import profile  # noqa: E402


def test_profile_splits_a_prefill_call_by_layer_kind(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gated_deltanet,softmax")
    art = export_model(ckpt, tmp_path / "art", prefill_chunk=8, include_checkpoint=False)
    r = profile(str(art / "step.onnx"), threads=1, steps=2, tokens=8)
    kinds = {(x["kind"], x["op"]) for x in r["kinds"]}
    assert ("gated_deltanet", "LinearAttention") in kinds and ("softmax", "GroupQueryAttention") in kinds
    assert not {op for k, op in kinds if k == "softmax"} & {"LinearAttention", "CausalConvWithState"}
    assert abs(sum(x["ms"] for x in r["kinds"]) - r["kernel_ms"]) < 1e-6 * max(1.0, r["kernel_ms"])
    assert set(r["layers"]) == {"0", "1", "other"}
