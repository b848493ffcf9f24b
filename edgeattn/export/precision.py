"""fp16 and int8 versions of an exported graph, with the recurrent state kept in float32.

- fp16: ONNX Runtime's float16 converter. Graph inputs and outputs stay float32 (``keep_io_types``);
  every node that reads or writes a state tensor, the fused LinearAttention op, the whole log-space gate
  arithmetic (from the gate through its cumulative sums and their differences to the Exp) and each norm's
  mean square stay float32 too (``FP32_OPS``, ``FP32_REGIONS``), and no value passes through float16
  between two float32 nodes (the converter's Cast pairs are removed; a present state's op writes the
  graph output itself, so a KV buffer stays one buffer that ``set_kv_dtype`` can retype). The fused norms of
  ``edgeattn.export.optimize`` run in float16 with ``stash_type`` float32: their mean square is float32. Trained gates are far from their
  initial values: in float16, differences of their cumulative sums lose about 1e-2 and a trained GLA's
  logits were off by 40%.
- int8: by default on the onnxruntime target (``INT8_DEFAULT``, ``--int8-weights blocks``) weight-only 8-bit
  MatMulNBits in symmetric blocks of 32 along K (``quantize_int8``; one graph, like int4); with ``u8`` (the
  portable target's default: it has no MatMulNBits) or ``s8`` ONNX Runtime's dynamic
  quantization of the MatMul projections whose weights are initializers
  (8-bit weights, one scale and zero point per output channel; activations quantized per call to uint8);
  the recurrence itself is untouched. Of those two the weights are unsigned by default: ONNX Runtime's CPU
  kernels multiply uint8 activations by int8 weights with 16-bit saturating sums (``vpmaddubsw``) on CPUs
  without VNNI (AVX2 AMD EPYCs, AVX-512 without VNNI), and the tiny GLA test model's logits went 0.56
  relative off there against 0.20 on a VNNI CPU; uint8 x uint8 widens to 16 bits before it multiplies
  and gives the same logits on both kinds (0.15 relative, per channel; benchmarks/RESULTS.md, issue 38).
- int4: weight-only blockwise quantization with ONNX Runtime's ``MatMulNBitsQuantizer``: every MatMul with
  an initializer weight becomes ``com.microsoft.MatMulNBits`` (the tied lm head included) and the embedding
  ``Gather`` becomes ``com.microsoft.GatherBlockQuantized``; activations, gates and the state stay float32.
  Options (``INT4_DEFAULTS``): ``block_size`` (a power of two >= 16: 32 or 128), ``symmetric`` (no zero
  points), ``accuracy_level`` (4: int8 activations inside MatMulNBits, ONNX Runtime's fast CPU path),
  ``share_embedding`` (a tied embedding stored once: ``share_tied_int4``), ``offsets`` (each block a step and
  a minimum, as llama.cpp's Q4_1: ``offset_blocks``; the export's default for a GGUF file's weights only).
- KV buffers (``set_kv_dtype``): the softmax layers' preallocated GroupQueryAttention buffers in float16
  while q, k and v stay float32 (ONNX Runtime 1.32's GroupQueryAttention types its cache apart, ``T_CACHE``).
  Half the memory per token held; on a 2-core AVX-512 CPU its kernel ran 1.4x slower than over the
  float32 buffer at 16384 tokens (``benchmarks/ort_ops.py``, benchmarks/RESULTS.md), so float32 stays the
  default. Its logit error against the float32 buffer is ``KV_TOLERANCE``.
  int8: ONNX Runtime's quantized cache (``k_quant_type``/``v_quant_type`` ``PER_CHANNEL``,
  ``kv_cache_bit_width`` 8): GroupQueryAttention stores ``clip(rint(x / scale), -128, 127)`` (after rotary)
  and reads ``q * scale`` in prompt and decode alike; its CPU kernel read the buffer 2.7x faster than
  float32 at 16384 tokens. One scale per KV head and channel, calibrated at export from the model's own
  keys and values over ``KV_CALIBRATION_TOKENS`` tokens of the check text (``kv_int8_scales``), stored as
  initializers and in the manifest (the runtimes' get/set_state convert with them).

Every pass here works on an in-memory ``onnx.ModelProto``. The checks (``check_logits``) run a converted
graph as packaged (its weights in the artifact's ``weights.bin``) over a few calls of Python source text
(``check_ids``) and compare its logits with the torch model's over the same ids, which the exporter
computes before it frees the model: no float32 ONNX copy of the weights is held for them.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from contextlib import contextmanager

import numpy as np

from edgeattn.artifact.manifest import INT8_DEFAULT, INT8_WEIGHTS, KV_DTYPES
from edgeattn.export.graph import OFFSET_SUFFIX, sort_topologically


class PrecisionWarning(UserWarning):
    """A reduced-precision graph whose logits differ from float32's by more than ``edgeattn check`` accepts."""


FP32_OPS = [
    "Exp",
    "CumSum",
    "Softplus",
    "Log",
    "LinearAttention",
    "LinearAttentionGate",
    "GatedRMSNorm",
    "GroupQueryAttention",
    "Softmax",
    "ReduceMean",
    "Pow",
    "Sqrt",
    "Div",
]


