"""EdgeLM -> an artifact directory: step.onnx, prefill.onnx and the edgeattn.json manifest.

Both graphs take ``input_ids`` and every state tensor (``past_key_values.{layer}.{name}``) and return
``logits`` and every new state tensor (``present.{layer}.{name}``), as in onnxruntime-genai. The step
graph is the mixers' pure single-token step; the prefill graph is their chunkwise form over C tokens.

Targets:
- ``onnxruntime``: the gated recurrences become ONNX Runtime's fused ``com.microsoft.LinearAttention``
  (needs onnxruntime >= 1.31); everything else is plain ONNX.
- ``portable``: standard ops only at opset 17, no Loop/Scan, no float64: what TensorRT 10 parses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from edgeattn import __version__
from edgeattn._atomic import make_temp_dir, replace_dir
from edgeattn._deps import require
from edgeattn.artifact.manifest import (
    INT8_DEFAULT,
    KV_DTYPES,
    MANIFEST,
    PRECISIONS,
    TARGETS,
    build_manifest,
    sha256_file,
)
from edgeattn.artifact.sources import CHECKPOINT, GGUF
from edgeattn.export.genai import GENAI_CONFIG, GENAI_GRAPH
from edgeattn.export.graph import release_memory
from edgeattn.export.optimize import TOKEN_AXIS  # the one graph's dynamic token dimension
from edgeattn.export.precision import INT4_DEFAULTS

torch = require("torch")

OPSET = 17
FUSED_MIN_ORT = "1.31.0"
# LinearAttention's delta rules and CausalConvWithState: checked on 1.32 (tests/test_ort_contrib_ops.py).
FUSED_DELTA_MIN_ORT = "1.32.0"
DELTA_FAMILIES = frozenset({"deltanet", "gated_deltanet", "kda", "mamba2"})
# Mixers whose onnxruntime-target graph takes any number of tokens (the fused recurrences, and the
# linearized Hedgehog forms, whose one torch form serves every T): a model made of them and of softmax
# layers on a GroupQueryAttention KV buffer exports one graph that serves as both step and prefill
# (one_graph_ok).
ONE_GRAPH_MIXERS = frozenset(
    {"linear", "performer", "retnet", "gla", "hedgehog", "hedgehog_window", *DELTA_FAMILIES}
)
ONE_GRAPH_PRECISIONS = ("fp32", "int4")  # and int8 with weight-only blocks (ExportPlan.graph_precision)
CHECKPOINT_DIR = "checkpoint"
# the CLI's flag of each quantization option (ExportPlan.check names both)
QUANTIZATION_FLAGS = {
    "block_size": "--int4-block-size",
    "symmetric": "--int4-asymmetric",
    "offsets": "--int4-offsets/--no-int4-offsets",
    "accuracy_level": "--int4-accuracy-level",
    "weights": "--int8-weights",
}


class GraphModule(torch.nn.Module):
    """EdgeLM with its state flattened into positional tensors, in the manifest's order. With ``steps`` (the
    entries that have a ``"steps"`` output, ``verify_states``), the outputs go on with each of those tensors
    after every token of the call, [B, T, ...], in the entries' order."""

    def __init__(self, model, batch_size: int, steps: list[dict] | None = None):
        super().__init__()
        self.model = model
        self.specs = model.state_spec(batch_size)
        self.steps = [(e["layer"], e["name"]) for e in steps or []]
        for m in model.mixers:
            m.emit_steps = bool(self.steps) and m.has_steps

    def forward(self, input_ids, *flat_state):
        state, i = [], 0
        for layer_specs in self.specs:
            state.append({s.name: flat_state[i + j] for j, s in enumerate(layer_specs)})
            i += len(layer_specs)
        logits, new_state = self.model(input_ids, state)
        flat = [new_state[layer][s.name] for layer, specs in enumerate(self.specs) for s in specs]
        steps = []
        for layer, name in self.steps:
            mixer = self.model.mixers[layer]
            if mixer.emit_steps:
                steps.append(mixer.last_steps[name])
            else:  # a KV-buffer layer's position: the buffer comes back by it
                t = torch.ones_like(input_ids[0], dtype=torch.float32).cumsum(0)  # [T]: 1 .. T
                steps.append(state[layer][name][:, None] + t[None, :])
        return (logits, *flat, *steps)


def steps_refusal(model, entries: list[dict]) -> str | None:
    """Why ``verify_states`` cannot export ``model`` (None: it can): every fixed-size state tensor must come
    after each token of a call, which the gated recurrences (GLA, RetNet, linear, Performer) and the linearized
    Hedgehog forms give in closed form (``Mixer.has_steps``); a KV-buffer layer's own state is its position."""
    for e in entries:
        mixer = model.mixers[e["layer"]]
        if (
            e.get("shared")
            or mixer.has_steps
            or (getattr(mixer, "kv_buffer", None) and e["name"] == "position")
        ):
            continue
        return (
            f"verify_states: layer {e['layer']} ({mixer.mixer_name}) cannot give its {e['name']!r} after each "
            "token of a call (the gated recurrences and the Hedgehog forms can; the delta rules, Mamba2 and "
            "convolutions re-advance instead): export without --verify-states"
        )
    return None


def state_entries(model, batch_size: int) -> list[dict]:
    """The manifest's state list; ``"shared": true`` marks a preallocated KV buffer that the runtime binds
    as both the past input and the present output (the graph updates it in place)."""
    out, kv_layers = [], set(model.kv_buffer_layers())
    for layer, specs in enumerate(model.state_spec(batch_size)):
        buffered = layer in kv_layers
        for s in specs:
            e = {
                "input": f"past_key_values.{layer}.{s.name}",
                "output": f"present.{layer}.{s.name}",
                "layer": layer,
                "name": s.name,
                "shape": list(s.shape),
                "dtype": s.dtype,
            }
            if buffered and s.name in ("key", "value"):
                e["shared"] = True
            out.append(e)
    return out


def use_kv_buffers(model, target: str, max_length: int | None = None) -> bool:
    """On the onnxruntime target, softmax layers keep a preallocated KV buffer of ``max_length`` tokens
    (default ``cfg.max_seq_len``; ONNX Runtime's GroupQueryAttention, past and present in one buffer); the
    portable target keeps the growing cache. Returns whether any layer does."""
    length = model.cfg.max_seq_len if max_length is None else max_length
    return bool(model.set_kv_buffers(length if target == "onnxruntime" else None))


