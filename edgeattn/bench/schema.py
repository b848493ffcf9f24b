"""The schema of ``results.json`` (a JSON Schema, draft 2020-12 subset) and a small validator for it.

``validate(doc)`` returns the list of problems (empty when the document conforms); ``check(doc)`` raises
ValueError with the first. The validator understands the keywords the schema uses: ``type`` (one or a
list), ``properties``, ``required``, ``additionalProperties``, ``items``, ``enum``, ``minimum`` and
``minItems``. ``SCHEMA`` is plain JSON Schema, so ``jsonschema.validate(doc, SCHEMA)`` agrees where the
``jsonschema`` package is installed (it is not a dependency).

A figure measured on every repeat is a *stat*: ``{"median", "min", "max", "values"}`` over the repeats.
"""

from __future__ import annotations

FORMAT = "edgeattn-bench"
MiB = 2**20  # the unit of the memory columns of tables and plots
VERSION = 1

_NUM = {"type": "number"}
_OPT_NUM = {"type": ["number", "null"]}
_INT0 = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_OPT_STR = {"type": ["string", "null"]}

STAT = {
    "type": "object",
    "required": ["median", "min", "max", "values"],
    "properties": {
        "median": _NUM,
        "min": _NUM,
        "max": _NUM,
        "values": {"type": "array", "items": _NUM, "minItems": 1},
    },
    "additionalProperties": False,
}
OPT_STAT = {**STAT, "type": ["object", "null"]}

THEORY = {
    "type": "object",
    "required": [
        "context",
        "flops",
        "state_bytes",
        "weight_bytes",
        "memory_floor_s",
        "compute_floor_s",
        "floor_s",
        "bound",
    ],
    "properties": {
        "context": _INT0,
        "flops": _NUM,
        "state_bytes": _INT0,
        "weight_bytes": _INT0,
        "memory_floor_s": _NUM,
        "compute_floor_s": _NUM,
        "floor_s": _NUM,
        "bound": {"enum": ["memory", "compute"]},
    },
}

CONTEXT = {
    "type": "object",
    "required": ["context", "skipped"],
    "properties": {
        "context": _INT0,
        "skipped": _OPT_STR,
        "tokens": _INT0,
        "latency_s": {
            "type": "object",
            "required": ["p50", "p90", "p99"],
            "properties": {"p50": STAT, "p90": STAT, "p99": STAT, "mean": STAT},
        },
        "floor_s": _NUM,
        "floor_multiple": STAT,
        "rss_bytes": STAT,
        "peak_rss_bytes": STAT,
        "device_bytes": OPT_STAT,
    },
}

COMPLEXITY = {
    "type": "object",
    "required": ["parallel", "chunk", "decode", "state"],
    "properties": {k: _STR for k in ("parallel", "chunk", "decode", "state")},
}

RESULT = {
    "type": "object",
    "required": [
        "name",
        "artifact",
        "backend",
        "mixer",
        "mixers",
        "target",
        "precision",
        "params",
        "weight_bytes",
        "artifact_bytes",
        "max_length",
        "complexity",
        "theory",
        "contexts",
        "load_s",
        "rss_after_load_bytes",
        "memory_slope_bytes_per_token",
        "prefill_tokens_per_s",
        "step_tokens_per_s",
        "bits_per_byte",
        "errors",
    ],
    "properties": {
        "name": _STR,
        "artifact": _STR,
        "backend": {"enum": ["onnxruntime", "torch", "tensorrt"]},
        "device": _OPT_STR,
        "mixer": _STR,
        "mixers": {"type": "array", "items": _STR},
        "target": _STR,
        "precision": _STR,
        "params": _INT0,
        "weight_bytes": _INT0,
        "artifact_bytes": _INT0,
        "max_length": {"type": ["integer", "null"]},
        "prefill_chunk": _INT0,
        "complexity": COMPLEXITY,
        "theory": {"type": "array", "items": THEORY},
        "contexts": {"type": "array", "items": CONTEXT},
        "load_s": OPT_STAT,
        "rss_after_load_bytes": OPT_STAT,
        "memory_slope_bytes_per_token": OPT_STAT,
        "prefill_tokens_per_s": OPT_STAT,
        "step_tokens_per_s": OPT_STAT,
        "bits_per_byte": _OPT_NUM,
        "eval_bytes": {"type": ["integer", "null"]},
        "errors": {"type": "array", "items": _STR},
    },
}

MACHINE = {
    "type": "object",
    "required": [
        "cpu",
        "cores_logical",
        "memory_bytes",
        "gpus",
        "libraries",
        "bandwidth_bytes_per_s",
        "matmul_flops_per_s",
    ],
    "properties": {
        "cpu": _STR,
        "cpu_kind": _STR,
        "cpu_flags": {"type": "array", "items": _STR},
        "cores_logical": {"type": ["integer", "null"]},
        "cores_physical": {"type": ["integer", "null"]},
        "memory_bytes": _INT0,
        "gpus": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "libraries": {"type": "object", "required": ["python", "numpy", "onnxruntime"]},
        "bandwidth_bytes_per_s": _NUM,
        "matmul_flops_per_s": _NUM,
        "load_average": {"type": ["array", "null"], "items": _NUM},
    },
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "edgeattn bench results",
    "type": "object",
    "required": ["format", "version", "created", "settings", "machine", "results", "missing"],
    "properties": {
        "format": {"enum": [FORMAT]},
        "version": {"enum": [VERSION]},
        "created": _STR,
        "command": {"type": "array", "items": _STR},
        "settings": {
            "type": "object",
            "required": ["backends", "contexts", "repeats", "steps", "warmup", "threads"],
            "properties": {
                "backends": {"type": "array", "items": _STR, "minItems": 1},
                "contexts": {"type": "array", "items": _INT0, "minItems": 1},
                "repeats": {"type": "integer", "minimum": 1},
                "steps": {"type": "integer", "minimum": 1},
                "warmup": _INT0,
                "threads": {"type": ["integer", "null"]},
            },
        },
        "machine": MACHINE,
        "results": {"type": "array", "items": RESULT},
        "missing": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["mixer", "reason", "command"],
                "properties": {"mixer": _STR, "reason": _STR, "command": _STR},
            },
        },
        "comparison": {"type": ["object", "null"]},
        "files": {"type": "array", "items": _STR},
        "plots_skipped": _OPT_STR,
    },
}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(doc, schema: dict = SCHEMA, path: str = "$") -> list[str]:
    """Every way ``doc`` departs from ``schema``, as ``"<json path>: <problem>"`` lines."""
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](doc) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {type(doc).__name__}"]
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](doc) and doc < schema["minimum"]:
        errors.append(f"{path}: {doc} is below the minimum {schema['minimum']}")
    if isinstance(doc, dict):
        for key in schema.get("required", []):
            if key not in doc:
                errors.append(f"{path}: lacks the key {key!r}")
        props = schema.get("properties", {})
        for key, value in doc.items():
            if key in props:
                errors += validate(value, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += validate(value, schema["additionalProperties"], f"{path}.{key}")
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0):
            errors.append(f"{path}: needs at least {schema['minItems']} items, has {len(doc)}")
        if "items" in schema:
            for i, item in enumerate(doc):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def check(doc) -> None:
    """Raise ValueError naming the first problem unless ``doc`` is a valid results.json document."""
    errors = validate(doc)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"not an edgeattn bench results file: {errors[0]}{more}")