# Regions kept float32 whole, as (first ops, last ops): every node on a path from one of the first to one
# of the last. Log-space gates: from the gate (Softplus, Log) or its cumulative sum to the Exp that leaves
# log space, so differences of cumulative sums (tens in magnitude, where float16 steps by 0.03) are exact
# enough. Norms: from the square to its root, so a mean square above 65504 does not overflow.
FP32_REGIONS = [({"Softplus", "Log", "CumSum"}, {"Exp"}), ({"Pow"}, {"Sqrt"})]


def _state_nodes(model, entries) -> list[str]:
    names = {e["input"] for e in entries} | {e["output"] for e in entries}
    return [n.name for n in model.graph.node if names & (set(n.input) | set(n.output))]


def _region_nodes(model, first: set[str], last: set[str]) -> list[str]:
    """Names of the nodes on a path from a node of op type in ``first`` to one of op type in ``last``
    that passes no MatMul or Gemm (so a region stays inside one layer: layers meet through projections)."""
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            consumers.setdefault(name, []).append(i)
    wall = {"MatMul", "Gemm"}

    def closure(ops: set[str], stop: set[str], step) -> set[int]:
        start = [i for i, n in enumerate(nodes) if n.op_type in ops]
        seen, todo = set(start), list(start)
        while todo:
            i = todo.pop()
            if nodes[i].op_type in stop and i not in start:
                continue
            for j in step(i):
                if j not in seen and nodes[j].op_type not in wall:
                    seen.add(j)
                    todo.append(j)
        return seen

    after = closure(first, last, lambda i: [j for o in nodes[i].output for j in consumers.get(o, [])])
    before = closure(last, first, lambda i: [producer[x] for x in nodes[i].input if x in producer])
    return [nodes[i].name for i in sorted(after & before)]


def _drop_round_trips(model) -> None:
    """Cast(float32) of a Cast(float16) of a float32 tensor is that tensor: the float16 converter casts the
    output of every float32 node to float16 and back when the next node is float32 too; read it directly."""
    import onnx

    F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    graph = model.graph

    def cast_to(n) -> int | None:
        return next((a.i for a in n.attribute if a.name == "to"), None) if n.op_type == "Cast" else None

    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update({i.name: i.data_type for i in graph.initializer})
    producer = {o: n for n in graph.node for o in n.output}
    for n in graph.node:
        if cast_to(n) == F32:
            for o in n.output:
                types[o] = F32
    rename = {}
    for n in graph.node:
        if cast_to(n) != F32:
            continue
        src = producer.get(n.input[0])
        if src is not None and cast_to(src) == F16:
            origin = src.input[0]
            if types.get(origin) == F32 or cast_to(producer.get(origin)) == F32:
                rename[n.output[0]] = origin
    outputs = {o.name for o in graph.output}
    # a graph output (a present state) that is such a round trip: its float32 origin's node writes it
    # directly, so that the state never passes through float16 and a KV buffer stays one buffer (past and
    # present bound together, GroupQueryAttention writing in place; --kv-dtype retypes it afterwards)
    inputs = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for out, origin in [(k, v) for k, v in rename.items() if k in outputs]:
        if origin in inputs or origin in outputs or origin not in producer:
            continue
        graph.node.remove(producer[out])  # the Cast(float32) that wrote it
        for n in graph.node:
            n.output[:] = [out if x == origin else x for x in n.output]
            n.input[:] = [out if x == origin else x for x in n.input]
        for v in graph.value_info:
            if v.name == origin:
                graph.value_info.remove(v)
                break
        rename = {k: out if v == origin else v for k, v in rename.items()}
    rename = {k: v for k, v in rename.items() if k not in outputs}
    for n in graph.node:
        for i, name in enumerate(n.input):
            while name in rename:
                name = rename[name]
            n.input[i] = name
    # drop the Casts nobody reads any more
    while True:
        used = {x for n in graph.node for x in n.input} | outputs
        dead = [n for n in graph.node if n.op_type == "Cast" and not (set(n.output) & used)]
        if not dead:
            return
        for n in dead:
            graph.node.remove(n)
            for v in [v for v in graph.value_info if v.name in n.output]:
                graph.value_info.remove(v)


def fp32_nodes(model, entries) -> list[str]:
    """The nodes an fp16 graph keeps in float32 besides ``FP32_OPS``: state reads and writes, gate and
    norm regions (``FP32_REGIONS``)."""
    names = set(_state_nodes(model, entries))
    for first, last in FP32_REGIONS:
        names.update(_region_nodes(model, first, last))
    return sorted(names)


