"""fp16 and int8 versions of an exported graph, with the recurrent state kept in float32.

- fp16: ONNX Runtime's float16 converter. Graph inputs and outputs stay float32 (``keep_io_types``);
  every node that reads or writes a state tensor, the decay arithmetic (Exp, CumSum, Softplus, Log) and
  the fused LinearAttention op stay float32 too, so the state never passes through float16.
- int8: ONNX Runtime's dynamic quantization of the MatMul projections whose weights are initializers
  (int8 weights, activations quantized per call); the recurrence itself is untouched.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

FP32_OPS = [
    "Exp",
    "CumSum",
    "Softplus",
    "Log",
    "LinearAttention",
    "Softmax",
    "ReduceMean",
    "Pow",
    "Sqrt",
    "Div",
]


def _state_nodes(model, entries) -> list[str]:
    names = {e["input"] for e in entries} | {e["output"] for e in entries}
    return [n.name for n in model.graph.node if names & (set(n.input) | set(n.output))]


def convert_precision(path: Path, precision: str, entries: list[dict]) -> None:
    """Rewrite the graph at ``path`` in ``precision`` (in place, atomically)."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path))
    for i, n in enumerate(model.graph.node):  # the converter's node_block_list needs names
        if not n.name:
            n.name = f"{n.op_type}_{i}"
    fd, tmp = tempfile.mkstemp(suffix=".onnx", dir=path.parent)
    os.close(fd)
    try:
        if precision == "fp16":
            from onnxruntime.transformers.float16 import convert_float_to_float16

            converted = convert_float_to_float16(
                model,
                keep_io_types=True,
                op_block_list=FP32_OPS,
                node_block_list=_state_nodes(model, entries),
            )
            onnx.save(converted, tmp)
        elif precision == "int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            weights = {i.name for i in model.graph.initializer}
            matmuls = [
                n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & weights
            ]
            src = tmp + ".src.onnx"
            onnx.save(model, src)
            root = logging.getLogger()
            level = root.level
            root.setLevel(logging.ERROR)  # the quantizer logs advice on the root logger
            try:
                quantize_dynamic(src, tmp, nodes_to_quantize=matmuls, weight_type=QuantType.QInt8)
            finally:
                root.setLevel(level)
                os.unlink(src)
        else:
            raise ValueError(f"unknown precision {precision!r}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
