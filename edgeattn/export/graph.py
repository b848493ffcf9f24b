"""Small helpers on ONNX graphs (``onnx.ModelProto``, in memory) that the export passes share: the
optimizer (``optimize``), the precision conversion (``precision``) and the exporter, and
``release_memory`` between their large steps. Imports nothing of edgeattn, so the passes import it and not
each other."""

from __future__ import annotations

import gc
import sys

import numpy as np

MS = "com.microsoft"
# ONNX Runtime runs these contrib ops in the default ONNX domain too; some of its tools expect them there
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})

LARGE_ELEMENTS = 2**18  # initializers above this many elements are left out of ``without_large_weights``


def remove_initializers(graph, names: set) -> None:
    """Delete the initializers named in ``names`` from ``graph`` in place. (``del initializer[:]`` and
    ``extend(kept)`` would copy every kept weight, as protobuf copies messages it adds: at 0.8B parameters
    each such pass held another 3.8 GB.)"""
    if not names:
        return
    for i in range(len(graph.initializer) - 1, -1, -1):
        if graph.initializer[i].name in names:
            del graph.initializer[i]


def without_large_weights(model):
    """A copy of ``model`` whose large initializers keep their name, type and shape but no bytes, and the
    names of those initializers: for ONNX's tools that serialize their model (shape inference, the version
    converter), which protobuf refuses over 2 GB."""
    import onnx

    g = model.graph
    big = {i.name for i in g.initializer if int(np.prod(i.dims, dtype=np.int64)) > LARGE_ELEMENTS}
    light = onnx.ModelProto(
        ir_version=model.ir_version,
        opset_import=model.opset_import,
        graph=onnx.GraphProto(
            name=g.name,
            node=g.node,
            input=g.input,
            output=g.output,
            value_info=g.value_info,
            initializer=[
                onnx.TensorProto(name=i.name, data_type=i.data_type, dims=i.dims) if i.name in big else i
                for i in g.initializer
            ],
        ),
    )
    return light, big


def sort_topologically(model) -> None:
    """The float16 converter appends its Casts at the end of the node list; ONNX (and TensorRT's parser) want
    every node after the nodes whose outputs it reads."""
    graph = model.graph
    nodes = list(graph.node)
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    waiting = {i: {x for x in n.input if x not in available and x in producer} for i, n in enumerate(nodes)}
    readers: dict[
        int, dict[int, None]
    ] = {}  # ordered sets: a node reading two outputs of one node waits once
    for i, deps in waiting.items():
        for x in deps:
            readers.setdefault(producer[x], {})[i] = None
    ready = [i for i, deps in waiting.items() if not deps]
    order = []
    while ready:
        i = ready.pop(0)
        order.append(i)
        for j in readers.get(i, []):
            waiting[j] = {x for x in waiting[j] if producer[x] != i}
            if not waiting[j]:
                ready.append(j)
    if len(order) != len(nodes):
        raise ValueError("the converted graph has a cycle; this is a bug in edgeattn's precision conversion")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def fix_optional_inputs(model) -> bool:
    """Write the empty optional inputs the TorchScript exporter cannot (``edgeattn.ops.common.fused_delta``):
    a 5-input "delta" LinearAttention gets ``""`` as its decay. Returns whether anything changed."""
    changed = False
    for node in model.graph.node:
        if node.domain != MS or node.op_type != "LinearAttention":
            continue
        rule = next((a.s.decode() for a in node.attribute if a.name == "update_rule"), "gated_delta")
        if rule == "delta" and len(node.input) == 5:
            beta = node.input[4]
            node.input[4] = ""
            node.input.append(beta)
            changed = True
    return changed


def release_memory() -> None:
    """Collect garbage and hand the freed heap back to the system (glibc keeps freed blocks for reuse, and
    counts them in the process's resident memory until ``malloc_trim``)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