# The relative logit error a reduced KV buffer adds against the float32 buffer (the stated bound). float16:
# 3e-5 in an fp32 graph of the tiny Qwen3.5 test model, 2e-3 at int4 (MatMulNBits' int8 activations round
# differently). int8 (KV_INT8_MARGIN): 2-5e-3 on the tiny model; on the random Qwen3.5-0.8B int4 model
# 1.6e-2 in the export's check (256 tokens), 3.5-4.8e-2 over 1024-4104 tokens (benchmarks/RESULTS.md)
KV_TOLERANCE = {"float32": 0.0, "float16": 5e-3, "int8": 6e-2}
# int8 KV: each channel's scale is its largest magnitude over the calibration tokens times this margin,
# over 127 (a later token up to the margin larger is not clipped; each step is the margin coarser)
KV_INT8_MARGIN = 1.5
KV_CALIBRATION_TOKENS = 512
_QUANT_ATTRS = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")
_K_SCALE, _V_SCALE = 12, 13  # GroupQueryAttention's k_scale and v_scale inputs


def kv_int8_scales(keys: np.ndarray, rotary_dim: int = 0, margin: float = KV_INT8_MARGIN) -> np.ndarray:
    """One int8 scale per KV head and channel [Hkv, D] from keys or values ``[B, Hkv, n, D]`` seen over
    calibration tokens: ``margin`` times the channel's largest magnitude, over 127. The first ``rotary_dim``
    channels are rotated by position in pairs (i, i + rotary_dim / 2) (rotate-half): both channels of a pair
    take the pair's largest norm, the most either can reach at any position, since the calibration tokens
    cover few turns of the slow frequencies. A channel that stayed zero gets its head's smallest nonzero
    scale (or 1)."""
    x = np.abs(keys.astype(np.float32)).max(axis=(0, 2))  # [Hkv, D]
    if rotary_dim:
        h = rotary_dim // 2
        pair = np.sqrt(
            keys[..., :h].astype(np.float32) ** 2 + keys[..., h:rotary_dim].astype(np.float32) ** 2
        )
        norm = pair.max(axis=(0, 2))  # [Hkv, R/2]
        x[:, :h] = x[:, h:rotary_dim] = norm
    scale = margin * x / 127.0
    for row in scale:
        nonzero = row[row > 0]
        row[row <= 0] = nonzero.min() if nonzero.size else 1.0
    return scale.astype(np.float32)


def _rotary_dim(model, node) -> int:
    """The rotated dims of a GroupQueryAttention node (0 without do_rotary): twice its cos cache's width."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("do_rotary") or len(node.input) < 8:
        return 0
    for v in [*model.graph.initializer]:
        if v.name == node.input[7]:
            return 2 * int(v.dims[-1])
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == node.input[7]:
            return 2 * int(helper.get_attribute_value(n.attribute[0]).dims[-1])
    for v in [*model.graph.input, *model.graph.value_info]:
        if v.name == node.input[7] and v.type.tensor_type.shape.dim[-1].dim_value:
            return 2 * int(v.type.tensor_type.shape.dim[-1].dim_value)
    raise ValueError(f"the rotary table {node.input[7]!r} of {node.name} has no known width")


def set_kv_dtype(
    model, entries: list[dict], kv_dtype: str, calibration: dict[str, np.ndarray] | None = None
) -> list[dict]:
    """The in-memory graph ``model`` with its shared KV buffers (the ``entries`` marked ``shared``) in
    ``kv_dtype`` (in place; float32 sets them back); returns the entries with their dtype set. Only
    GroupQueryAttention reads and writes them. int8 needs ``calibration``: each buffer's filled slots
    [B, Hkv, n, D] (keys after rotary, values) by state input name over calibration tokens, from which its
    scales [Hkv, D] are taken (``kv_int8_scales``); they become the node's k_scale and v_scale initializers
    ([1, Hkv, 1, D]) and each entry's ``scale``."""
    import onnx
    from onnx import helper, numpy_helper

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    names = {n for e in entries if e.get("shared") for n in (e["input"], e["output"])}
    entries = [
        {**{k: v for k, v in e.items() if k != "scale"}, "dtype": kv_dtype} if e.get("shared") else e
        for e in entries
    ]
    if not names:
        return entries
    others = [n for n in model.graph.node if names & set(n.input) and n.op_type != "GroupQueryAttention"]
    if others and kv_dtype != "float32":
        raise ValueError(
            f"a KV buffer is read by {others[0].op_type}, not GroupQueryAttention: no --kv-dtype"
        )
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(kv_dtype))
    for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if v.name in names:
            v.type.tensor_type.elem_type = elem
    # the quantized cache's attributes and scale inputs: off, then on again for int8
    from edgeattn.export.graph import remove_initializers

    by_input = {e["input"]: e for e in entries}
    dropped = set()
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.input[3] not in names:
            continue
        keep = [a for a in node.attribute if a.name not in _QUANT_ATTRS]
        del node.attribute[:]
        node.attribute.extend(keep)
        dropped |= {x for x in node.input[_K_SCALE:] if x}
        inputs = list(node.input[:_K_SCALE])
        while inputs and not inputs[-1]:
            inputs.pop()
        node.input[:] = inputs
        if kv_dtype != "int8":
            continue
        if calibration is None:
            raise ValueError("an int8 KV buffer needs calibration keys and values for its scales")
        rotary = _rotary_dim(model, node)
        scales = []
        for i, kind in ((3, "k"), (4, "v")):
            scale = kv_int8_scales(calibration[node.input[i]], rotary if kind == "k" else 0)
            # each float32 in its shortest decimal form that reads back the same float32
            by_input[node.input[i]]["scale"] = [[float(str(x)) for x in row] for row in scale]
            init = numpy_helper.from_array(scale[None, :, None, :], f"{node.input[i]}.kv_scale")
            model.graph.initializer.append(init)
            scales.append(init.name)
        node.input.extend([""] * (_K_SCALE - len(node.input)) + scales)
        node.attribute.extend(
            [
                helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                helper.make_attribute("kv_cache_bit_width", 8),
            ]
        )
    used = {x for n in model.graph.node for x in n.input}
    remove_initializers(model.graph, dropped - used)
    return [by_input.get(e["input"], e) for e in entries]


