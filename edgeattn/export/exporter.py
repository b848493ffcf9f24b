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

import gc
import hashlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path

from edgeattn import __version__
from edgeattn._atomic import make_temp_dir, replace_dir
from edgeattn._deps import require
from edgeattn.export.manifest import FORMAT, FORMAT_VERSION, MANIFEST, sha256_file, write_manifest
from edgeattn.export.optimize import TOKEN_AXIS  # the one graph's dynamic token dimension

torch = require("torch")

TARGETS = ("onnxruntime", "portable")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
OPSET = 17
FUSED_MIN_ORT = "1.31.0"
# LinearAttention's delta rules and CausalConvWithState: checked on 1.32 (tests/test_ort_contrib_ops.py).
FUSED_DELTA_MIN_ORT = "1.32.0"
DELTA_FAMILIES = frozenset({"deltanet", "gated_deltanet", "kda", "mamba2"})
# Mixers whose onnxruntime-target graph takes any number of tokens (the fused recurrences): a model made
# of them and of softmax layers on a GroupQueryAttention KV buffer exports one graph that serves as both
# step and prefill (one_graph_ok).
ONE_GRAPH_MIXERS = frozenset({"linear", "performer", "retnet", "gla", *DELTA_FAMILIES})
ONE_GRAPH_PRECISIONS = ("fp32", "int4")
CHECKPOINT_DIR = "checkpoint"


class GraphModule(torch.nn.Module):
    """EdgeLM with its state flattened into positional tensors, in the manifest's order."""

    def __init__(self, model, batch_size: int):
        super().__init__()
        self.model = model
        self.specs = model.state_spec(batch_size)

    def forward(self, input_ids, *flat_state):
        state, i = [], 0
        for layer_specs in self.specs:
            state.append({s.name: flat_state[i + j] for j, s in enumerate(layer_specs)})
            i += len(layer_specs)
        logits, new_state = self.model(input_ids, state)
        flat = [new_state[layer][s.name] for layer, specs in enumerate(self.specs) for s in specs]
        return (logits, *flat)


def state_entries(model, batch_size: int) -> list[dict]:
    """The manifest's state list; ``"shared": true`` marks a preallocated KV buffer that the runtime binds
    as both the past input and the present output (the graph updates it in place)."""
    out = []
    for layer, specs in enumerate(model.state_spec(batch_size)):
        buffered = bool(getattr(model.blocks[layer].mixer, "kv_buffer", None))
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
    from edgeattn.layers.softmax import SoftmaxAttention

    length = model.cfg.max_seq_len if max_length is None else max_length
    used = False
    for block in model.blocks:
        if isinstance(block.mixer, SoftmaxAttention):
            buffered = target == "onnxruntime" and block.mixer.supports_kv_buffer
            block.mixer.kv_buffer = length if buffered else None
            used |= buffered
    return used


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
    entries = state_entries(model, batch_size)
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
    ``use_kv_buffers``."""
    if any(getattr(block.mixer, "kv_buffer", None) for block in model.blocks):
        return (
            "mixer 'softmax' on the onnxruntime target uses GroupQueryAttention, whose prefill takes batch 1 "
            "only once the cache holds tokens; export it with --target portable for a dynamic batch"
        )
    return None


def one_graph_ok(model, target: str, precision: str) -> bool:
    """Whether the artifact can be one graph with a dynamic token axis for both step and prefill: the
    onnxruntime target (its fused ops take any number of tokens), fp32 or int4 (one session holds one
    prepacked copy of the weights), and every layer a fused recurrence or a softmax layer on a
    GroupQueryAttention KV buffer (which also takes any number of tokens)."""
    from edgeattn.layers.softmax import SoftmaxAttention

    if target != "onnxruntime" or precision not in ONE_GRAPH_PRECISIONS:
        return False
    for name, block in zip(model.cfg.mixers, model.blocks):
        buffered = isinstance(block.mixer, SoftmaxAttention) and block.mixer.supports_kv_buffer
        if name not in ONE_GRAPH_MIXERS and not buffered:
            return False
    return True


def _export_graph(
    module,
    tokens: int | None,
    batch_size: int,
    entries: list[dict],
    path: Path,
    target: str,
    dynamic_batch: bool = False,
) -> None:
    """Trace ``module`` over ``tokens`` tokens into ``path`` (``_finish_graph`` does the rest); ``tokens=None``:
    a dynamic token axis (``TOKEN_AXIS``, traced at 3 tokens: the fused ops' form, which takes any length)."""
    from edgeattn.ops.common.fused import fused_onnxruntime_op

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
    with warnings.catch_warnings(), fused_onnxruntime_op(target == "onnxruntime"), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (ids, *example),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=["input_ids", *[e["input"] for e in entries]],
            output_names=["logits", *[e["output"] for e in entries]],
            dynamic_axes=dynamic or None,
            custom_opsets={"com.microsoft": 1} if target == "onnxruntime" else None,
            do_constant_folding=True,
        )


