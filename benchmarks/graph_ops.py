"""Op counts of the decode graphs ONNX Runtime actually runs: edgeattn's step.onnx (unoptimized and with the
export-time pass of edgeattn.export.optimize) against onnxruntime-genai's model builder.

Every graph is loaded by ONNX Runtime with ``ORT_ENABLE_EXTENDED`` (the level whose fusions can be saved as
ONNX; ``ORT_ENABLE_ALL`` adds only layout changes on CPU, measured equal for these graphs) and the saved
optimized graph is counted. Models: 4 layers, d_model 256, 4 heads, vocabulary 256, random weights; genai's
Llama and Qwen3.5 (every layer linear attention) are built from transformers configs by its builder,
as in benchmarks/peers.py.

    python benchmarks/graph_ops.py [--models edgeattn-gla,edgeattn-gated_deltanet,genai-llama,genai-qwen35-gdn]

Prints a table of op counts, then one JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

sys.path.insert(0, str(Path(__file__).parent))

SIZE = dict(d_model=256, n_layers=4, n_heads=4)
MODELS = ["edgeattn-gla", "edgeattn-gated_deltanet", "genai-llama", "genai-qwen35-gdn"]


def ort_ops(path: Path) -> Counter:
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(path.with_suffix(".ort-optimized.onnx"))
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    model = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return Counter(n.op_type for n in model.graph.node)


def build(root: Path, name: str) -> dict[str, Path]:
    import peers
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    if name.startswith("edgeattn-"):
        mixer = name.removeprefix("edgeattn-")
        torch.manual_seed(0)
        ckpt = EdgeLM(EdgeConfig(vocab_size=peers.VOCAB, mixer=mixer, **SIZE)).save(root / f"{mixer}-ckpt")
        return {
            f"{name} ({'optimized' if opt else 'unoptimized'})": export_model(
                ckpt, root / f"{name}-{opt}", optimize=opt, include_checkpoint=False
            )
            / "step.onnx"
            for opt in (False, True)
        }
    out, _ = peers.build_genai(root, name.removeprefix("genai-"), SIZE, 3_576_064, 512)
    return {name: out / "model.onnx"}


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=lambda s: s.split(","), default=MODELS)
    args = ap.parse_args()
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for label, path in build(Path(tmp), name).items():
                counts[label] = ort_ops(path)
    ops = sorted({op for c in counts.values() for op in c})
    print("| op | " + " | ".join(counts) + " |")
    print("|---|" + "---|" * len(counts))
    for op in ["nodes", "MatMul+Gemm", *ops]:
        row = []
        for c in counts.values():
            row.append(
                sum(c.values())
                if op == "nodes"
                else c["MatMul"] + c["Gemm"]
                if op == "MatMul+Gemm"
                else c[op]
            )
        print(f"| {op} | " + " | ".join(str(v) for v in row) + " |")
    print(
        json.dumps(
            with_cpu(
                {"benchmark": "graph_ops", "size": SIZE, "counts": {k: dict(v) for k, v in counts.items()}}
            )
        )
    )


if __name__ == "__main__":
    main()