def kv_calibration(state: list, entries: list[dict], tokens: int) -> dict[str, np.ndarray]:
    """The filled slots [B, Hkv, tokens, D] of each shared KV buffer in ``state`` (arrays or tensors in the
    order of ``entries``, after ``tokens`` tokens from zero): what ``set_kv_dtype`` calibrates int8 from."""
    return {
        e["input"]: np.asarray(s[:, :, :tokens], dtype=np.float32).copy()
        for e, s in zip(entries, state)
        if e.get("shared")
    }


def _warn_over(rel: float, bound: float, message: str) -> None:
    """A ``PrecisionWarning`` with ``message`` where the relative error ``rel`` exceeds ``bound`` (or is NaN)."""
    if not rel <= bound:
        warnings.warn(message, PrecisionWarning, stacklevel=3)


def check_logits(
    model,
    entries: list[dict],
    ids: np.ndarray,
    folder: str | os.PathLike,
    reference: list[np.ndarray] | None,
    precision: str,
    kv_dtype: str = "float32",
    name: str = "the graph",
) -> None:
    """The precision checks of the converted graph ``model`` (in memory, its large weights external in
    ``folder``: what the packager left of it), warning (``PrecisionWarning``) where its logits over ``ids``
    (``check_ids``) differ by more than stated: from the float32 ``reference`` (the torch model's logits over
    the same ids) by more than ``edgeattn check`` accepts for ``precision``; with a float16 KV buffer
    (``kv_dtype``), from the same graph over a float32 buffer by more than ``KV_TOLERANCE``. A graph that
    returns the last token's logits only is compared on that token."""
    import onnx

    over32 = model
    if kv_dtype != "float32":
        over32 = onnx.ModelProto()
        over32.CopyFrom(model)
        set_kv_dtype(over32, entries, "float32")
    entries32 = [{**e, "dtype": "float32"} for e in entries]
    logits = graph_logits(over32, entries32, ids, folder)
    del over32
    if reference is not None:
        from edgeattn.export.check import DEFAULT_TOLERANCE

        tokens = logits[0].shape[1]
        rel = relative_error(logits, [r[:, -tokens:] for r in reference])
        _warn_over(
            rel,
            DEFAULT_TOLERANCE[precision],
            f"{name} in {precision}: its logits differ from float32's by {rel:.3g} (relative), more "
            f"than the {DEFAULT_TOLERANCE[precision]:g} that `edgeattn check` accepts; use a higher precision",
        )
    if kv_dtype != "float32":
        rel = relative_error(graph_logits(model, entries, ids, folder), logits)
        message = (
            f"{name} with a {kv_dtype} KV buffer: its logits differ from the float32 buffer's by {rel:.3g} "
            f"(relative), more than the stated {KV_TOLERANCE[kv_dtype]:g}; export with --kv-dtype float32"
        )
        logging.getLogger(__name__).info(
            "%s: %s KV buffer, relative logit error against the float32 buffer %.3g (bound %g)",
            name, kv_dtype, rel, KV_TOLERANCE[kv_dtype],
        )  # fmt: skip
        if kv_dtype == "int8" and not rel <= KV_TOLERANCE[kv_dtype]:
            raise ValueError(message)  # calibrated scales that do not hold: no artifact
        _warn_over(rel, KV_TOLERANCE[kv_dtype], message)


INT4_DEFAULTS = {
    "block_size": 128,
    "symmetric": True,
    "accuracy_level": 4,
    "share_embedding": True,
    # blocks with an offset (offset_blocks): the default only for a GGUF file's weights (export_model), which
    # they keep exactly; elsewhere +25% bytes read per token (fp32 offsets), decode 1.3x slower at SmolLM2
    "offsets": False,
}
INT4_OPSET = 21  # GatherBlockQuantized stores int4 tensors, a type of opset 21 (IR 10)


