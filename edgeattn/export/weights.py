"""One copy of the weights on disk: the graphs' initializers moved into one external-data file.

``share_weights(root, ["step.onnx", "prefill.onnx"])`` writes every initializer of at least
``MIN_BYTES`` bytes once into ``weights.bin`` (identical contents stored once, whatever their names),
each at an offset aligned to ``ALIGN`` bytes, and points both graphs at it with ONNX's standard
external-data fields (``location``, ``offset``, ``length``): any ONNX Runtime loads them as they are.
It returns the table that the manifest keeps under ``"weights"``, so a runtime can build each tensor
once from the file and hand the same buffer to every session (``OnnxRuntimeSession``) without parsing
the graphs (the base install has no ``onnx``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHTS_FILE = "weights.bin"
MIN_BYTES = 1024  # smaller initializers (shapes, scalars) stay inside the graphs, where folding wants them
ALIGN = 4096  # page-aligned offsets: ONNX Runtime can map them, numpy views them without a copy

# ONNX TensorProto data types -> numpy dtype names, for the ones an exported graph stores as weights
# (uint4 and int4, two to a byte, have no numpy dtype: a runtime maps only the others, see PACKED_4BIT)
ONNX_DTYPES = {
    **{1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 10: "float16", 11: "float64"},
    **{21: "uint4", 22: "int4"},  # GatherBlockQuantized's data in int4 artifacts
}
PACKED_4BIT = frozenset({"uint4", "int4"})  # length: ceil(elements / 2) bytes


def _raw(init) -> bytes:
    from onnx import numpy_helper

    if init.HasField("raw_data"):
        return init.raw_data
    return numpy_helper.to_array(init).tobytes()


def share_weights(root: str | os.PathLike, graphs: list[str], data_name: str = WEIGHTS_FILE) -> dict:
    """Move the large initializers of the graphs under ``root`` into ``root / data_name``, once each.

    Two initializers with the same bytes, dtype and shape are stored once; one name that means different
    contents in two graphs is renamed in the later graph (its nodes follow), so every name maps to one
    tensor. Returns ``{"path": data_name, "bytes": n, "tensors": [{"names", "dtype", "shape", "offset",
    "length", "sha256"}]}``.
    """
    import onnx

    root = Path(root)
    tensors: dict[str, dict] = {}  # content key -> entry
    by_name: dict[str, str] = {}  # initializer name -> content key
    tmp = root / f".{data_name}.tmp"
    offset = 0
    spilled = set()  # external-data files the graphs came with (over 2 GB), removed once moved
    spilled |= {
        f"{g}.data" for g in graphs
    }  # the exporter's files over 2 GB (orphaned by a precision change)
    with open(tmp, "wb") as f:
        for g in graphs:  # one graph in memory at a time
            head = onnx.load(str(root / g), load_external_data=False)
            spilled |= {
                e.value for i in head.graph.initializer for e in i.external_data if e.key == "location"
            }
            del head
            model = onnx.load(str(root / g))
            renames = {}
            for init in model.graph.initializer:
                # Every name, small tensors' too, means one content across the graphs: the runtime hands
                # the shared tensors to every session by name, which would shadow another graph's small one.
                raw = _raw(init) if init.data_type in ONNX_DTYPES else init.SerializeToString()
                digest = hashlib.sha256(raw).hexdigest()
                key = f"{init.data_type}:{list(init.dims)}:{digest}"
                if init.name in by_name and by_name[init.name] != key:
                    new = f"{init.name}.{digest[:12]}"
                    renames[init.name] = new
                    init.name = new
                by_name[init.name] = key
                if init.data_type not in ONNX_DTYPES or len(raw) < MIN_BYTES:
                    continue
                if key not in tensors:
                    pad = -offset % ALIGN
                    f.write(b"\0" * pad)
                    offset += pad
                    f.write(raw)
                    tensors[key] = {
                        "names": [],
                        "dtype": ONNX_DTYPES[init.data_type],
                        "shape": list(init.dims),
                        "offset": offset,
                        "length": len(raw),
                        "sha256": digest,
                    }
                    offset += len(raw)
                entry = tensors[key]
                if init.name not in entry["names"]:
                    entry["names"].append(init.name)
                init.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    init.ClearField(field)
                init.data_location = onnx.TensorProto.EXTERNAL
                del init.external_data[:]
                for k, v in (
                    ("location", data_name),
                    ("offset", entry["offset"]),
                    ("length", entry["length"]),
                ):
                    init.external_data.add(key=k, value=str(v))
            if renames:
                for node in model.graph.node:
                    node.input[:] = [renames.get(i, i) for i in node.input]
            with open(root / f".{g}.tmp", "wb") as part:
                part.write(model.SerializeToString())
            del model
    try:
        for g in graphs:
            os.replace(root / f".{g}.tmp", root / g)
        os.replace(tmp, root / data_name)
        for name in spilled - {data_name}:
            (root / name).unlink(missing_ok=True)
    finally:
        for leftover in [tmp, *(root / f".{g}.tmp" for g in graphs)]:
            if leftover.exists():
                leftover.unlink()
    return {"path": data_name, "bytes": offset, "tensors": list(tensors.values())}