def _finish_graph(path: Path, target: str, optimize: bool = True, tie: bool = False) -> None:
    """The ONNX side of an export traced by ``_export_graph``: torch's spilled weight files gathered into
    one ``PATH.data`` (over 2 GB), the fused ops' optional inputs, the graph optimizer, a tied embedding
    stored once. Runs without the torch model, so that a large model's weights are not held twice."""
    if target == "onnxruntime" or tie:
        import onnx

        from edgeattn.ops.common.fused_delta import fix_optional_inputs

        graph = onnx.load(str(path), load_external_data=False)
        # Over 2 GB torch writes each weight to its own file beside the graph: read them in, then remove
        # them (the next graph's export writes files of the same names) and save one PATH.data instead.
        from onnx.external_data_helper import _get_all_tensors, load_external_data_for_model

        spilled = {  # initializers' and Constant nodes' files
            e.value for t in _get_all_tensors(graph) for e in t.external_data if e.key == "location"
        }
        if spilled:
            load_external_data_for_model(graph, str(path.parent))
            for name in spilled:
                (path.parent / name).unlink()
        changed = bool(spilled)
        if target == "onnxruntime":
            changed = fix_optional_inputs(graph) or changed
        if optimize and target == "onnxruntime":
            from edgeattn.export.optimize import optimize_graph

            optimize_graph(graph)
            changed = True
        if tie:
            from edgeattn.export.optimize import share_tied_embedding

            changed = bool(share_tied_embedding(graph)) or changed
        if changed:
            big = sum(len(i.raw_data) for i in graph.graph.initializer) > 2**31 - 2**26
            onnx.save(graph, str(path), save_as_external_data=big, location=f"{path.name}.data")


def _carry_tokenizer(checkpoint: Path, cfg, tmp: Path) -> dict | None:
    """Copy an imported model's tokenizer.json (and chat template) into the artifact; its manifest entry.
    None for byte-level models (no tokenizer.json in the checkpoint)."""
    if not (checkpoint / "tokenizer.json").is_file():
        return None
    from edgeattn.artifact.tokenizer import CHAT_TEMPLATE, TOKENIZER_JSON, tokenizer_info

    info = tokenizer_info(checkpoint)
    info.update(cfg.extra.get("tokenizer", {}))  # special ids recorded at import (from the model's configs)
    if info["vocab_size"] > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {info['vocab_size']} tokens but the model's vocabulary is {cfg.vocab_size}"
        )
    shutil.copy2(checkpoint / TOKENIZER_JSON, tmp / TOKENIZER_JSON)
    if info["chat_template"]:
        (tmp / CHAT_TEMPLATE).write_text(info["chat_template"])
        info["chat_template"] = CHAT_TEMPLATE
    return info


def min_onnxruntime(cfg, target: str) -> str:
    """The oldest ONNX Runtime that runs the graphs of ``target``."""
    if target != "onnxruntime":
        return "1.16.0"
    return FUSED_DELTA_MIN_ORT if DELTA_FAMILIES & set(cfg.mixers) else FUSED_MIN_ORT


def fingerprint(checkpoint: Path) -> str:
    h = hashlib.sha256()
    h.update((checkpoint / "config.json").read_bytes())
    h.update(sha256_file(checkpoint / "model.safetensors").encode())
    return h.hexdigest()


def check_apart(checkpoint: Path, out: Path) -> None:
    """Refuse an output that is, contains or lies inside the checkpoint (it would copy itself into
    itself, or ``force`` would delete the checkpoint's training state)."""
    c, o = checkpoint.resolve(), out.resolve()
    if o == c or c in o.parents or o in c.parents:
        where = "is" if o == c else ("lies inside" if c in o.parents else "contains")
        raise ValueError(f"--out {out} {where} the checkpoint {checkpoint}; choose a directory outside it")


