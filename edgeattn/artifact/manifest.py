"""The artifact manifest ``edgeattn.json`` (docs/artifact-format.md): build, write, read, verify.
numpy-free, torch-free: the exporter builds it with ``build_manifest`` and every runtime reads it with
``Manifest.load``, so the format is written down in this one module."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "edgeattn.json"
FORMAT = "edgeattn"
FORMAT_VERSION = 1
# The manifest's "target": "onnxruntime" (ONNX Runtime's contrib ops) or "portable" (standard ONNX at
# opset 17, what TensorRT parses).
TARGETS = ("onnxruntime", "portable")
# The manifest's "precision" of weights and activations (the state is float32 in every precision).
PRECISIONS = ("fp32", "fp16", "int8", "int4")
# int8 weights: unsigned (the same logits on every CPU) or signed (faster with VNNI/AMX), activations quantized
# per call; or "blocks", weight-only MatMulNBits of 8 bits (export/precision.py)
INT8_WEIGHTS = ("u8", "s8", "blocks")
# the export's default: within 0.9% of fp32's perplexity on SmolLM2-135M, where u8 lost 25%
INT8_DEFAULT = "blocks"
# The element types of a preallocated KV buffer (a "shared" state entry); every other state tensor is float32.
KV_DTYPES = ("float32", "float16", "int8")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class StateEntry:
    input: str
    output: str
    layer: int
    name: str
    shape: tuple  # ints, or a str for a dynamic dimension
    dtype: str
    shared: bool = False  # one buffer bound as both input and output (a preallocated KV cache)
    # an int8 KV buffer's scales [Hkv][D]: slot values are round(x / scale) (ONNX Runtime's quantized cache)
    scale: tuple | None = None
    # the graph output [B, T, *shape[1:]] holding this tensor after each token of a call (export option
    # verify_states: a speculative round keeps the state after its last kept draft instead of re-advancing)
    steps: str | None = None

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)


class Manifest:
    """A parsed, verified manifest. ``Manifest.load(dir)`` refuses what this version cannot run."""

    def __init__(self, root: Path, data: dict):
        self.root = Path(root)
        self.data = data
        self.state = [
            StateEntry(
                s["input"],
                s["output"],
                int(s["layer"]),
                s["name"],
                tuple(s["shape"]),
                s["dtype"],
                bool(s.get("shared", False)),
                tuple(tuple(row) for row in s["scale"]) if "scale" in s else None,
                s.get("steps"),
            )
            for s in data["state"]
        ]

    # fields
    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])

    @property
    def batch_size(self) -> int:
        return int(self.data["batch_size"])

    @property
    def dynamic_batch(self) -> bool:
        """True when the graphs take any batch: dimension 0 of ``input_ids``, ``logits`` and every state
        tensor is the symbolic ``"batch"`` (the state shapes listed are those at ``batch_size``)."""
        return bool(self.data.get("dynamic_batch", False))

    @property
    def target(self) -> str:
        return self.data.get("target", "")

    @property
    def precision(self) -> str:
        return self.data.get("precision", "fp32")

    @property
    def max_length(self) -> int | None:
        return self.data.get("max_length")

    @property
    def prefill_tokens(self) -> int:
        return int(self.data["graphs"]["prefill"]["tokens"])

    @property
    def weights(self) -> dict | None:
        """The shared weights file's table (``path``, ``bytes``, ``tensors``), or None when each graph holds its own."""
        return self.data.get("weights")

    @property
    def checkpoint(self) -> Path | None:
        ckpt = self.data.get("checkpoint")
        return self.root / ckpt if ckpt else None

    def graph_path(self, name: str) -> Path:
        return self.root / self.data["graphs"][name]["path"]

    @property
    def prefill_logits(self) -> str:
        """ "all": a graph call returns the logits of every token; "last": of its last token only."""
        return self.data.get("prefill_logits", "all")

    @property
    def logits_count(self) -> str | None:
        """The name of a "last" graph's optional int64 [1] input n: a call returns the logits of its last n
        tokens (1 when not fed); None where the graph has none (then a "last" call returns one row)."""
        return self.data.get("logits_count")

    @property
    def input_ids_name(self) -> str:
        return self.data.get("inputs", {}).get("input_ids", "input_ids")

    @property
    def logits_name(self) -> str:
        return self.data.get("outputs", {}).get("logits", "logits")

    @classmethod
    def load(cls, root: str | os.PathLike, verify: bool = True) -> Manifest:
        root = Path(root)
        path = root / MANIFEST
        if not root.exists():
            raise ValueError(f"artifact {root} does not exist")
        if not root.is_dir():
            raise ValueError(f"{root} is not an artifact directory")
        if not path.is_file():
            raise ValueError(f"{root} has no {MANIFEST}: not an exported edgeattn artifact")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not an edgeattn manifest (format must be {FORMAT!r})")
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"{path} has format_version {version!r}; this edgeattn reads up to {FORMAT_VERSION}: upgrade edgeattn"
            )
        check_structure(data, str(path))
        check_inside(root, data, str(path))
        m = cls(root, data)
        if verify:
            m.verify_files()
        return m

    def verify_files(self) -> None:
        for name, info in self.data["files"].items():
            p = self.root / name
            if not p.is_file():
                raise ValueError(f"{p} is missing from the artifact")
            if sha256_file(p) != info["sha256"]:
                raise ValueError(
                    f"{p} does not match its sha256 in {MANIFEST}: the file is corrupt or was edited"
                )

    def graph_io(self, graph: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """What ``graph`` must take and return: name -> (element type, shape), a str dimension dynamic."""
        B, V = "batch" if self.dynamic_batch else self.batch_size, self.vocab_size
        T = 1 if graph == "step" else self.prefill_tokens
        inputs = {self.input_ids_name: ("int64", (B, T))}
        outputs = {self.logits_name: ("float32", (B, 1 if self.prefill_logits == "last" else T, V))}
        for e in self.state:
            shape = (B, *e.shape[1:]) if self.dynamic_batch else e.shape
            inputs[e.input] = (e.dtype, shape)
            outputs[e.output] = (e.dtype, shape)
            if e.steps:
                outputs[e.steps] = (e.dtype, (shape[0], "tokens", *shape[1:]))
        return inputs, outputs

    @property
    def verify_states(self) -> bool:
        """Whether a call's graph also gives every fixed-size state tensor after each of its tokens (the
        entries' ``steps`` outputs; KV buffers come back by their position)."""
        return any(e.steps for e in self.state)

    def check_graph_io(self, graph: str, inputs: dict[str, tuple], outputs: dict[str, tuple]) -> None:
        """Compare a graph's real inputs and outputs (name -> (element type, shape), where a dimension that is
        None or a str is symbolic) with the manifest; ValueError naming the tensor. The graph may have
        outputs the manifest does not list, not inputs (nothing would feed them)."""
        where = f"{self.graph_path(graph)}"
        want_in, want_out = self.graph_io(graph)
        for kind, want, got in (("input", want_in, inputs), ("output", want_out, outputs)):
            for name, (dtype, shape) in want.items():
                if name not in got:
                    raise ValueError(
                        f"{where} has no {kind} named {name!r}, which {MANIFEST} lists: the manifest does not "
                        "belong to this graph (edited?)"
                    )
                got_type, got_shape = got[name]
                if got_type != dtype:
                    raise ValueError(f"{where}: {kind} {name!r} is {got_type}, {MANIFEST} says {dtype}")
                ok = len(got_shape) == len(shape) and all(
                    isinstance(w, str) or g is None or isinstance(g, str) or int(g) == int(w)
                    for g, w in zip(got_shape, shape)
                )
                if not ok:
                    raise ValueError(
                        f"{where}: {kind} {name!r} has shape {list(got_shape)}, {MANIFEST} says {list(shape)}"
                    )
        extra = sorted(set(inputs) - set(want_in))
        if extra:
            raise ValueError(f"{where} has the input {extra[0]!r}, which {MANIFEST} does not list")


_HEX = frozenset("0123456789abcdef")


def check_name(name, where: str, field: str) -> str:
    """``name``, read from a manifest's ``field``, if it is a plain relative name of a file inside the
    artifact (``step.onnx``, ``checkpoint/config.json``); else ValueError in one line naming the entry. A
    name read from a file is never a path: no absolute path, no ``..`` (nor ``.`` or an empty part), no
    backslash, no drive letter or other colon, no NUL (the C++ runtime's manifest.cpp refuses the same)."""
    if not isinstance(name, str) or not name:
        why = "is not a file name"
    elif name.startswith("/"):
        why = "is an absolute path"
    elif "\\" in name:
        why = "holds a backslash"
    elif ":" in name:
        why = "holds a colon (a drive letter?)"
    elif "\0" in name:
        why = "holds a NUL character"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        why = "has an empty, '.' or '..' part"
    else:
        return name
    raise ValueError(
        f"{where}: {field} {name!r} {why}: every file an artifact names must be a plain relative name inside it"
    )


def manifest_names(data: dict):
    """(field, name) of every file or directory name in the manifest ``data``: the keys of ``files``, the
    graphs' paths, the weights file, the genai files, the checkpoint directory, the tokenizer's files."""
    for g, info in (data.get("graphs") or {}).items():
        if isinstance(info, dict) and "path" in info:
            yield f"'graphs.{g}.path'", info["path"]
    sections = (
        ("weights", ("path",)),
        ("genai", ("graph", "config")),
        ("tokenizer", ("path", "chat_template")),
    )
    for section, keys in sections:
        info = data.get(section)
        if isinstance(info, dict):
            for key in keys:
                if info.get(key) is not None:
                    yield f"'{section}.{key}'", info[key]
    if data.get("checkpoint"):
        yield "'checkpoint'", data["checkpoint"]
    for name in data.get("files") or {}:
        yield "'files' entry", name


def check_inside(root: str | os.PathLike, data: dict, where: str) -> None:
    """ValueError in one line unless every name of ``data`` (checked by ``check_name``) resolves inside
    ``root``: a symbolic link in the artifact may point within it, never out of it."""
    base = Path(os.path.realpath(root))
    for field, name in manifest_names(data):
        real = Path(os.path.realpath(Path(root) / name))
        if base not in real.parents:
            raise ValueError(
                f"{where}: {field} {name!r} leads outside the artifact (a symbolic link to {real}): every file "
                "an artifact names must be inside it"
            )


def check_structure(data: dict, where: str) -> None:
    """ValueError naming the field unless ``data`` has every field a session reads, with the right type, and
    lists (with a sha256) every file a session runs: both graphs and, when there is one, the checkpoint."""

    def need(obj: dict, key: str, types, what: str, ctx: str = ""):
        if not isinstance(obj, dict) or key not in obj:
            raise ValueError(f"{where} lacks the key {ctx + key!r}")
        value = obj[key]
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise ValueError(f"{where}: {ctx + key!r} must be {what}, got {value!r}")
        return value

    need(data, "fingerprint", str, "a string")
    for key in ("vocab_size", "batch_size"):
        if need(data, key, int, "a positive integer") < 1:
            raise ValueError(f"{where}: {key!r} must be a positive integer, got {data[key]!r}")
    if data.get("max_length") is not None and (
        not isinstance(data["max_length"], int)
        or isinstance(data["max_length"], bool)
        or data["max_length"] < 1
    ):
        raise ValueError(
            f"{where}: 'max_length' must be null or a positive integer, got {data['max_length']!r}"
        )
    if "dynamic_batch" in data and not isinstance(data["dynamic_batch"], bool):
        raise ValueError(f"{where}: 'dynamic_batch' must be true or false, got {data['dynamic_batch']!r}")
    for key in ("target", "precision"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{where}: {key!r} must be a string, got {data[key]!r}")
    for key, name in (("inputs", "input_ids"), ("outputs", "logits")):
        if key in data:
            need(data, key, dict, "an object")
            if name in data[key]:
                need(data[key], name, str, "a string", f"{key}.")
    graphs = need(data, "graphs", dict, "an object")
    for g in ("step", "prefill"):
        info = need(graphs, g, dict, "an object", "graphs.")
        need(info, "path", str, "a string", f"graphs.{g}.")
        tokens = need(info, "tokens", int, "a positive integer", f"graphs.{g}.")
        if tokens < 1 or (g == "step" and tokens != 1):
            raise ValueError(
                f"{where}: 'graphs.{g}.tokens' must be {'1' if g == 'step' else '>= 1'}, got {tokens}"
            )
    state = need(data, "state", list, "a list")
    for i, e in enumerate(state):
        ctx = f"state[{i}]."
        if not isinstance(e, dict):
            raise ValueError(f"{where}: 'state[{i}]' must be an object, got {e!r}")
        for key in ("input", "output", "name"):
            need(e, key, str, "a string", ctx)
        need(e, "layer", int, "an integer", ctx)
        shape = need(e, "shape", list, "a list of sizes", ctx)
        if not all(
            isinstance(d, str) or isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(
                f"{where}: '{ctx}shape' must hold sizes >= 0 (or names of dynamic sizes), got {shape!r}"
            )
        allowed = KV_DTYPES if e.get("shared") else ("float32",)
        if need(e, "dtype", str, "a string", ctx) not in allowed:
            raise ValueError(
                f"{where}: '{ctx}dtype' must be 'float32' (every state tensor is; a KV buffer float16 or "
                f"int8 too), got {e['dtype']!r}"
            )
        if e["dtype"] == "int8":  # its scales, one per KV head and channel
            scale = e.get("scale")
            rows = shape[1] if len(shape) == 4 else None
            if not (
                isinstance(scale, list)
                and len(scale) == rows
                and all(
                    isinstance(r, list)
                    and len(r) == shape[3]
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in r)
                    for r in scale
                )
            ):
                raise ValueError(
                    f"{where}: '{ctx}scale' must list {rows} rows of {shape[3] if rows else 'D'} positive "
                    "numbers (an int8 KV buffer's scales per KV head and channel)"
                )
        steps = e.get("steps")
        if steps is not None and (not isinstance(steps, str) or not steps or e.get("shared")):
            raise ValueError(
                f"{where}: '{ctx}steps' must be the name of a graph output, on a state tensor that is not a "
                f"shared KV buffer; got {steps!r}"
            )
    if data.get("prefill_logits", "all") not in ("all", "last"):
        raise ValueError(f"{where}: 'prefill_logits' must be 'all' or 'last', got {data['prefill_logits']!r}")
    count = data.get("logits_count")
    if count is not None and (
        not isinstance(count, str) or not count or data.get("prefill_logits") != "last"
    ):
        raise ValueError(
            f"{where}: 'logits_count' must be the name of a graph input, with 'prefill_logits' 'last'; got {count!r}"
        )
    names = [
        data.get("inputs", {}).get("input_ids", "input_ids"),
        data.get("outputs", {}).get("logits", "logits"),
        *([count] if count else []),
    ]
    names += [e["input"] for e in state] + [e["output"] for e in state]
    names += [e["steps"] for e in state if e.get("steps")]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}: the graph tensor name {dup[0]!r} is used twice")
    files = need(data, "files", dict, "an object")
    for name, info in files.items():
        if not isinstance(info, dict):
            raise ValueError(f"{where}: 'files.{name}' must be an object with a sha256")
        sha = need(info, "sha256", str, "a sha256 hex digest", f"files.{name}.")
        if len(sha) != 64 or not set(sha) <= _HEX:
            raise ValueError(f"{where}: 'files.{name}.sha256' must be a sha256 hex digest, got {sha!r}")
    # what a session runs must be verifiable: a file missing from "files" would run unchecked
    needed = [graphs[g]["path"] for g in ("step", "prefill")]
    ckpt = data.get("checkpoint")
    if ckpt:
        if not isinstance(ckpt, str):
            raise ValueError(f"{where}: 'checkpoint' must be null or a directory name, got {ckpt!r}")
        needed += [f"{ckpt}/config.json", f"{ckpt}/model.safetensors"]
    for field, name in manifest_names(data):
        check_name(name, where, field)
    for name in needed:
        if name not in files:
            raise ValueError(f"{where}: {name} is not listed under 'files', so it cannot be verified")


def build_manifest(
    *,
    fingerprint: str,
    producer: str,
    model: dict,
    batch_size: int,
    dynamic_batch: bool,
    target: str,
    precision: str,
    opset: int,
    requires: dict,
    exported_with: dict,
    max_length: int | None,
    graphs: dict,
    state: list[dict],
    weights: dict | None,
    genai: dict | None,
    checkpoint: str | None,
    files: list[str],
    tokenizer: dict | None = None,
) -> dict:
    """The manifest of an artifact (every field of docs/artifact-format.md, in its order): ``files`` lists
    the relative paths whose sha256 ``write_manifest`` (or the packager, as it writes them) fills in."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    data = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "producer": producer,
        "model": model,
        "vocab_size": model["vocab_size"],
        "batch_size": batch_size,
        "dynamic_batch": dynamic_batch,
        "target": target,
        "precision": precision,
        "opset": opset,
        "requires": requires,
        "exported_with": exported_with,
        "max_length": max_length,
        "inputs": {"input_ids": "input_ids"},
        "outputs": {"logits": "logits"},
        "graphs": graphs,
        "state": state,
        "weights": weights,
        "genai": genai,
        "checkpoint": checkpoint,
        "files": {f: {} for f in files},
    }
    if tokenizer is not None:
        data["tokenizer"] = tokenizer
    return data


def write_manifest(root: Path, data: dict, hashes: dict[str, dict] | None = None) -> None:
    """Fill in the sha256 and size of every listed file (from ``hashes``, name -> ``{"sha256", "bytes"}``,
    where the writer hashed it as it wrote it; else read back from ``root``), then write the manifest."""
    hashes = hashes or {}
    files = {}
    for name in data["files"]:
        if name in hashes:
            files[name] = {"sha256": hashes[name]["sha256"], "bytes": hashes[name]["bytes"]}
        else:
            p = root / name
            files[name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    data["files"] = files
    (root / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