def _convert_version(model, opset: int):
    """ONNX's version converter on a copy without the large weights' bytes (it serializes its model, which
    protobuf refuses over 2 GB; it rewrites nodes only); ``model`` takes the result, its large weights untouched."""
    from onnx import version_converter

    from edgeattn.export.graph import (
        LARGE_ELEMENTS,
        is_by_reference,
        materialize,
        remove_initializers,
        without_large_weights,
    )

    g = model.graph
    # weights kept by reference below LARGE_ELEMENTS (a lowered threshold) come inline: small ones move
    materialize(
        model, {i.name for i in g.initializer if is_by_reference(i) and np.prod(i.dims) <= LARGE_ELEMENTS}
    )
    light, big = without_large_weights(model)
    out = version_converter.convert_version(light, opset)
    # The converted nodes, small initializers and opsets go into ``model``; its large weights stay where
    # they are (moving them into ``out`` would copy them: protobuf copies the messages it adds).
    remove_initializers(g, {i.name for i in g.initializer if i.name not in big})
    g.initializer.extend(i for i in out.graph.initializer if i.name not in big)
    for field in ("node", "input", "output", "value_info"):
        del getattr(g, field)[:]
        getattr(g, field).extend(getattr(out.graph, field))
    del model.opset_import[:]
    model.opset_import.extend(out.opset_import)
    model.ir_version = out.ir_version
    return model


def _raw(init) -> np.ndarray:
    """An initializer's values without a copy where its bytes are inline (``raw_data``)."""
    from onnx import helper

    from edgeattn.export.graph import initializer_array

    if init.raw_data and not init.external_data:
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        return np.frombuffer(init.raw_data, dtype).reshape(tuple(init.dims))
    return initializer_array(init)


def tied_heads(model) -> list[tuple[str, str]]:
    """(Gather output, MatMul output) of each embedding ``Gather`` (axis 0 of an initializer E [V, D]) whose
    table a MatMul reads transposed (an initializer equal to E^T): the tied head of a traced model."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    by_shape: dict[tuple, list] = {}
    for n in g.node:
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            by_shape.setdefault(tuple(inits[n.input[1]].dims), []).append(n)
    pairs = []
    for n in g.node:
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        if n.op_type != "Gather" or axis != 0 or n.input[0] not in inits or len(inits[n.input[0]].dims) != 2:
            continue
        table = _raw(inits[n.input[0]])  # [V, D]
        for m in by_shape.get(table.shape[::-1], []):
            if np.array_equal(_raw(inits[m.input[1]]), table.T):
                pairs.append((n.output[0], m.output[0]))
                break
    return pairs


def share_tied_int4(model, pairs: list[tuple[str, str]], offsets: dict | None = None) -> int:
    """A tied int4 embedding stored once: each ``GatherBlockQuantized`` of ``pairs`` (by output) reads its
    head's ``MatMulNBits`` table B [V, D/bs, bs/2] (the same blocks along D: the quantizer gives both the
    same values) as 3-D packed uint8 data, quantized along its last axis, with the head's scales reshaped
    to [V, D/bs, 1], and a Reshape makes its [.., D/bs, bs] rows [.., D]. B is not reshaped itself: ONNX
    Runtime folds a Reshape of an initializer into a copy in memory, which for the scales (V x D/bs floats,
    32 MB at Qwen3.5-0.8B) costs less than storing them twice on disk, for the table (4x that) too much.
    Symmetric blocks only (the implied zero point 8 of both ops), and D a multiple of the block size (the
    quantizer pads a shorter last block); returns the tables shared. ``offsets`` (``offset_blocks``'s
    answer): a head with block offsets gives the gathered rows theirs (a Gather of them as [V, D/bs, 1])."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    by_name = {n.name: n for n in g.node}
    offsets = offsets or {}
    shared = 0
    for gather_out, head_out in pairs:
        gbq, head = producer.get(gather_out), producer.get(head_out)
        if head_out in offsets:
            head = by_name.get(offsets[head_out][0])
        if (
            gbq is None
            or head is None
            or gbq.op_type != "GatherBlockQuantized"
            or head.op_type != "MatMulNBits"
        ):
            continue
        if len(head.input) > 3 and head.input[3] or len(gbq.input) > 3 and gbq.input[3]:
            continue  # zero points: the two ops pack them differently
        attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
        if attrs["K"] % attrs["block_size"]:
            continue  # a padded last block: the gathered rows would be wider than D
        table, scales = inits[head.input[1]], inits[head.input[2]]  # [V, D/bs, bs/2] uint8, [V, D/bs]
        V, blocks = attrs["N"], attrs["K"] // attrs["block_size"]
        old = list(gbq.input[:1]) + list(gbq.input[2:])
        rows = f"{gather_out}_blocks"  # [.., D/bs, bs]
        shape = numpy_helper.from_array(np.array([0, 0, -1], np.int64), f"{gather_out}_shape")
        scales3 = numpy_helper.from_array(np.array([V, blocks, 1], np.int64), f"{scales.name}_rows_shape")
        g.initializer.extend([scales3, shape])
        gbq.input[:] = [table.name, gbq.input[1], f"{scales.name}_rows"]
        del gbq.attribute[:]
        gbq.attribute.extend(
            helper.make_attribute(k, v)
            for k, v in dict(bits=4, block_size=attrs["block_size"], gather_axis=0, quantize_axis=2).items()
        )
        gbq.output[0] = rows
        i = list(g.node).index(gbq)
        g.node.insert(
            i + 1, helper.make_node("Reshape", [rows, shape.name], [gather_out], name=f"{gbq.name}_rows")
        )
        if head_out in offsets:  # rows + their blocks' offsets, gathered from [V, D/bs, 1]
            from edgeattn.export.graph import initializer_array

            table_off = initializer_array(inits[offsets[head_out][1]])  # [D/bs, V]
            off_rows = f"{offsets[head_out][1]}_rows"
            g.initializer.append(
                numpy_helper.from_array(np.ascontiguousarray(table_off.T[..., None]), off_rows)
            )
            coded = f"{rows}_codes"
            gbq.output[0] = coded
            g.node.insert(
                i + 1,
                helper.make_node(
                    "Gather",
                    [off_rows, gbq.input[1]],
                    [f"{off_rows}_read"],
                    name=f"{gbq.name}_rows{OFFSET_SUFFIX}",
                ),
            )
            g.node.insert(
                i + 2,
                helper.make_node(
                    "Add", [coded, f"{off_rows}_read"], [rows], name=f"{gbq.name}_add{OFFSET_SUFFIX}"
                ),
            )
        reshape = helper.make_node(
            "Reshape", [scales.name, scales3.name], [gbq.input[2]], name=f"{gbq.name}_scales"
        )
        g.node.insert(i, reshape)
        from edgeattn.export.graph import remove_initializers

        used = {x for n in g.node for x in n.input}
        remove_initializers(g, {x for x in old if x and x not in used})
        shared += 1
    return shared


