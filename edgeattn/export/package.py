"""The packager: an artifact's files written into its (temporary) directory exactly once each, every file
hashed as it is written (the manifest's sha256 and size come from here, nothing is read back).

Graphs arrive in memory (``onnx.ModelProto``, after the passes): with shared weights their large
initializers go into ``weights.bin`` (``edgeattn.export.weights.WeightsWriter``) as each graph arrives,
so one graph's weights are in memory at a time; without, a graph over protobuf's 2 GB limit keeps its
weights in its own ``GRAPH.data`` beside it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from edgeattn.artifact.manifest import write_manifest
from edgeattn.export.graph import initializer_nbytes, materialize
from edgeattn.export.weights import WEIGHTS_FILE, WeightsWriter

INLINE_BYTES = 2**31 - 2**26  # a self-contained graph's initializers above this go to GRAPH.data


class Package:
    """Writes the files of an artifact into ``root``; ``hashes`` holds each one's sha256 and size."""

    def __init__(self, root: str | Path, shared_weights: bool = True):
        self.root = Path(root)
        self.hashes: dict[str, dict] = {}
        self.weights = WeightsWriter(self.root / WEIGHTS_FILE) if shared_weights else None

    def write(self, name: str, data: bytes) -> str:
        """Write ``data`` as the file ``name`` (relative to the root); returns ``name``."""
        if name in self.hashes:
            raise ValueError(f"{name} is written twice into the artifact; this is a bug in edgeattn")
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self.hashes[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        return name

    def graph(self, name: str, model) -> tuple[list[str], object]:
        """Write the in-memory graph ``model`` as ``name``; returns the files written (the graph, and its own
        external-data file where it has one) and the graph as written, a new message whose large weights
        are external (drop ``model``: protobuf frees a message's memory only with the whole message)."""
        import onnx

        files = []
        if self.weights is not None:
            self.weights.add(model)
        elif (
            sum(initializer_nbytes(i) for i in model.graph.initializer) > INLINE_BYTES
        ):  # (raw_data would copy)
            own_name = f"{name}.data"
            own = WeightsWriter(self.root / own_name, own_name)
            own.add(model)
            own.close()
            self.hashes[own_name] = {"sha256": own.sha256, "bytes": own.offset}
            files.append(own_name)
        else:
            materialize(model)  # weights the export kept in its scratch files come inline
        data = model.SerializeToString()
        written = onnx.ModelProto()
        written.ParseFromString(data)
        return [self.write(name, data), *files], written

    def close_weights(self) -> dict | None:
        """Finish ``weights.bin``; its table for the manifest (None without shared weights)."""
        if self.weights is None:
            return None
        table = self.weights.close()
        self.hashes[WEIGHTS_FILE] = {"sha256": self.weights.sha256, "bytes": self.weights.offset}
        return table

    def manifest(self, data: dict) -> None:
        """Write the manifest, every listed file's sha256 and size from what this package wrote (or was
        told with ``hashes``)."""
        missing = [name for name in data["files"] if name not in self.hashes]
        if missing:
            raise ValueError(
                f"{missing[0]} is listed in the manifest but was not packaged; a bug in edgeattn"
            )
        write_manifest(self.root, data, self.hashes)
