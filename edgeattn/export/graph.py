"""Small helpers on ONNX graphs (``onnx.ModelProto``, in memory) that the export passes share: the
optimizer (``optimize``), the precision conversion (``precision``) and the exporter, and
``release_memory`` between their large steps. Imports nothing of edgeattn, so the passes import it and not
each other."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np

MS = "com.microsoft"
# ONNX Runtime runs these contrib ops in the default ONNX domain too; some of its tools expect them there
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})

LARGE_ELEMENTS = 2**18  # initializers above this many elements are left out of ``without_large_weights``
BY_REFERENCE_ELEMENTS = LARGE_ELEMENTS  # a large model's initializers above this are kept by reference


def initializer_nbytes(init) -> int:
    """The bytes of an initializer's values, wherever they are."""
    from onnx import helper

    n = int(np.prod(init.dims, dtype=np.int64))
    if init.data_type in (21, 22):  # uint4, int4: two to a byte
        return (n + 1) // 2
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize


# the names of the nodes and initializers that int4's block offsets add (precision.offset_blocks) end in it;
# optimize.last_token_logits finds an int4 head with offsets by it
OFFSET_SUFFIX = "_offsets"


def is_by_reference(init) -> bool:
    """Whether ``init``'s values are in a scratch file at an absolute path (``reference_large``), not in
    the message."""
    import onnx

    return init.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value.startswith("/") for e in init.external_data
    )


def initializer_array(init) -> np.ndarray:
    """An initializer's values: its inline bytes, or those of its scratch file (``reference_large``), read
    without loading them into the message (``onnx.numpy_helper.to_array`` would)."""
    from onnx import helper, numpy_helper

    if not is_by_reference(init):
        return numpy_helper.to_array(init)
    info = {e.key: e.value for e in init.external_data}
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
    count = int(np.prod(init.dims, dtype=np.int64))
    with open(info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        values = np.fromfile(f, dtype, count)
    if values.size != count:
        raise ValueError(f"the scratch file of {init.name} is short; this is a bug in edgeattn's export")
    return values.reshape(tuple(init.dims))


def _point_at(init, path: str, offset: int, length: int) -> None:
    import onnx

    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        init.ClearField(field)
    init.data_location = onnx.TensorProto.EXTERNAL
    del init.external_data[:]
    for k, v in (("location", path), ("offset", offset), ("length", length)):
        init.external_data.add(key=k, value=str(v))


def load_by_reference(path) -> object:
    """The graph file ``path`` with its large initializers (over ``BY_REFERENCE_ELEMENTS`` elements) left in their
    external-data files beside it, by reference (absolute paths: ``initializer_array`` reads them), and the
    small ones loaded: a graph of several GB held in memory at a few MB. The files must outlive the graph's
    passes; ``materialize`` brings the values in, the packager writes them out."""
    import onnx
    from onnx.external_data_helper import (
        _get_attribute_tensors,
        load_external_data_for_tensor,
        uses_external_data,
    )

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in _get_attribute_tensors(model):  # Constant nodes' tensors (torch spills them too): loaded
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(path.parent))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    for init in model.graph.initializer:
        if not uses_external_data(init):
            continue
        if int(np.prod(init.dims, dtype=np.int64)) > BY_REFERENCE_ELEMENTS:
            info = {e.key: e.value for e in init.external_data}
            _point_at(
                init,
                str((path.parent / info["location"]).resolve()),
                int(info.get("offset", 0)),
                int(info.get("length", initializer_nbytes(init))),
            )
        else:
            load_external_data_for_tensor(init, str(path.parent))
            init.data_location = onnx.TensorProto.DEFAULT
            del init.external_data[:]
    return model


def reference_large(model, path) -> object:
    """``model`` with its large inline initializers (over ``BY_REFERENCE_ELEMENTS`` elements) written to the new
    file ``path`` and referenced there (``load_by_reference``), as a new message: protobuf frees a message's
    memory only with the whole message, so the caller drops ``model`` and keeps the result."""
    import onnx

    with open(path, "wb") as f:
        for init in model.graph.initializer:
            if is_by_reference(init) or int(np.prod(init.dims, dtype=np.int64)) <= BY_REFERENCE_ELEMENTS:
                continue
            data = initializer_array(init).tobytes()
            _point_at(init, str(Path(path).resolve()), f.tell(), len(data))
            f.write(data)
    out = onnx.ModelProto()
    out.ParseFromString(model.SerializeToString())
    return out


def materialize(model, names: set | None = None) -> None:
    """Bring the by-reference initializers (``names``: those only, default all) into the message, in place."""
    import onnx

    for init in model.graph.initializer:
        if is_by_reference(init) and (names is None or init.name in names):
            data = initializer_array(init).tobytes()
            del init.external_data[:]
            init.data_location = onnx.TensorProto.DEFAULT
            init.raw_data = data


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
    big = {
        i.name
        for i in g.initializer
        if int(np.prod(i.dims, dtype=np.int64)) > LARGE_ELEMENTS or is_by_reference(i)
    }
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
    """Write the empty optional inputs the TorchScript exporter cannot (``edgeattn.export.contrib``):
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
