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

    from edgeattn.export.graph import initializer_array, is_by_reference

    if init.HasField("raw_data"):
        return init.raw_data
    if is_by_reference(init):  # a large weight still in the export's scratch file
        return initializer_array(init).tobytes()
    return numpy_helper.to_array(init).tobytes()


class WeightsWriter:
    """Moves the large initializers of in-memory graphs (``add``, one graph after another) into one
    external-data file at ``path``, each content once, and hashes the file as it writes it (``sha256``,
    ``bytes`` after ``close``). Every name means one content across the graphs: a name that another graph
    used for other contents is renamed (its nodes follow)."""

    def __init__(self, path: str | os.PathLike, data_name: str = WEIGHTS_FILE):
        self.data_name = data_name
        self.tensors: dict[str, dict] = {}  # content key -> entry
        self.by_name: dict[str, str] = {}  # initializer name -> content key
        self.offset = 0
        self.hash = hashlib.sha256()
        self.file = open(path, "wb")

    def _write(self, data: bytes) -> None:
        self.file.write(data)
        self.hash.update(data)
        self.offset += len(data)

    def add(self, model) -> None:
        """Point ``model``'s large initializers at the file (changed in place; their bytes leave memory)."""
        import onnx

        renames = {}
        for init in model.graph.initializer:
            # Every name, small tensors' too, means one content across the graphs: the runtime hands
            # the shared tensors to every session by name, which would shadow another graph's small one.
            raw = _raw(init) if init.data_type in ONNX_DTYPES else init.SerializeToString()
            digest = hashlib.sha256(raw).hexdigest()
            key = f"{init.data_type}:{list(init.dims)}:{digest}"
            if init.name in self.by_name and self.by_name[init.name] != key:
                new = f"{init.name}.{digest[:12]}"
                renames[init.name] = new
                init.name = new
            self.by_name[init.name] = key
            if init.data_type not in ONNX_DTYPES or len(raw) < MIN_BYTES:
                continue
            if key not in self.tensors:
                self._write(b"\0" * (-self.offset % ALIGN))
                self.tensors[key] = {
                    "names": [],
                    "dtype": ONNX_DTYPES[init.data_type],
                    "shape": list(init.dims),
                    "offset": self.offset,
                    "length": len(raw),
                    "sha256": digest,
                }
                self._write(raw)
            entry = self.tensors[key]
            if init.name not in entry["names"]:
                entry["names"].append(init.name)
            del raw
            init.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                init.ClearField(field)
            init.data_location = onnx.TensorProto.EXTERNAL
            del init.external_data[:]
            for k, v in (
                ("location", self.data_name),
                ("offset", entry["offset"]),
                ("length", entry["length"]),
            ):
                init.external_data.add(key=k, value=str(v))
        if renames:
            for node in model.graph.node:
                node.input[:] = [renames.get(i, i) for i in node.input]
        self.file.flush()  # readable as the graph's external data from here on

    def close(self) -> dict:
        """The table the manifest keeps under ``"weights"``: ``{"path", "bytes", "tensors": [{"names",
        "dtype", "shape", "offset", "length", "sha256"}]}``."""
        self.file.close()
        return {"path": self.data_name, "bytes": self.offset, "tensors": list(self.tensors.values())}

    @property
    def sha256(self) -> str:
        return self.hash.hexdigest()


def share_weights(root: str | os.PathLike, graphs: list[str], data_name: str = WEIGHTS_FILE) -> dict:
    """Move the large initializers of the graph files ``graphs`` under ``root`` into ``root / data_name``,
    once each (``WeightsWriter``; the exporter does this in memory), rewriting the graphs. Returns the
    table of ``WeightsWriter.close``."""
    import onnx

    root = Path(root)
    tmp = root / f".{data_name}.tmp"
    spilled = set()  # external-data files the graphs came with, removed once moved
    writer = WeightsWriter(tmp, data_name)
    try:
        for g in graphs:  # one graph in memory at a time
            model = onnx.load(str(root / g), load_external_data=False)
            spilled |= {
                e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"
            }
            onnx.load_external_data_for_model(model, str(root))
            writer.add(model)
            with open(root / f".{g}.tmp", "wb") as part:
                part.write(model.SerializeToString())
            del model
        table = writer.close()
        for g in graphs:
            os.replace(root / f".{g}.tmp", root / g)
        os.replace(tmp, root / data_name)
        for name in spilled - {data_name}:
            (root / name).unlink(missing_ok=True)
    finally:
        writer.file.close()
        for leftover in [tmp, *(root / f".{g}.tmp" for g in graphs)]:
            if leftover.exists():
                leftover.unlink()
    return table