def check_max_length(max_length) -> None:
    """ValueError unless ``max_length`` is None or a positive int. No upper bound: edgeattn's models have
    no learned absolute position embeddings (softmax layers are NoPE or rotary)."""
    if max_length is not None and (
        not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1
    ):
        raise ValueError(f"max_length must be a positive integer (tokens), got {max_length!r}")


def kv_buffer_bytes(
    checkpoint: str | os.PathLike, target: str, batch_size: int = 1, max_length: int | None = None
) -> int:
    """Bytes of the preallocated KV buffers (the manifest's ``"shared"`` state) that exporting
    ``checkpoint`` for ``target`` would give the artifact; 0 when it has none. Reads only the config (the
    model is built on the meta device, no weights)."""
    from edgeattn.models import EdgeConfig, EdgeLM

    check_max_length(max_length)
    cfg = EdgeConfig.from_dict(json.loads((Path(checkpoint) / "config.json").read_text()))
    with torch.device("meta"):
        model = EdgeLM(cfg)
    if not use_kv_buffers(model, target, max_length):
        return 0
    return shared_state_bytes(state_entries(model, batch_size))


def shared_state_bytes(entries: list[dict]) -> int:
    """Bytes of the state entries marked ``"shared"`` (the preallocated KV buffers)."""
    return sum(
        math.prod(e["shape"]) * getattr(torch, e["dtype"]).itemsize for e in entries if e.get("shared")
    )


def check_exportable(model) -> None:
    names = model.cfg.mixers
    if "aft_full" in names:
        raise ValueError(
            "mixer 'aft_full' has learned pairwise biases and no fixed-size state, so it cannot be exported "
            "as a recurrent graph; train with mixer 'aft' (learned decay) or 'aft_local' instead"
        )


LARGE_MODEL_BYTES = 2**28  # parameters above this are collected before the ONNX passes (see export_model)
BATCH_DIM = "batch"  # the symbolic leading dimension of every graph tensor in a dynamic-batch export


def fixed_batch_reason(model, target: str) -> str | None:
    """Why ``model`` cannot export with a dynamic batch for ``target`` (None when it can). Call after
    ``use_kv_buffers``. Every model can today: a softmax layer on a GroupQueryAttention KV buffer takes a
    position per sequence (its ``position`` state is ``[B]``), so a batch-N step of sequences at different
    positions equals N batch-1 steps (what ``Streams`` runs); GroupQueryAttention's prefill with tokens
    already in the buffer takes batch 1 only, so such an artifact prefills one sequence per call (as the
    sessions and ``Streams`` do)."""
    return None


def one_graph_ok(model, target: str, precision: str) -> bool:
    """Whether the artifact can be one graph with a dynamic token axis for both step and prefill: the
    onnxruntime target (its fused ops take any number of tokens), fp32 or int4 (one session holds one
    prepacked copy of the weights), and every layer a fused recurrence, a Hedgehog form or a softmax layer
    on a GroupQueryAttention KV buffer (which also takes any number of tokens)."""
    from edgeattn.layers.softmax import SoftmaxAttention

    if target != "onnxruntime" or precision not in ONE_GRAPH_PRECISIONS:
        return False
    for name, block in zip(model.cfg.mixers, model.blocks):
        buffered = isinstance(block.mixer, SoftmaxAttention) and block.mixer.supports_kv_buffer
        if name not in ONE_GRAPH_MIXERS and not buffered:
            return False
    return True


SHAPE_INFERENCE_ELEMENTS = 2**16  # constants above this many elements are withheld from shape inference


@contextmanager
def _shape_inference_without_weights():
    """torch.onnx's TorchScript exporter runs its shape inference with every parameter's values at hand
    (twice, before and after constant folding); each pass held another copy of the weights (at 0.8B
    parameters about 3 GB more than the model at the trace's peak, and 30 s). Weights do not decide shapes:
    inside, the pass sees only the constants of up to ``SHAPE_INFERENCE_ELEMENTS`` elements (shape
    arrays, small tables), and the traced graph is the same (tests/test_artifact_identical.py)."""
    from torch import _C

    infer = _C._jit_pass_onnx_graph_shape_type_inference

    def without_weights(graph, params, *args):
        small = {k: v for k, v in params.items() if v.numel() <= SHAPE_INFERENCE_ELEMENTS}
        return infer(graph, small, *args)

    _C._jit_pass_onnx_graph_shape_type_inference = without_weights
    try:
        yield
    finally:
        _C._jit_pass_onnx_graph_shape_type_inference = infer


# 2.5 GiB: far enough over protobuf's 2 GiB that torch writes the model with external data
PLACEHOLDER_MODEL_BYTES = 5 * 2**29
PLACEHOLDER_ELEMENTS = 2**18  # the weights over this many elements are written by ``_weights_written_after``


@contextmanager
def _weights_written_after(on: bool):
    """torch.onnx's encoder copies each weight it writes, twice where a weight is a view (the tied head's
    folded ``E^T``: 2 GB at 0.8B parameters, on top of the model). Inside (``on``: a model that torch writes
    with external data, each weight in a file of its own), the encoder gets same-shaped placeholders of
    untouched memory for the weights over ``PLACEHOLDER_ELEMENTS`` elements, and the yielded dict keeps the
    real tensors by initializer name for ``_write_weights`` to write into those files afterwards."""
    from torch import _C

    real: dict = {}
    dedupe = _C._jit_pass_onnx_deduplicate_initializers

    def placeholders(graph, params, training):
        params = dedupe(graph, params, training)
        out = {}
        for k, v in params.items():
            if v.numel() > PLACEHOLDER_ELEMENTS:
                real[k] = v
                v = torch.empty(v.shape, dtype=v.dtype)
            out[k] = v
        return out

    if on:
        _C._jit_pass_onnx_deduplicate_initializers = placeholders
    try:
        yield real
    finally:
        _C._jit_pass_onnx_deduplicate_initializers = dedupe