@contextmanager
def _weights_read_by_copy():
    """ONNX Runtime's int4 quantizer finds each weight with its module's ``get_initializer``; inside, a
    by-reference weight (``graph.load_by_reference``) is handed to it as a standalone copy with its values,
    read from its scratch file when the quantizer asks and dropped once quantized: one float32 weight in
    memory at a time, where the whole graph's were before. The quantizer adds its int4 tensors to the graph
    and removes the unread float32 ones as it always does."""
    from onnx import numpy_helper
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    from edgeattn.export.graph import initializer_array, is_by_reference

    find = mnq.get_initializer

    def by_copy(name, graph_path):
        tensor, graph = find(name, graph_path)
        if tensor is not None and is_by_reference(tensor):
            tensor = numpy_helper.from_array(initializer_array(tensor), tensor.name)
        return tensor, graph

    mnq.get_initializer = by_copy
    try:
        yield
    finally:
        mnq.get_initializer = find


def offset_blocks(model, block_size: int, accuracy_level: int) -> dict[str, tuple[str, str]]:
    """Every MatMul whose weight B [K, N] is an initializer as MatMulNBits plus block offsets: each block of
    ``block_size`` weights along K (of one output column) spans [lo, hi] in 16 steps of d = (hi - lo) / 15,
    the codes q = rint((w - lo) / d) in 0..15 (llama.cpp's Q4_1 and Q4_K blocks: a scale and a minimum
    per block). MatMulNBits holds d (q - 8) (symmetric, its implied zero point 8: its fast int8 path, which
    a float zero point leaves for a dequantize per call 60x slower at one token); the rest of each weight,
    the block's offset o = lo + 8 d, is added by x @ blocks [K, K/bs] (0/1: which block row k is in) @
    offsets [K/bs, N], two matmuls of K/bs (18 at K 576, block 32) columns. Where the weights already lie
    on such a grid (a GGUF's Q4_0/Q4_1 at block 32) this is exact; ONNX Runtime's symmetric blocks (scale
    max|w| / 8, no offset) re-round them onto another grid, and cost SmolLM2-135M's Q4_1 weights 30% of
    perplexity (benchmarks/RESULTS.md, issue 32). Returns, per replaced MatMul's output, its MatMulNBits
    node's name and its offsets' initializer (``share_tied_int4`` gives a tied embedding the same)."""
    from onnx import helper, numpy_helper

    from edgeattn.export.graph import initializer_array, remove_initializers

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    users: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            users[x] = users.get(x, 0) + 1
    done, drop, indicators = {}, set(), {}
    nodes = list(g.node)
    del g.node[:]
    for n in nodes:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if w is None or len(w.dims) != 2:
            g.node.append(n)
            continue
        B = initializer_array(w).astype(np.float32)  # [K, N]
        K, N = B.shape
        nb = -(-K // block_size)
        pad = nb * block_size - K
        blocks = np.pad(B.T, ((0, 0), (0, pad)), constant_values=np.nan).reshape(N, nb, block_size)
        lo, hi = np.nanmin(blocks, -1), np.nanmax(blocks, -1)  # [N, nb]
        d = (hi - lo) / 15
        safe = np.where(d > 0, d, 1)
        q = np.clip(np.rint((blocks - lo[..., None]) / safe[..., None]), 0, 15)
        q = np.where(np.isnan(q), 8, q).astype(np.uint8)  # the padding: code 8 is 0
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # [N, nb, bs/2], the even k in the low nibble
        offsets = (lo + 8 * d).T.astype(np.float32)  # [nb, N]
        name = n.name or n.output[0]
        if (K, block_size) not in indicators:
            ind = np.zeros((K, nb), np.float32)
            ind[np.arange(K), np.arange(K) // block_size] = 1
            indicators[K, block_size] = f"blocks_{K}_{block_size}{OFFSET_SUFFIX}"
            g.initializer.append(numpy_helper.from_array(ind, indicators[K, block_size]))
        g.initializer.extend(
            [
                numpy_helper.from_array(packed, f"{w.name}_Q4"),
                numpy_helper.from_array(d.astype(np.float32), f"{w.name}_scales"),
                numpy_helper.from_array(offsets, f"{w.name}{OFFSET_SUFFIX}"),
            ]
        )
        x, y = n.input[0], n.output[0]
        sums = f"{name}_block_sums{OFFSET_SUFFIX}"  # [.., nb]
        g.node.extend(
            [
                helper.make_node(
                    "MatMulNBits",
                    [x, f"{w.name}_Q4", f"{w.name}_scales"],
                    [f"{y}_codes"],
                    name=f"{name}_Q4",
                    domain="com.microsoft",
                    K=K,
                    N=N,
                    bits=4,
                    block_size=block_size,
                    accuracy_level=accuracy_level,
                ),
                helper.make_node("MatMul", [x, indicators[K, block_size]], [sums], name=sums),
                helper.make_node(
                    "MatMul",
                    [sums, f"{w.name}{OFFSET_SUFFIX}"],
                    [f"{y}{OFFSET_SUFFIX}"],
                    name=f"{y}{OFFSET_SUFFIX}",
                ),
                helper.make_node(
                    "Add", [f"{y}_codes", f"{y}{OFFSET_SUFFIX}"], [y], name=f"{name}_add{OFFSET_SUFFIX}"
                ),
            ]
        )
        done[y] = (f"{name}_Q4", f"{w.name}{OFFSET_SUFFIX}")
        users[w.name] -= 1
        if not users[w.name]:
            drop.add(w.name)
    remove_initializers(g, drop)
    if done and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return done


def quantize_nbits(
    model,
    block_size: int = 128,
    symmetric: bool = True,
    accuracy_level: int = 4,
    share_embedding: bool = True,
    offsets: bool = False,
    bits: int = 4,
):
    """The model with MatMul weights as MatMulNBits of ``bits`` bits. 4 (int4): the embedding as
    GatherBlockQuantized too; ``share_embedding``: a tied embedding reads the head's table
    (``share_tied_int4``); ``offsets``: the MatMuls' blocks with an offset each (``offset_blocks``; symmetric
    only). 8 (int8's ``blocks`` weights): the MatMuls only, the embedding stays float32 (as int8's dynamic
    quantization leaves it)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from edgeattn.export.graph import ORT_DEFAULT_DOMAIN_OPS

    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (32 or 128), got {block_size}")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ValueError(f"accuracy_level must be 0..4 (MatMulNBits' attribute), got {accuracy_level}")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs every node on the root logger
    try:
        # the quantizer would only relabel the opset; the converter rewrites the ops that changed
        # ONNX Runtime's default-domain SimplifiedLayerNormalization has no ONNX schema: the converter would
        # refuse it, so it crosses the conversion in com.microsoft (left alone) and comes back
        hidden = [n for n in model.graph.node if n.domain == "" and n.op_type in ORT_DEFAULT_DOMAIN_OPS]
        for n in hidden:
            n.domain = "com.microsoft"
        model = _convert_version(model, INT4_OPSET)
        for n in model.graph.node:
            if n.domain == "com.microsoft" and n.op_type in ORT_DEFAULT_DOMAIN_OPS:
                n.domain = ""
        four = bits == 4
        pairs = tied_heads(model) if share_embedding and symmetric and four else []
        by_offset = offset_blocks(model, block_size, accuracy_level) if offsets and symmetric and four else {}
        q = MatMulNBitsQuantizer(
            model,
            bits=bits,
            block_size=block_size,
            is_symmetric=symmetric,
            accuracy_level=accuracy_level,
            op_types_to_quantize=("MatMul", "Gather") if four else ("MatMul",),
            nodes_to_exclude=[n.name for n in model.graph.node if n.name.endswith(OFFSET_SUFFIX)],
            quant_axes=(("MatMul", 0), ("Gather", 1)),
        )
        with _weights_read_by_copy():
            q.process()
    finally:
        root.setLevel(level)
    share_tied_int4(q.model.model, pairs, by_offset)
    return q.model.model


def convert_precision(model, precision: str, entries: list[dict], **options):
    """The in-memory float32 graph ``model`` in ``precision``; ``options`` are int4's. ``check_logits``
    measures the result (the exporter runs it on the packaged graph, once the weights left memory)."""
    for i, n in enumerate(model.graph.node):  # the converter's node_block_list needs names
        if not n.name:
            n.name = f"{n.op_type}_{i}"
    if precision != "int4":  # their converters read every weight through onnx: in the message
        from edgeattn.export.graph import materialize

        materialize(model)
    if precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        block = fp32_nodes(model, entries)
        model = convert_float_to_float16(
            model, keep_io_types=True, op_block_list=FP32_OPS, node_block_list=block
        )
        _drop_round_trips(model)
        sort_topologically(model)
    elif precision == "int8":
        model = quantize_int8(model, **options)
    elif precision == "int4":
        model = quantize_nbits(model, **{**INT4_DEFAULTS, **options})
    else:
        raise ValueError(f"unknown precision {precision!r}")
    return model


# int8 weights (``--int8-weights``, one of INT8_WEIGHTS): "blocks", the default, is weight-only (``quantize_int8``);
# of the dynamic quantizations "u8" gives the same logits on every x86-64 CPU kind (the module docstring);
# "s8" is ONNX Runtime's own default, faster on CPUs with VNNI or AMX
# (benchmarks/RESULTS.md, issue 38) and saturating on the CPU kinds (``edgeattn.bench.machine.cpu_kind``)
# where MLAS multiplies uint8 by int8 with vpmaddubsw:
S8_SATURATES = ("avx2", "avx512")
INT8_BLOCK = 32  # int8 "blocks" weights: one float32 scale per 32 weights along K (llama.cpp's Q8_0 blocks)


def quantize_int8(model, weights: str = INT8_DEFAULT):
    """``weights`` "blocks" (``INT8_DEFAULT``): weight-only, MatMulNBits with 8 bits in symmetric blocks of
    ``INT8_BLOCK`` along K (``quantize_nbits`` with 8 bits), the activations float32 outside it (one graph,
    any batch: nothing is quantized per call across rows). On SmolLM2-135M it kept perplexity within 0.9% of
    fp32's where the dynamic quantization's per-tensor activations lost 25% (benchmarks/RESULTS.md, issue 32).
    "u8" (uint8) or "s8" (int8): ONNX Runtime's dynamic quantization of the MatMul and Gemm projections whose
    weights are initializers, one scale and zero point per output channel (the portable target's default:
    it has no MatMulNBits); its quantizer reads and writes files: through a scratch directory."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if weights not in INT8_WEIGHTS:
        raise ValueError(f"int8 weights must be one of {', '.join(INT8_WEIGHTS)}, got {weights!r}")
    if weights == "blocks":
        return quantize_nbits(model, block_size=INT8_BLOCK, share_embedding=False, bits=8)

    inits = {i.name for i in model.graph.initializer}
    matmuls = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & inits]
    with tempfile.TemporaryDirectory(prefix="edgeattn-int8-") as scratch:
        src, dst = os.path.join(scratch, "src.onnx"), os.path.join(scratch, "int8.onnx")
        onnx.save(model, src)
        del model
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # the quantizer logs advice on the root logger
        try:
            quantize_dynamic(
                src,
                dst,
                nodes_to_quantize=matmuls,
                weight_type=QuantType.QUInt8 if weights == "u8" else QuantType.QInt8,
                per_channel=True,
            )
        finally:
            root.setLevel(level)
        return onnx.load(dst)


# The precision checks: a few consecutive calls of Python source text, the state fed back (errors that
# build up in the state show); a graph with a dynamic token axis runs them as prefills of CHECK_TOKENS
CHECK_CALLS = 4
CHECK_TOKENS = 16


def check_ids(batch: int, tokens: int, vocab: int, calls: int = CHECK_CALLS) -> np.ndarray:
    """The token ids [calls, batch, tokens] that the precision checks feed a graph and its reference."""
    from edgeattn.export.check import default_text

    text = np.frombuffer(default_text(batch * tokens * calls), np.uint8).astype(np.int64) % vocab
    return text.reshape(calls, batch, tokens)


def graph_logits(model, entries: list[dict], ids: np.ndarray, folder: str | os.PathLike) -> list[np.ndarray]:
    """The float32 logits of the in-memory graph ``model`` (its external data in ``folder``) over the
    consecutive calls ``ids`` [calls, B, T], its state starting at zero and fed back."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    # no prepacked copies of the weights: a few calls do not repay them
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {e["input"] for e in entries}
    ids_name = next(i.name for i in sess.get_inputs() if i.name not in names)
    np_types = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}
    types = {i.name: np_types.get(i.type, np.float32) for i in sess.get_inputs()}
    state = {  # a state input's element type is the graph's own (a float16 or int8 KV buffer)
        e["input"]: np.zeros([0 if isinstance(d, str) else d for d in e["shape"]], types[e["input"]])
        for e in entries
    }
    logits = []
    for call in ids:
        out = sess.run(None, {ids_name: call, **state})
        state.update({e["input"]: o for e, o in zip(entries, out[1:])})
        logits.append(out[0].astype(np.float32, copy=False))
    return logits


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """Relative logit error (max |diff| / max |logit| of ``want``, as ``edgeattn check``) over the calls."""
    diff = max(float(np.abs(b.astype(np.float64) - a).max()) for a, b in zip(want, got))
    scale = max(float(np.abs(a).max()) for a in want)
    return diff / max(scale, 1e-12)
