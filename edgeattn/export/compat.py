"""What TensorRT 10's ONNX parser would refuse in a graph, checked here without TensorRT.

The op list follows the TensorRT 10 ONNX parser's support matrix (onnx-tensorrt ``docs/operators.md``).
On top of it edgeattn's `portable` target promises: default domain only, no Loop/Scan, no float64,
CumSum with a constant axis.
"""

from __future__ import annotations

TENSORRT10_OPS = frozenset(
    """Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
    BlackmanWindow Cast CastLike Ceil Celu Clip Compress Concat ConcatFromSequence Constant ConstantOfShape Conv
    ConvTranspose Cos Cosh CumSum DFT DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf
    Exp Expand EyeLike Flatten Floor GRU Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool
    GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization HammingWindow HannWindow HardSigmoid
    HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LRN LSTM LayerNormalization
    LeakyRelu Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or PRelu Pad
    ParametricSoftplus Pow QuantizeLinear RNN RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range
    Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum
    ReduceSumSquare Relu Reshape Resize ReverseSequence RoiAlign Round STFT ScaledTanh Scan Scatter ScatterElements
    ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt
    Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor""".split()
)
# Supported by the parser, but edgeattn's portable graphs promise to avoid them (TensorRT runs them slowly
# or only in restricted forms).
AVOIDED_OPS = frozenset({"Loop", "Scan", "If", "NonZero"})


def tensorrt_report(model) -> list[str]:
    """Problems TensorRT 10 would have with ``model`` (an onnx.ModelProto); empty when it should parse."""
    from onnx import TensorProto

    problems = []
    constants = {init.name for init in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    for node in model.graph.node:
        where = f"{node.op_type} node {node.name or node.output[0]!r}"
        if node.domain not in ("", "ai.onnx"):
            problems.append(f"{where}: custom domain {node.domain!r} (TensorRT needs a plugin)")
        elif node.op_type not in TENSORRT10_OPS:
            problems.append(f"{where}: op not supported by the TensorRT 10 ONNX parser")
        elif node.op_type in AVOIDED_OPS:
            problems.append(f"{where}: control flow / data-dependent shapes, avoided by the portable target")
        if node.op_type == "CumSum" and node.input[1] not in constants:
            problems.append(f"{where}: CumSum axis must be a constant")
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to == TensorProto.DOUBLE:
                problems.append(f"{where}: casts to float64, which TensorRT does not support")
    for init in model.graph.initializer:
        if init.data_type == TensorProto.DOUBLE:
            problems.append(f"initializer {init.name!r}: float64")
    return problems
