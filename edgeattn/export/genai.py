"""Artifacts that onnxruntime-genai runs too (``edgeattn export --genai``): ``model.onnx`` and ``genai_config.json``.

onnxruntime-genai (checked with 0.18) runs one decoder graph for prompts and single tokens alike, and
carries a recurrent model's state as ``conv_state`` and ``recurrent_state`` tensors that it discovers
through the ``conv_state`` inputs. So the genai graph is the model over a dynamic number of tokens
(``input_ids [B, sequence_length]`` -> ``logits [B, sequence_length, vocab]``; the fused ONNX Runtime ops
take any length, so a whole prompt is one call), with the artifact's state names
``past_key_values.{layer}.recurrent_state`` / ``present.{layer}.recurrent_state``. A layer without a
convolution gets a pass-through ``conv_state`` (the graph returns it unchanged) of the other layers'
shape, or [B, 1, 1]: genai gives every layer the first layer's shapes, so layers that have a state of
the same name must agree on its shape.
genai's model type is its generic ``decoder``; the graph has no ``attention_mask`` or ``position_ids``.

Covered: the mixers whose state is a ``recurrent_state`` and at most a ``conv_state``: ``gla``,
``retnet``, ``deltanet``, ``gated_deltanet``, ``kda``, ``mamba2`` (any mix of them per layer). Not covered:
``linear`` and ``performer`` (a ``normalizer`` state genai has no slot for), ``aft``/``aft_local`` (running
sums and a window of keys), ``flash`` (the current chunk's keys and a position), ``swa`` (a ring
buffer and a position) and ``softmax``/``reformer`` (a KV cache that grows by concatenation; genai's own
KV cache is a GQA buffer it fills itself).

Byte-level artifacts get a byte-level ``tokenizer.json`` (token id = byte value) so that genai's
Tokenizer works; genai stops at an end-of-sequence token that must lie in the vocabulary: byte 0 (NUL).
Imported models carry their own tokenizer.json and tokenizer_config.json, and genai_config.json their
special ids (``special_ids``), so that genai stops where the sessions stop.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from edgeattn._deps import require
from edgeattn.artifact.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON
from edgeattn.export.optimize import TOKEN_AXIS

torch = require("torch")

GENAI_GRAPH = "model.onnx"
GENAI_CONFIG = "genai_config.json"
TOKENIZER = TOKENIZER_JSON
STATE_NAMES = ("conv_state", "recurrent_state")
PASS_THROUGH = (1, 1)  # the [C, W-1] of a layer's pass-through conv_state
EOS_BYTE = 0


def check_genai(model) -> None:
    """ValueError unless every layer's state is a recurrent_state and at most a conv_state, each name of one
    shape in every layer (onnxruntime-genai allocates every layer's state with the first layer's shape)."""
    shapes: dict[str, tuple] = {}
    for layer, specs in enumerate(model.state_spec(1)):
        names = [s.name for s in specs]
        mixer = model.cfg.mixers[layer]
        if "recurrent_state" not in names or not set(names) <= set(STATE_NAMES):
            raise ValueError(
                f"--genai: layer {layer} ({mixer}) keeps the state {names}; onnxruntime-genai carries only "
                "conv_state and recurrent_state: export mixers gla, retnet, deltanet, gated_deltanet, kda "
                "or mamba2 with --genai"
            )
        for s in specs:
            if shapes.setdefault(s.name, tuple(s.shape)) != tuple(s.shape):
                raise ValueError(
                    f"--genai: layer {layer} ({mixer}) has a {s.name} of shape {list(s.shape)}, an earlier "
                    f"layer {list(shapes[s.name])}; onnxruntime-genai gives every layer the same shape"
                )


def _conv_shape(model, batch_size: int) -> list:
    """The conv_state shape of the layers that have one, else the pass-through [B, 1, 1]."""
    for specs in model.state_spec(batch_size):
        for s in specs:
            if s.name == "conv_state":
                return list(s.shape)
    return [batch_size, *PASS_THROUGH]


def genai_entries(model, batch_size: int) -> list[dict]:
    """The genai graph's state, conv_state then recurrent_state per layer (pass-through conv_states marked)."""
    out, conv = [], _conv_shape(model, batch_size)
    for layer, specs in enumerate(model.state_spec(batch_size)):
        shapes = {s.name: list(s.shape) for s in specs}
        for name in STATE_NAMES:
            out.append(
                {
                    "input": f"past_key_values.{layer}.{name}",
                    "output": f"present.{layer}.{name}",
                    "layer": layer,
                    "name": name,
                    "shape": shapes.get(name, conv),
                    "dtype": "float32",
                    "pass_through": name not in shapes,
                }
            )
    return out


class GenaiModule(torch.nn.Module):
    """EdgeLM over any number of tokens with genai's state order; pass-through conv_states returned as given."""

    def __init__(self, model, entries: list[dict]):
        super().__init__()
        self.model, self.entries = model, entries

    def forward(self, input_ids, *flat):
        n_layers = len(self.model.cfg.mixers)
        state = [{} for _ in range(n_layers)]
        for e, t in zip(self.entries, flat):
            if not e["pass_through"]:
                state[e["layer"]][e["name"]] = t
        logits, new_state = self.model(input_ids, state)
        outs = [
            t if e["pass_through"] else new_state[e["layer"]][e["name"]] for e, t in zip(self.entries, flat)
        ]
        return (logits, *outs)