def _write_weights(path: Path, real: dict, chunk_bytes: int = 2**26) -> None:
    """Write the tensors ``real`` (by initializer name) into the external-data files of the traced graph at
    ``path``, where ``_weights_written_after`` had torch write placeholders; a view (``E^T``) in chunks of
    rows, never whole. RuntimeError if one of them is not external (its graph would hold garbage)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    left = set(real)
    for init in model.graph.initializer:
        if init.name not in real:
            continue
        info = {e.key: e.value for e in init.external_data}
        if init.data_location != onnx.TensorProto.EXTERNAL or "location" not in info:
            raise RuntimeError(f"torch wrote weight {init.name} inline; this is a bug in edgeattn's export")
        t = real[init.name].detach()
        rows = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
        step = max(1, chunk_bytes // max(1, rows[0].numel() * t.element_size()))
        with open(path.parent / info["location"], "r+b") as f:
            f.seek(int(info.get("offset", 0)))
            for i in range(0, rows.shape[0], step):
                f.write(rows[i : i + step].contiguous().numpy().tobytes())
        left.discard(init.name)
    if left:
        raise RuntimeError(
            f"weight {sorted(left)[0]} is not in the traced graph; this is a bug in edgeattn's export"
        )


def _export_graph(
    module,
    tokens: int | None,
    batch_size: int,
    entries: list[dict],
    path: Path,
    target: str,
    dynamic_batch: bool = False,
) -> None:
    """Trace ``module`` over ``tokens`` tokens into ``path`` (``_graph_passes`` does the rest); ``tokens=None``:
    a dynamic token axis (``TOKEN_AXIS``, traced at 3 tokens: the fused ops' form, which takes any length)."""
    from edgeattn.export.contrib import fused_onnxruntime_op

    # A dynamic batch is traced at 2 so that nothing specializes on a batch of 1.
    trace_batch = 2 if dynamic_batch else batch_size
    ids = torch.zeros(trace_batch, tokens or 3, dtype=torch.long)
    # Dynamic state sizes (a growing KV cache) are traced at a small non-zero length.
    example = []
    for e in entries:
        shape = [3 if isinstance(d, str) else d for d in e["shape"]]
        if dynamic_batch:
            shape[0] = trace_batch
        example.append(torch.zeros(shape, dtype=getattr(torch, e["dtype"])))
    dynamic = {}
    if dynamic_batch:
        dynamic = {"input_ids": {0: BATCH_DIM}, "logits": {0: BATCH_DIM}}
    for e in entries:
        dims = {i: d for i, d in enumerate(e["shape"]) if isinstance(d, str)}
        if dynamic_batch:
            dims[0] = BATCH_DIM
        if dims:
            dynamic[e["input"]] = dims
            dynamic[e["output"]] = {i: d if d == BATCH_DIM else f"{d}_out" for i, d in dims.items()}
    if tokens is None:
        dynamic.setdefault("input_ids", {})[1] = TOKEN_AXIS
        dynamic.setdefault("logits", {})[1] = TOKEN_AXIS
    for e in entries:
        if "steps" in e:
            dynamic[e["steps"]] = {1: TOKEN_AXIS, **({0: BATCH_DIM} if dynamic_batch else {})}
    large = sum(p.numel() * p.element_size() for p in module.parameters()) > PLACEHOLDER_MODEL_BYTES
    with (
        warnings.catch_warnings(),
        fused_onnxruntime_op(target == "onnxruntime"),
        _shape_inference_without_weights(),
        _weights_written_after(large) as real,
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (ids, *example),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=["input_ids", *[e["input"] for e in entries]],
            output_names=[
                "logits",
                *[e["output"] for e in entries],
                *[e["steps"] for e in entries if "steps" in e],
            ],
            dynamic_axes=dynamic or None,
            do_constant_folding=True,
        )
    if real:
        _write_weights(path, real)


def _trace(module, tokens: int | None, plan: ExportPlan, scratch: Path):
    """Trace ``module`` over ``tokens`` tokens (``_export_graph``) through a file in the new directory
    ``scratch`` (over 2 GB torch writes each weight to its own file there); returns the graph's path."""
    scratch.mkdir()
    path = scratch / "graph.onnx"
    _export_graph(module, tokens, plan.batch_size, plan.entries, path, plan.target, plan.dynamic_batch)
    return path


def _load_trace(path: Path, by_reference: bool = False):
    """The traced graph at ``path`` in memory, weights and all, its scratch directory removed; or
    (``by_reference``, a large model) with its large weights left in the scratch files that torch wrote
    (``graph.load_by_reference``: the directory stays until the graph is packaged)."""
    import onnx

    from edgeattn.export.graph import load_by_reference

    if by_reference:
        return load_by_reference(path)
    graph = onnx.load(str(path))
    shutil.rmtree(path.parent)
    return graph


def _spill(graph, scratch: Path):
    """``graph`` with the large weights that the passes wrote into it (the fused projections) moved into a
    file in the new directory ``scratch`` and referenced there (``graph.reference_large``), as a new message:
    protobuf frees a message's memory only with the whole message, so the weights that the passes replaced
    stay resident until the caller drops ``graph`` (at 0.8B parameters, 2 GB more under the converter)."""
    from edgeattn.export.graph import reference_large

    scratch.mkdir()
    return reference_large(graph, scratch / "weights.bin")


def _graph_passes(graph, target: str, optimize: bool = True, tie: bool = False) -> None:
    """The ONNX side of a traced graph, in memory and in place: the fused ops' optional inputs, the graph
    optimizer, a tied embedding stored once."""
    if target == "onnxruntime":
        from edgeattn.export.graph import fix_optional_inputs

        fix_optional_inputs(graph)
        if optimize:
            from edgeattn.export.optimize import optimize_graph

            optimize_graph(graph)
    if tie:
        from edgeattn.export.optimize import share_tied_embedding

        share_tied_embedding(graph)


def _check_ids(plan, tokens: int, vocab: int):
    """The precision check's calls of ``tokens`` ids (``precision.check_ids``): as many as the KV buffers hold
    (at most ``CHECK_CALLS``; one at least: a fixed-length graph's chunk fits, ``ExportPlan`` checks it). A
    graph with a dynamic token axis is checked with calls of ``CHECK_TOKENS``, or of the buffers' length
    where they hold fewer."""
    from edgeattn.export.precision import CHECK_CALLS, check_ids

    calls = CHECK_CALLS
    if plan.kv_buffers:
        tokens = min(tokens, plan.length)
        calls = max(1, min(calls, plan.length // tokens))
    return check_ids(plan.batch_size, tokens, vocab, calls)


def _torch_logits(module, entries: list[dict], ids) -> list:
    """The float32 logits of the torch ``module`` (``GraphModule``) over the consecutive calls ``ids``
    [calls, B, T] (``precision.check_ids``), its state starting at zero: the reference that the precision
    check measures a converted graph against (as ``edgeattn check`` measures an artifact). One call over
    the whole text, split per call: the same logits as feeding the state back (what the check tests the
    graph for), for a fraction of the time (the chunk forms cost per call, not per token)."""
    calls, batch, tokens = ids.shape
    text = torch.from_numpy(ids.transpose(1, 0, 2).reshape(batch, calls * tokens).copy())  # [B, calls*T]
    state = [
        torch.zeros([0 if isinstance(d, str) else d for d in e["shape"]], dtype=getattr(torch, e["dtype"]))
        for e in entries
    ]
    with torch.no_grad():
        logits = module(text, *state)[0].float().numpy()  # [B, calls*T, V]
    return [logits[:, c * tokens : (c + 1) * tokens] for c in range(calls)]


# Chats the int8 KV scales are calibrated on where the model has a tokenizer (_kv_calibration): the
# chat template's own tokens and short turns of prose, what a served model's buffers hold
CALIBRATION_CHATS = (
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of Germany?"},
        {"role": "assistant", "content": "The capital of Germany is Berlin."},
        {"role": "user", "content": "Name three primary colors, and say why they are called primary."},
    ],
    [
        {"role": "user", "content": "Translate 'good morning' into French, then write 12 times 7 in words."},
        {"role": "assistant", "content": "Bonjour. Twelve times seven is eighty-four."},
        {
            "role": "user",
            "content": "Write a short Python function that returns the largest of three numbers.",
        },
    ],
)


def _kv_calibration(module, entries: list[dict], plan, root: Path | None = None) -> dict:
    """The softmax layers' keys (after rotary) and values, by state input name, over calls of at most
    ``KV_CALIBRATION_TOKENS`` tokens each from a zero state (fewer where the buffers are shorter): the check
    text, and token ids drawn uniformly from the whole vocabulary (seed 0; the text reaches few of them);
    where ``root`` holds the model's tokenizer, the check text as that tokenizer encodes it and
    ``CALIBRATION_CHATS`` through its chat template too (a real model's keys and values on its own tokens
    reach past those of byte ids: SmolLM2-135M's buffers clipped in 41 of 60 on one chat question without
    them): ``set_kv_dtype``'s int8 scales."""
    import numpy as np

    from edgeattn.artifact.tokenizer import TOKENIZER_JSON, checkpoint_tokenizer
    from edgeattn.export.check import default_text
    from edgeattn.export.precision import KV_CALIBRATION_TOKENS, kv_calibration

    n, vocab = min(KV_CALIBRATION_TOKENS, plan.length), module.model.cfg.vocab_size
    text = np.frombuffer(default_text(n), np.uint8).astype(np.int64)[:n] % vocab
    drawn = np.random.default_rng(0).integers(0, vocab, n)
    calls = [text, drawn]
    if root is not None and (Path(root) / TOKENIZER_JSON).is_file():
        tok = checkpoint_tokenizer(root, module.model.cfg)
        calls.append(tok.encode(default_text(8 * n).decode("utf-8", "replace")))
        if getattr(tok, "chat_template", None):
            try:
                calls += [tok.encode(tok.apply_chat_template(c)) for c in CALIBRATION_CHATS]
            except ValueError:  # a template that cannot render these chats: the other texts stand
                pass
    parts = []
    for ids in (np.asarray(c, np.int64)[:n] for c in calls if len(c)):
        state = [
            torch.zeros(
                [0 if isinstance(d, str) else d for d in e["shape"]], dtype=getattr(torch, e["dtype"])
            )
            for e in entries
        ]
        with torch.no_grad():
            out = module(torch.from_numpy(ids[None].repeat(plan.batch_size, 0)), *state)
        parts.append(kv_calibration([s.numpy() for s in out[1:]], entries, len(ids)))
    return {k: np.concatenate([p[k] for p in parts], axis=2) for k in parts[0]}


def _carry_tokenizer(root: Path, cfg, package) -> dict | None:
    """Write a model's tokenizer.json (and chat template) from its directory ``root`` into the artifact; its
    manifest entry. None for byte-level models (no tokenizer.json there)."""
    from edgeattn.artifact.tokenizer import CHAT_TEMPLATE, TOKENIZER_JSON, check_vocabulary, tokenizer_info

    if not (root / TOKENIZER_JSON).is_file():
        return None
    info = tokenizer_info(root)
    info.update(cfg.extra.get("tokenizer", {}))  # special ids recorded at import (from the model's configs)
    check_vocabulary(info["vocab_size"], cfg.vocab_size)
    package.write(TOKENIZER_JSON, (root / TOKENIZER_JSON).read_bytes())
    if info["chat_template"]:
        info["chat_template"] = package.write(CHAT_TEMPLATE, info["chat_template"].encode())
    return info


def min_onnxruntime(cfg, target: str) -> str:
    """The oldest ONNX Runtime that runs the graphs of ``target``."""
    if target != "onnxruntime":
        return "1.16.0"
    return FUSED_DELTA_MIN_ORT if DELTA_FAMILIES & set(cfg.mixers) else FUSED_MIN_ORT


def checkpoint_hashes(checkpoint: Path) -> tuple[str, dict[str, dict]]:
    """The fingerprint of the checkpoint directory ``checkpoint`` (its config.json's bytes and
    model.safetensors' sha256) and the sha256 and size of those two files, by name (each read once)."""
    from edgeattn.artifact.sources import CONFIG, WEIGHTS

    config, weights = (checkpoint / CONFIG).read_bytes(), sha256_file(checkpoint / WEIGHTS)
    h = hashlib.sha256()
    h.update(config)
    h.update(weights.encode())
    return h.hexdigest(), {
        CONFIG: {"sha256": hashlib.sha256(config).hexdigest(), "bytes": len(config)},
        WEIGHTS: {"sha256": weights, "bytes": (checkpoint / WEIGHTS).stat().st_size},
    }


@dataclass
class ExportPlan:
    """Every option of an export, checked, and every choice it makes for a model: one graph or two, KV
    buffers, the state list, the tokens each graph takes. ``check()`` needs only the options (it runs before
    any model is loaded); ``decide(model)`` checks the model against them and configures its softmax layers'
    KV buffers. ``notes()`` says what the user should know about the choices."""

    target: str = "onnxruntime"
    precision: str = "fp32"
    batch_size: int = 1
    dynamic_batch: bool = False
    prefill_chunk: int = 64
    include_checkpoint: bool = True
    shared_weights: bool = True
    quantization: dict | None = None
    genai: bool = False
    optimize: bool = True
    one_graph: bool | None = None
    max_length: int | None = None
    kv_dtype: str = "float32"  # the softmax layers' KV buffers (q, k and v stay float32)
    # "last": a call returns the next token's logits only (one graph); "all": every token's; None (default):
    # "last" wherever the artifact is one graph, else "all" (decided by decide())
    prefill_logits: str | None = None
    # the one graph also returns every fixed-size state tensor after each token of a call ("steps" outputs)
    verify_states: bool = False
    # decided for the model by decide()
    one: bool = False
    length: int = 0
    kv_buffers: bool = False
    entries: list = field(default_factory=list)
    shapes: list = field(default_factory=list)  # (file name, tokens or None for a dynamic token axis)
    tie: bool = False
    source_notes: list = field(default_factory=list)

    @property
    def int8_weights(self) -> str | None:
        """int8's weights (``quantization["weights"]``): by default ``INT8_DEFAULT`` on the onnxruntime target,
        whose MatMulNBits the portable target lacks: "u8" there (standard integer MatMuls)."""
        if self.precision != "int8":
            return None
        return (self.quantization or {}).get("weights") or (
            INT8_DEFAULT if self.target == "onnxruntime" else "u8"
        )

    @property
    def int8_blocks(self) -> bool:
        """int8 with weight-only MatMulNBits (``int8_weights`` "blocks"): graphs like int4's."""
        return self.int8_weights == "blocks"

    @property
    def graph_precision(self) -> str:
        """The precision whose graph rules apply (one graph, any batch): int8's blocks follow int4's."""
        return "int4" if self.int8_blocks else self.precision

    def check(self) -> None:
        """ValueError in one line for options that cannot go together (no model needed)."""
        target, precision = self.target, self.precision
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if self.graph_precision == "int4" and target != "onnxruntime":
            what = "int8 with --int8-weights blocks" if self.int8_blocks else "int4"
            raise ValueError(
                f"precision {what} uses ONNX Runtime's MatMulNBits: export it with target 'onnxruntime'"
            )
        given = self.quantization or {}
        for need, keys in (("int4", set(INT4_DEFAULTS)), ("int8", {"weights"})):
            wrong = sorted(set(given) & keys) if precision != need else []
            if wrong:
                names = ", ".join(f"{QUANTIZATION_FLAGS.get(k, k)} ({k})" for k in wrong)
                raise ValueError(f"{names}: for --precision {need} only (got precision {precision!r})")
        level = given.get("accuracy_level")
        if level is not None and (isinstance(level, bool) or level not in range(5)):
            raise ValueError(
                f"accuracy_level is int4's MatMulNBits attribute, 0..4 (got {level!r}): 4 (the default) int8 "
                "activations, 0 or 1 float32"
            )
        if self.genai and (target != "onnxruntime" or precision != "fp32"):
            raise ValueError(
                "--genai exports fp32 graphs for target 'onnxruntime' (ONNX Runtime's fused ops)"
            )
        if self.batch_size < 1 or self.prefill_chunk < 2:
            raise ValueError("batch must be >= 1 and prefill_chunk >= 2")
        check_max_length(self.max_length)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.prefill_logits not in (None, "all", "last"):
            raise ValueError(f"prefill_logits must be 'all' or 'last', got {self.prefill_logits!r}")
        if self.dynamic_batch and precision == "int8" and not self.int8_blocks:
            raise ValueError(
                "precision int8 quantizes activations with one scale per tensor (ONNX Runtime's "
                "DynamicQuantizeLinear), across the whole batch, so sequences batched together would change "
                "each other's results: use --dynamic-batch with fp32, fp16 or int4"
            )
        if self.dynamic_batch and self.genai:
            raise ValueError(
                "--dynamic-batch and --genai cannot be combined (onnxruntime-genai's graph has its own batch)"
            )
        if self.prefill_logits == "last" and (
            target != "onnxruntime"
            or self.graph_precision not in ONE_GRAPH_PRECISIONS
            or self.one_graph is False
        ):
            raise ValueError(
                "prefill_logits 'last' needs the one graph that serves step and prefill: target 'onnxruntime', "
                f"precision among {ONE_GRAPH_PRECISIONS} and fused mixers (got target {target!r}, precision "
                f"{precision!r}{', one_graph False' if self.one_graph is False else ''}); export with "
                "prefill_logits 'all'"
            )
        if self.verify_states and (target != "onnxruntime" or self.one_graph is False):
            raise ValueError(
                "verify_states adds outputs to the one graph that serves step and prefill: export with target "
                "'onnxruntime' and one graph"
            )
        if self.kv_dtype != "float32" and target != "onnxruntime":
            raise ValueError(
                f"--kv-dtype {self.kv_dtype} is the element type of the onnxruntime target's preallocated KV "
                f"buffers; on target {target!r} softmax layers keep a growing float32 KV cache: export with "
                "--target onnxruntime, or --kv-dtype float32"
            )

    def decide(self, model) -> None:
        """Check ``model`` against the options and make the choices (sets its softmax layers' KV buffers)."""
        target, precision, cfg = self.target, self.precision, model.cfg
        check_exportable(model)
        if self.genai:
            from edgeattn.export.genai import check_genai

            check_genai(model)
        ok = one_graph_ok(model, target, self.graph_precision)
        if self.one_graph and not ok:
            raise ValueError(
                f"one_graph needs target 'onnxruntime', precision among {ONE_GRAPH_PRECISIONS} and every "
                f"layer's mixer among {sorted(ONE_GRAPH_MIXERS)} or a plain softmax (got target {target!r}, "
                f"precision {precision!r}, mixers {cfg.mixers})"
            )
        self.one = ok if self.one_graph is None else self.one_graph
        if self.prefill_logits is None:
            # the fast path by default: a prompt's prefill runs the head on its last token only (SmolLM2-135M
            # int4: prefill 1.x faster; benchmarks/RESULTS.md, issue 32 item 7); a step and a prefill graph of
            # fixed length (other targets and precisions) keep every token's
            self.prefill_logits = "last" if self.one else "all"
        if self.prefill_logits == "last" and not self.one:
            raise ValueError(
                "prefill_logits 'last' needs the one graph that serves step and prefill (target onnxruntime, "
                f"precision among {ONE_GRAPH_PRECISIONS}, fused mixers)"
            )
        self.length = cfg.max_seq_len if self.max_length is None else self.max_length  # cfg keeps its own
        self.kv_buffers = use_kv_buffers(model, target, self.length)
        if self.kv_dtype != "float32" and not self.kv_buffers:
            raise ValueError(
                f"--kv-dtype {self.kv_dtype} is the element type of the softmax layers' KV buffers; this model "
                f"has no softmax layer, so no KV buffers (mixers {sorted(set(cfg.mixers))} keep fixed-size "
                "float32 states): export with --kv-dtype float32"
            )
        reason = fixed_batch_reason(model, target) if self.dynamic_batch else None
        if reason:
            raise ValueError(
                f"{reason}: for a dynamic batch export with --target portable; else export without "
                "--dynamic-batch (--batch N fixes the batch)"
            )
        self.entries = state_entries(model, self.batch_size)
        if self.verify_states:
            if not self.one:
                raise ValueError(
                    "verify_states needs the one graph that serves step and prefill (target onnxruntime, "
                    f"precision among {ONE_GRAPH_PRECISIONS}, fused mixers)"
                )
            why = steps_refusal(model, self.entries)
            if why:
                raise ValueError(why)
            for e in self.entries:
                if not e.get("shared"):
                    e["steps"] = f"{e['output']}.steps"
        if self.kv_buffers and self.prefill_chunk > self.length:
            raise ValueError(
                f"--prefill-chunk {self.prefill_chunk} exceeds --max-length {self.length}: a prefill chunk must "
                "fit the KV buffers; lower --prefill-chunk or raise --max-length"
            )
        self.shapes = (
            [("step.onnx", None)] if self.one else [("step.onnx", 1), ("prefill.onnx", self.prefill_chunk)]
        )
        # int4 quantizes the embedding (GatherBlockQuantized, blocks along D) and the head apart. An fp32
        # graph that ONNX Runtime loads once keeps E for the Gather beside the head's E^T: ONNX Runtime maps
        # the weights file, prepacks E^T and unmaps it when nothing else reads it, and a row Gather on E
        # faults in only the rows it reads, where one shared E^T stays resident whole (Qwen3.5-0.8B: 930 MiB
        # less memory for 970 MiB more file, benchmarks/RESULTS.md)
        rows = self.one and target == "onnxruntime" and precision == "fp32"
        self.tie = self.optimize and self.graph_precision != "int4" and cfg.tie_embeddings and not rows

    @property
    def limited(self) -> bool:
        """Whether the artifact has a length limit (KV buffers or a growing cache): its ``max_length``."""
        return self.kv_buffers or any(isinstance(d, str) for e in self.entries for d in e["shape"])

    @property
    def kv_buffer_bytes(self) -> int:
        return shared_state_bytes(self.entries)

    def notes(self) -> list[str]:
        """What the user should know: the converter's notes, and a --max-length that has nothing to limit."""
        out = list(self.source_notes)
        if self.max_length is not None and not self.genai and not self.limited:
            out.append(
                f"--max-length {self.max_length} ignored: every layer of this model keeps a fixed-size state, "
                "so its artifact has no length limit"
            )
        return out


GGUF_INT4_BLOCK = 32  # int4's block size for a model read from a GGUF file, unless one is given


def export_model(
    checkpoint,
    out: str | os.PathLike,
    *,
    target: str = "onnxruntime",
    precision: str = "fp32",
    batch_size: int = 1,
    dynamic_batch: bool = False,
    prefill_chunk: int = 64,
    force: bool = False,
    include_checkpoint: bool = True,
    shared_weights: bool = True,
    quantization: dict | None = None,
    genai: bool = False,
    optimize: bool = True,
    one_graph: bool | None = None,
    max_length: int | None = None,
    kv_dtype: str = "float32",
    prefill_logits: str | None = None,
    verify_states: bool = False,
    on_plan=None,
) -> Path:
    """Export ``checkpoint`` (an edgeattn checkpoint directory, a Hugging Face model directory converted in
    memory on the way, or a ``Source`` of ``edgeattn.convert.load_source``) to the artifact directory ``out``.

    ``shared_weights``: both graphs read their initializers from one ``weights.bin`` (stored once);
    False keeps each graph self-contained (two copies). ``include_checkpoint``: copy the torch checkpoint
    into the artifact (the torch backend and ``check`` need it). ``quantization``: int4 options
    (``edgeattn.export.precision.INT4_DEFAULTS``). ``genai``: also write ``model.onnx`` (any number of
    tokens per call) and ``genai_config.json`` so that onnxruntime-genai runs the artifact
    (``edgeattn.export.genai``; recurrent mixers only, fp32, target onnxruntime).
    ``optimize``: on the ``onnxruntime`` target, fuse norms and
    projections (``edgeattn.export.optimize``) before any precision conversion.
    ``dynamic_batch``: the leading dimension of ``input_ids``, ``logits`` and every state tensor is the
    symbolic ``"batch"`` in both graphs (manifest ``"dynamic_batch": true``; the shapes it lists stay those
    at ``batch_size``); otherwise the graphs take exactly ``batch_size`` sequences (what TensorRT needs).
    ``one_graph``: write one ``step.onnx`` with a dynamic token axis that the manifest names for both
    step and prefill (ONNX Runtime then holds one session, one prepacked copy of the weights); None
    (default): wherever ``one_graph_ok`` allows, False: a step and a prefill graph as on other targets.
    ``max_length``: the tokens a stream may hold where the model has a limit: the length L of the
    preallocated KV buffers ([B, Hkv, L, Dh], onnxruntime target), the manifest's ``max_length`` (the
    sessions refuse tokens past it; the portable target's growing cache too) and, with ``genai``,
    genai_config's ``context_length`` and ``max_length``. None (default): ``cfg.max_seq_len``. A model
    whose every layer has a fixed-size state has no limit: its manifest keeps ``max_length`` null. The
    checkpoint's config (and the manifest's ``model``) keep their own ``max_seq_len``.
    ``kv_dtype``: the element type of those KV buffers, float32, float16 or int8 (scales calibrated from the
    model's keys and values; ``edgeattn.export.precision.set_kv_dtype``; q, k and v stay float32).
    ``prefill_logits``: "all" (logits of every token of a call) or "last" (the next token's only,
    ``edgeattn.export.optimize.last_token_logits``: a prefill call skips the head for the others; one-graph
    artifacts only); None (default): "last" wherever the artifact is one graph, "all" elsewhere. The manifest's
    ``"prefill_logits": "last"`` says so (no key: "all"). A "last" graph's optional ``logits_count`` input asks
    for more of a call's positions: scoring (``check``, ``echo`` logprobs) and speculative decoding's verify
    calls get every position's from the same graph.
    ``verify_states``: the one graph also returns every fixed-size state tensor after each token of a call
    (the manifest entries' ``"steps"`` outputs): a speculative round takes the state after its last kept draft
    instead of re-advancing the kept tokens in the next call (gated recurrences, the Hedgehog forms and
    KV-buffer softmax layers; ``steps_refusal``). ONNX Runtime computes those outputs in every call, bound or
    not: on the CPU plain decoding slowed 12% (linearized SmolLM2) to 2x (a small GLA) and re-advancing beat
    them, so it is off by default (benchmarks/RESULTS.md, issue 35).

    ``on_plan``: called with the ``ExportPlan`` once every option is checked and every choice made, before
    the graphs are traced (the CLI prints its notes there).

    Stages: plan (``ExportPlan``: every check and choice) -> trace (one graph per shape) -> passes (optional
    inputs, optimizer, tied embedding, precision, weight sharing) -> package. The artifact is assembled in
    a temporary directory beside ``out`` and renamed into place when complete, so an interrupted export
    leaves no ``out`` behind and nothing elsewhere (the next write of ``out`` removes a killed one's
    temporary).
    """
    from edgeattn.artifact.sources import check_output, directory_kind
    from edgeattn.convert import Source, load_source

    plan = ExportPlan(
        target=target,
        precision=precision,
        batch_size=batch_size,
        dynamic_batch=dynamic_batch,
        prefill_chunk=prefill_chunk,
        include_checkpoint=include_checkpoint,
        shared_weights=shared_weights,
        quantization=quantization,
        genai=genai,
        optimize=optimize,
        one_graph=one_graph,
        max_length=max_length,
        kv_dtype=kv_dtype,
        prefill_logits=prefill_logits,
        verify_states=verify_states,
    )
    plan.check()
    out = Path(out)
    if isinstance(checkpoint, Source):
        source = checkpoint
        check_output(out, {source.root: source.kind}, force)
    else:
        root = Path(checkpoint)
        kind = directory_kind(root, "checkpoint")
        check_output(out, {root: kind}, force)
        if kind == CHECKPOINT:  # the model's refusals from its config alone, before its weights are read
            _decide_from_config(plan, root)
        source = load_source(root)
    plan.source_notes = list(source.notes)
    given = plan.quantization or {}
    if (
        plan.precision == "int4"
        and source.kind == GGUF
        and given.get("symmetric", True)
        and not {"block_size", "offsets"} <= set(given)
    ):
        # a GGUF's 4-bit weights lie on blocks of 32 inputs (Q4_0, Q4_1, Q4_K's sub-blocks): int4 keeps
        # them with block offsets (precision.offset_blocks), where ONNX Runtime's symmetric blocks re-round
        # them (SmolLM2-135M's Q4_1: perplexity +32% at block 32, +84% at 128; with offsets +5%;
        # benchmarks/RESULTS.md, issue 32)
        plan.quantization = {"offsets": True, "block_size": GGUF_INT4_BLOCK, **given}
        q = plan.quantization
        plan.source_notes.append(
            f"int4 from a GGUF file: blocks of {q['block_size']}"
            + (" with an offset each (its 4-bit grid kept)" if q["offsets"] else "")
            + f", not the default {INT4_DEFAULTS['block_size']} without; --int4-block-size and "
            "--no-int4-offsets change them"
        )
    plan.decide(source.model)
    if on_plan is not None:
        on_plan(plan)
    tmp = make_temp_dir(out)
    try:
        _write_artifact(source, plan, tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _decide_from_config(plan: ExportPlan, checkpoint: Path) -> None:
    """``plan.decide`` on the checkpoint's model built on the meta device from its config (no weights): an
    option the model cannot take is refused before its weights are loaded. ``plan`` itself is untouched."""
    from edgeattn.artifact.sources import CONFIG
    from edgeattn.models import EdgeConfig, EdgeLM

    cfg = EdgeConfig.from_dict(json.loads((checkpoint / CONFIG).read_text()))
    with torch.device("meta"):
        model = EdgeLM(cfg)
    dataclasses.replace(plan, entries=[], shapes=[], source_notes=[]).decide(model)


def _write_artifact(source, plan: ExportPlan, tmp: Path) -> None:
    """Trace, run the passes and package the artifact of ``plan`` into the empty directory ``tmp``.

    Memory: every graph is traced first (through scratch files) and the precision check's reference
    logits computed, then the torch model is freed before any graph is loaded; each graph is then loaded,
    passed and packaged in turn (one in memory at a time), and the packager writes each file once."""
    from edgeattn.artifact.sources import CONFIG, WEIGHTS
    from edgeattn.artifact.tokenizer import TOKENIZER_JSON
    from edgeattn.export.package import Package

    model, cfg, entries = source.model, source.model.cfg, plan.entries
    # The checkpoint first, while the model is in memory: it is the artifact's fingerprint (written only
    # when kept, or when the model has no checkpoint directory of its own to hash); hashed once, for both
    # (an edgeattn checkpoint is hashed at its source; safetensors writes a converted one, read back once)
    ckpt = tmp / CHECKPOINT_DIR
    if plan.include_checkpoint or source.kind != CHECKPOINT:
        source.write_checkpoint(ckpt)
    print_, hashes = checkpoint_hashes(source.root if source.kind == CHECKPOINT else ckpt)
    if not plan.include_checkpoint and ckpt.is_dir():
        shutil.rmtree(ckpt)
    package = Package(tmp, plan.shared_weights)
    if plan.include_checkpoint:
        package.hashes.update({f"{CHECKPOINT_DIR}/{n}": hashes[n] for n in (CONFIG, WEIGHTS)})
    module = GraphModule(model, plan.batch_size, [e for e in entries if "steps" in e]).eval()
    large = sum(p.numel() * p.element_size() for p in model.parameters()) > LARGE_MODEL_BYTES
    if large:  # what the converter freed goes back to the system before tracing holds more
        release_memory()
    traces = [_trace(module, tokens, plan, tmp / f".trace-{i}") for i, (_, tokens) in enumerate(plan.shapes)]
    references = []  # the precision check's, from the torch model (after tracing: not on top of its peak)
    if plan.precision != "fp32":
        from edgeattn.export.precision import CHECK_TOKENS

        if large:
            release_memory()
        for _, tokens in plan.shapes:
            ids = _check_ids(plan, tokens or CHECK_TOKENS, cfg.vocab_size)
            references.append(_torch_logits(module, entries, ids))
    calibration = None
    if plan.kv_dtype == "int8":  # the int8 KV scales, from the model's own keys and values
        calibration = _kv_calibration(module, entries, plan, source.root if source.root.is_dir() else None)
    if not plan.genai:  # genai's graph is traced from the model later
        source.model = None
        del module, model  # its weights, before the ONNX side holds its own copy
        if large:  # a full collection costs ~0.2 s: only where the memory matters
            release_memory()
    graphs, kv_entries = [name for name, _ in plan.shapes], entries
    files = []
    for i, name in enumerate(graphs):
        # a large model's weights stay in the scratch files until packaged (graph.load_by_reference)
        graph = _load_trace(traces[i], by_reference=large)
        _graph_passes(graph, plan.target, plan.optimize, plan.tie)
        if large:  # the replaced weights leave memory; the fused ones wait in a scratch file
            spilled = _spill(graph, tmp / f".spill-{i}")
            del graph
            release_memory()
            graph = spilled
        if plan.precision != "fp32":
            from edgeattn.export.precision import convert_precision

            options = dict(plan.quantization or {})
            if plan.int8_weights:  # int8's weights as the plan resolved them for the target
                options["weights"] = plan.int8_weights
            graph = convert_precision(graph, plan.precision, entries, **options)
        if plan.prefill_logits == "last":
            from edgeattn.export.optimize import last_token_logits

            if not last_token_logits(graph):
                raise ValueError(
                    f"{name}: no head MatMul writes the logits; export with prefill_logits 'all'"
                )
        if plan.kv_dtype != "float32":
            from edgeattn.export.precision import set_kv_dtype

            kv_entries = set_kv_dtype(graph, entries, plan.kv_dtype, calibration)
        written, graph = package.graph(name, graph)  # the weights leave memory: the graph as written
        files += written
        if large:
            shutil.rmtree(traces[i].parent, ignore_errors=True)
            shutil.rmtree(tmp / f".spill-{i}", ignore_errors=True)
            release_memory()
        if plan.precision != "fp32" or plan.kv_dtype != "float32":
            from edgeattn.export.precision import CHECK_TOKENS, check_logits

            ids = _check_ids(plan, plan.shapes[i][1] or CHECK_TOKENS, cfg.vocab_size)
            reference = references[i] if references else None
            check_logits(graph, kv_entries, ids, tmp, reference, plan.precision, plan.kv_dtype, name)
        del graph
    entries = kv_entries
    if plan.genai:
        from edgeattn.export.genai import genai_files

        scratch = tmp / ".trace-genai"
        scratch.mkdir()
        graph, extra = genai_files(
            scratch,
            model,
            plan.batch_size,
            max_length=plan.length,
            optimize=plan.optimize,
            tokenizer=(source.root / TOKENIZER_JSON).is_file(),
        )
        scratch.rmdir()
        graphs.append(GENAI_GRAPH)
        files += package.graph(GENAI_GRAPH, graph)[0]
        del graph
        files += [package.write(n, data) for n, data in extra.items()]
    weights = package.close_weights()
    if weights is not None:
        files.append(weights["path"])
    tokenizer = _carry_tokenizer(source.root, cfg, package)
    if tokenizer is not None:
        files += [tokenizer["path"]] + ([tokenizer["chat_template"]] if tokenizer["chat_template"] else [])
        if plan.genai:  # genai's Tokenizer reads tokenizer_config.json beside tokenizer.json
            from edgeattn.artifact.tokenizer import TOKENIZER_CONFIG
            from edgeattn.export.genai import tokenizer_config

            files.append(package.write(TOKENIZER_CONFIG, tokenizer_config(source.root, plan.length)))
    if plan.include_checkpoint:
        files += [f"{CHECKPOINT_DIR}/{CONFIG}", f"{CHECKPOINT_DIR}/{WEIGHTS}"]
    import onnxruntime

    manifest = build_manifest(
        fingerprint=print_,
        producer=f"edgeattn {__version__}",
        model=cfg.to_dict(),
        batch_size=plan.batch_size,
        dynamic_batch=plan.dynamic_batch,
        target=plan.target,
        precision=plan.precision,
        opset=21 if plan.graph_precision == "int4" else OPSET,
        requires={"onnxruntime": min_onnxruntime(cfg, plan.target)},
        exported_with={"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        max_length=plan.length if plan.limited else None,
        graphs={
            "step": {"path": "step.onnx", "tokens": 1},
            # one graph: the same file, fed chunks of prefill_chunk (its token axis is dynamic)
            "prefill": {"path": plan.shapes[-1][0], "tokens": plan.prefill_chunk},
        },
        state=entries,
        weights=weights,
        genai={"graph": GENAI_GRAPH, "config": GENAI_CONFIG} if plan.genai else None,
        checkpoint=CHECKPOINT_DIR if plan.include_checkpoint else None,
        files=files,
        tokenizer=tokenizer,
    )
    if plan.prefill_logits == "last":  # absent: "all" (the manifests of such artifacts stay as they were)
        from edgeattn.export.optimize import LOGITS_COUNT

        manifest["prefill_logits"] = "last"
        manifest["logits_count"] = LOGITS_COUNT  # the optional input: logits of a call's last n tokens
    package.manifest(manifest)


def read_manifest_json(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())