def export_model(
    checkpoint: str | os.PathLike,
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
    prefill_logits: str = "all",
) -> Path:
    """Export the checkpoint directory ``checkpoint`` to the artifact directory ``out``.

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
    ``kv_dtype``: the element type of those KV buffers, float32 or float16
    (``edgeattn.export.precision.set_kv_dtype``; q, k and v stay float32).
    ``prefill_logits``: "all" (logits of every token of a call) or "last" (the next token's only,
    ``edgeattn.export.optimize.last_token_logits``: a prefill call skips the head for the others; one-graph
    artifacts only, manifest ``"prefill_logits": "last"``).

    The artifact is assembled in a temporary directory beside ``out`` and renamed into place when
    complete, so an interrupted export leaves no ``out`` behind.
    """
    from edgeattn.models import EdgeLM

    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "int4" and target != "onnxruntime":
        raise ValueError(
            "precision int4 uses ONNX Runtime's MatMulNBits: export it with target 'onnxruntime'"
        )
    if genai and (target != "onnxruntime" or precision != "fp32"):
        raise ValueError("--genai exports fp32 graphs for target 'onnxruntime' (ONNX Runtime's fused ops)")
    if batch_size < 1 or prefill_chunk < 2:
        raise ValueError("batch must be >= 1 and prefill_chunk >= 2")
    check_max_length(max_length)
    if kv_dtype not in ("float32", "float16"):
        raise ValueError(f"kv_dtype must be float32 or float16, got {kv_dtype!r}")
    if prefill_logits not in ("all", "last"):
        raise ValueError(f"prefill_logits must be 'all' or 'last', got {prefill_logits!r}")
    if dynamic_batch and precision == "int8":
        raise ValueError(
            "precision int8 quantizes activations with one scale per tensor (ONNX Runtime's "
            "DynamicQuantizeLinear), across the whole batch, so sequences batched together would change each "
            "other's results: use --dynamic-batch with fp32, fp16 or int4"
        )
    if dynamic_batch and genai:
        raise ValueError(
            "--dynamic-batch and --genai cannot be combined (onnxruntime-genai's graph has its own batch)"
        )
    checkpoint, out = Path(checkpoint), Path(out)
    check_apart(checkpoint, out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ValueError(f"{out} exists and is not empty; pass --force to replace it")
    model = EdgeLM.load(checkpoint).eval()
    check_exportable(model)
    if genai:
        from edgeattn.export.genai import check_genai

        check_genai(model)
    cfg = model.cfg
    if one_graph and not one_graph_ok(model, target, precision):
        raise ValueError(
            f"one_graph needs target 'onnxruntime', precision among {ONE_GRAPH_PRECISIONS} and every layer's "
            f"mixer among {sorted(ONE_GRAPH_MIXERS)} or a plain softmax (got target {target!r}, precision "
            f"{precision!r}, mixers {cfg.mixers})"
        )
    one = one_graph_ok(model, target, precision) if one_graph is None else one_graph
    if prefill_logits == "last" and not one:
        raise ValueError(
            "prefill_logits 'last' needs the one graph that serves step and prefill (target onnxruntime, "
            f"precision among {ONE_GRAPH_PRECISIONS}, fused mixers)"
        )
    length = cfg.max_seq_len if max_length is None else max_length  # cfg itself keeps max_seq_len
    kv_buffers = use_kv_buffers(model, target, length)
    reason = fixed_batch_reason(model, target) if dynamic_batch else None
    if reason:
        raise ValueError(f"{reason}: export without --dynamic-batch (--batch N fixes the batch)")
    entries = state_entries(model, batch_size)
    softmax_like = kv_buffers or any(isinstance(d, str) for e in entries for d in e["shape"])

    tmp = make_temp_dir(out)
    try:
        module = GraphModule(model, batch_size).eval()
        shapes = [("step.onnx", None)] if one else [("step.onnx", 1), ("prefill.onnx", prefill_chunk)]
        # int4 quantizes the embedding (GatherBlockQuantized, blocks along D) and the head apart. An fp32
        # graph that ONNX Runtime loads once keeps E for the Gather beside the head's E^T: ONNX Runtime maps
        # the weights file, prepacks E^T and unmaps it when nothing else reads it, and a row Gather on E
        # faults in only the rows it reads, where one shared E^T stays resident whole (Qwen3.5-0.8B: 930 MiB
        # less memory for 970 MiB more file, benchmarks/RESULTS.md)
        rows = one and target == "onnxruntime" and precision == "fp32"
        tie = optimize and precision != "int4" and cfg.tie_embeddings and not rows
        large = sum(p.numel() * p.element_size() for p in model.parameters()) > LARGE_MODEL_BYTES
        for i, (name, tokens) in enumerate(shapes):
            _export_graph(module, tokens, batch_size, entries, tmp / name, target, dynamic_batch)
            if i == len(shapes) - 1 and not genai:  # genai's graph is traced from the model later
                del module, model  # its weights, before the ONNX side holds its own copy
                if large:  # a full collection costs ~0.2 s: only where the memory matters
                    gc.collect()
            _finish_graph(tmp / name, target, optimize, tie)
        graphs = [name for name, _ in shapes]
        if precision != "fp32":
            from edgeattn.export.precision import convert_precision

            for name in graphs:
                convert_precision(tmp / name, precision, entries, **(quantization or {}))
        if prefill_logits == "last":
            import onnx

            from edgeattn.export.optimize import last_token_logits

            for name in graphs:
                graph = onnx.load(str(tmp / name), load_external_data=False)
                if not last_token_logits(graph):
                    raise ValueError(
                        f"{name}: no head MatMul writes the logits; export with prefill_logits 'all'"
                    )
                onnx.save(graph, str(tmp / name))
        if kv_dtype != "float32":
            from edgeattn.export.precision import convert_kv_dtype

            for name in graphs:
                kv_entries = convert_kv_dtype(tmp / name, entries, kv_dtype, precision)
            entries = kv_entries
        extra = []
        if genai:
            from edgeattn.export.genai import GENAI_GRAPH, write_genai_files

            extra = write_genai_files(tmp, model, batch_size, max_length=length, optimize=optimize)
            graphs.append(GENAI_GRAPH)
        files = [*graphs, *[f for f in extra if f not in graphs]]
        weights = None
        if shared_weights:
            from edgeattn.export.weights import share_weights

            weights = share_weights(tmp, graphs)
            files.append(weights["path"])
        tokenizer = _carry_tokenizer(checkpoint, cfg, tmp)
        if tokenizer is not None:
            files += [tokenizer["path"]] + (
                [tokenizer["chat_template"]] if tokenizer["chat_template"] else []
            )
        if include_checkpoint:
            shutil.copytree(checkpoint, tmp / CHECKPOINT_DIR, ignore=shutil.ignore_patterns("trainer_state*"))
            files += [f"{CHECKPOINT_DIR}/config.json", f"{CHECKPOINT_DIR}/model.safetensors"]
        import onnxruntime

        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint(checkpoint),
            "producer": f"edgeattn {__version__}",
            "model": cfg.to_dict(),
            "vocab_size": cfg.vocab_size,
            "batch_size": batch_size,
            "dynamic_batch": dynamic_batch,
            "target": target,
            "precision": precision,
            "opset": 21 if precision == "int4" else OPSET,
            "requires": {"onnxruntime": min_onnxruntime(cfg, target)},
            "exported_with": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
            "max_length": length if softmax_like else None,
            "inputs": {"input_ids": "input_ids"},
            "outputs": {"logits": "logits"},
            "graphs": {
                "step": {"path": "step.onnx", "tokens": 1},
                # one graph: the same file, fed chunks of prefill_chunk (its token axis is dynamic)
                "prefill": {"path": shapes[-1][0], "tokens": prefill_chunk},
            },
            "state": entries,
            **({"prefill_logits": "last"} if prefill_logits == "last" else {}),
            "weights": weights,
            "genai": {"graph": "model.onnx", "config": "genai_config.json"} if genai else None,
            "checkpoint": CHECKPOINT_DIR if include_checkpoint else None,
            "files": {f: {} for f in files},
        }
        if tokenizer is not None:
            manifest["tokenizer"] = tokenizer
        write_manifest(tmp, manifest)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_manifest_json(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())
