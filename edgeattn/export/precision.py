"""fp16 and int8 versions of an exported graph, with the recurrent state kept in float32.

- fp16: ONNX Runtime's float16 converter. Graph inputs and outputs stay float32 (``keep_io_types``);
  every node that reads or writes a state tensor, the decay arithmetic (Exp, CumSum, Softplus, Log) and
  the fused LinearAttention op stay float32 too, so the state never passes through float16.
- int8: ONNX Runtime's dynamic quantization of the MatMul projections whose weights are initializers
  (int8 weights, activations quantized per call); the recurrence itself is untouched.
- int4: weight-only blockwise quantization with ONNX Runtime's ``MatMulNBitsQuantizer``: every MatMul with
  an initializer weight becomes ``com.microsoft.MatMulNBits`` (the tied lm head included) and the embedding
  ``Gather`` becomes ``com.microsoft.GatherBlockQuantized``; activations, gates and the state stay float32.
  Options (``INT4_DEFAULTS``): ``block_size`` (a power of two >= 16: 32 or 128), ``symmetric`` (no zero
  points), ``accuracy_level`` (4: int8 activations inside MatMulNBits, ONNX Runtime's fast CPU path).
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


INT4_DEFAULTS = {"block_size": 32, "symmetric": True, "accuracy_level": 4}
INT4_OPSET = 21  # GatherBlockQuantized stores int4 tensors, a type of opset 21 (IR 10)


def quantize_int4(model, block_size: int = 32, symmetric: bool = True, accuracy_level: int = 4):
    """The model with MatMul weights as MatMulNBits (4 bits) and the embedding as GatherBlockQuantized."""
    from onnx import version_converter
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (32 or 128), got {block_size}")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ValueError(f"accuracy_level must be 0..4 (MatMulNBits' attribute), got {accuracy_level}")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs every node on the root logger
    try:
        # the quantizer would only relabel the opset; the converter rewrites the ops that changed
        model = version_converter.convert_version(model, INT4_OPSET)
        q = MatMulNBitsQuantizer(
            model,
            bits=4,
            block_size=block_size,
            is_symmetric=symmetric,
            accuracy_level=accuracy_level,
            op_types_to_quantize=("MatMul", "Gather"),
            quant_axes=(("MatMul", 0), ("Gather", 1)),
        )
        q.process()
    finally:
        root.setLevel(level)
    return q.model.model


def convert_precision(path: Path, precision: str, entries: list[dict], **options) -> None:
    """Rewrite the graph at ``path`` in ``precision`` (in place, atomically); ``options`` are int4's."""
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
        elif precision == "int4":
            onnx.save(quantize_int4(model, **{**INT4_DEFAULTS, **options}), tmp)
        else:
            raise ValueError(f"unknown precision {precision!r}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