def export_genai_graph(model, path: Path, batch_size: int, optimize: bool = True):
    """The dynamic-token-axis graph (onnxruntime target: fused ops), traced through the scratch file
    ``path`` (removed) and returned in memory, with its state entries. ``optimize``: run the lean-graph
    pass (``edgeattn.export.optimize``) on it, as on the artifact's graphs."""
    import onnx

    from edgeattn.export.contrib import fused_onnxruntime_op
    from edgeattn.export.graph import fix_optional_inputs

    check_genai(model)
    entries = genai_entries(model, batch_size)
    ids = torch.zeros(batch_size, 3, dtype=torch.long)  # traced at 3 tokens; the token axis stays dynamic
    example = [torch.zeros(e["shape"]) for e in entries]
    tokens = {1: TOKEN_AXIS}
    with warnings.catch_warnings(), fused_onnxruntime_op(True), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            GenaiModule(model, entries).eval(),
            (ids, *example),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids", *[e["input"] for e in entries]],
            output_names=["logits", *[e["output"] for e in entries]],
            dynamic_axes={"input_ids": tokens, "logits": tokens},
            custom_opsets={"com.microsoft": 1},
            do_constant_folding=True,
        )
    graph = onnx.load(str(path))
    Path(path).unlink()
    fix_optional_inputs(graph)
    if optimize:
        from edgeattn.export.optimize import optimize_graph, share_tied_embedding

        optimize_graph(graph)
        share_tied_embedding(graph)  # a tied embedding stored once
    return graph, entries


def byte_tokenizer_json() -> str:
    """A Hugging Face tokenizer.json whose token id is the byte value (256 tokens, byte-level, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def special_ids(cfg) -> tuple[int, list[int], int]:
    """(bos, eos, pad) for genai_config.json. An imported model's ids as recorded at import
    (``cfg.extra["tokenizer"]``, what the manifest and the sessions use): no EOS gives an empty list (genai
    then stops at the length only, as the sessions do), a missing pad falls back to the first EOS, a
    missing BOS to the pad. A byte-level model without a tokenizer stops at byte 0 (NUL)."""
    tok = cfg.extra.get("tokenizer")
    if not tok:
        return EOS_BYTE, [EOS_BYTE], EOS_BYTE
    eos = [int(i) for i in tok.get("eos_token_ids") or ()]
    pad = tok.get("pad_token_id")
    pad = int(pad) if pad is not None else (eos[0] if eos else 0)
    bos = tok.get("bos_token_id")
    return (int(bos) if bos is not None else pad), eos, pad


def genai_config(cfg, entries: list[dict], *, max_length: int, threads: int | None = None) -> dict:
    """genai_config.json for the graph ``model.onnx`` (greedy search by default; callers may change it)."""
    opts = {"log_id": "onnxruntime-genai", "provider_options": []}
    if threads:
        opts.update(intra_op_num_threads=threads, inter_op_num_threads=1)
    bos, eos, pad = special_ids(cfg)
    return {
        "model": {
            "type": "decoder",
            "vocab_size": cfg.vocab_size,
            "context_length": max_length,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "decoder": {
                "session_options": opts,
                "filename": GENAI_GRAPH,
                "hidden_size": cfg.d_model,
                "head_size": cfg.head_dim,
                "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_heads,
                "num_hidden_layers": cfg.n_layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "past_conv_names": "past_key_values.%d.conv_state",
                    "past_recurrent_names": "past_key_values.%d.recurrent_state",
                },
                "outputs": {
                    "logits": "logits",
                    "present_conv_names": "present.%d.conv_state",
                    "present_recurrent_names": "present.%d.recurrent_state",
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": max_length,
            "min_length": 0,
            "past_present_share_buffer": False,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
        },
    }


def genai_files(
    scratch: Path, model, batch_size: int, *, max_length: int, optimize: bool = True, tokenizer: bool = False
) -> tuple:
    """The genai graph (in memory, traced through a file in ``scratch``) and the contents of
    genai_config.json and, for a byte-level model without a ``tokenizer`` of its own, the tokenizer files,
    by name."""
    graph, entries = export_genai_graph(model, Path(scratch) / GENAI_GRAPH, batch_size, optimize)
    conf = genai_config(model.cfg, entries, max_length=max_length)
    files = {GENAI_CONFIG: (json.dumps(conf, indent=2) + "\n").encode()}
    if model.cfg.vocab_size == 256 and not model.cfg.extra.get("tokenizer") and not tokenizer:
        files[TOKENIZER] = byte_tokenizer_json().encode()
        files[TOKENIZER_CONFIG] = tokenizer_config(None, max_length)
    return graph, files


def tokenizer_config(checkpoint: Path | None, max_length: int) -> bytes:
    """The contents of ``tokenizer_config.json`` (onnxruntime-genai's Tokenizer reads it beside
    tokenizer.json): the checkpoint's own (an imported model's, copied at import), else a minimal one."""
    src = None if checkpoint is None else Path(checkpoint) / TOKENIZER_CONFIG
    if src is not None and src.is_file():
        return src.read_bytes()
    tok_conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    return (json.dumps(tok_conf, indent=2) + "\n").encode()
