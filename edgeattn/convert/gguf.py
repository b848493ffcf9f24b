"""A GGUF file (llama.cpp's format) read as a Hugging Face model: its config, weights and tokenizer files.

    model = GGUFModel("SmolLM2-135M-Instruct.Q4_1.gguf")
    model.config            # config.json's dict (model_type "llama"), from the metadata
    model.weights           # ``edgeattn.convert.hf.Weights`` under transformers' names, dequantized to float32
    model.write_tokenizer(directory)   # tokenizer.json, tokenizer_config.json, generation_config.json

The file is read with the ``gguf`` library (llama.cpp's own Python reader); the converter of the model
type (``edgeattn.convert.llama``) then maps it as it maps a Hugging Face directory.

Weights: every tensor is dequantized to float32 when taken (``gguf.quants``): F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K and Q6_K; any other type is refused naming the tensor. llama.cpp's converter permutes the rows
of ``attn_q`` and ``attn_k`` per head for its interleaved RoPE; they are permuted back here to
transformers' rotate-half layout (what transformers' GGUF loader does too).

Tokenizer: ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE; its tokens are stored in the byte-to-unicode
alphabet of GPT-2, as in a tokenizer.json) becomes a ``tokenizers`` BPE with the file's vocabulary and
merges; the pre-tokenizer is the one llama.cpp applies for ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``;
e.g. ``smollm`` splits every digit apart first, as the original SmolLM2 tokenizer.json does; transformers'
GGUF loader has no entry for it and applies GPT-2's regex alone, which gives the same tokens on SmolLM2's
vocabulary, whose merges never join digits); tokens of type CONTROL become
special added tokens, USER_DEFINED ones plain added tokens. The chat template (``tokenizer.chat_template``)
and the special ids (``tokenizer.ggml.*_token_id``) go into tokenizer_config.json / generation_config.json.

Every problem is one ``ValueError`` line naming the file and the key or tensor: a truncated file, a
tensor type outside the list, a missing or mistyped metadata key (``edgeattn.convert.validate.HFConfig``
over the metadata, so the message names the GGUF key), a scaled RoPE.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgeattn._deps import require
from edgeattn.artifact.sources import GGUF_MAGIC, is_gguf
from edgeattn.convert.hf import Weights
from edgeattn.convert.validate import HFConfig, checked_float32, show

ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)

# GGUF tensor names -> transformers' (Llama); {i} is the block.
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# llama.cpp's pre-tokenizer regexes by tokenizer.ggml.pre (llama-vocab.cpp), as `tokenizers` pre-tokenizers:
# "gpt2": GPT-2's regex (ByteLevel's own); "digits": every digit alone first (llama.cpp's "\p{N}"), then
# GPT-2's regex (starcoder, smollm...); "llama3": the Llama 3 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
}


def _reader(path: Path):
    gguf = require("gguf")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct/numpy errors, KeyError... on bad bytes
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "GGMLQuantizationType" in text:
            text = f"a tensor has an unknown type ({text}); supported: {', '.join(SUPPORTED_TYPES)}"
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {text}") from e


def _metadata(reader, path: Path) -> dict:
    """The key-value metadata as Python values (arrays as lists)."""
    meta = {}
    for key, f in reader.fields.items():
        try:
            meta[key] = f.contents()
        except Exception as e:  # a field whose parts do not decode
            raise ValueError(f"{path}: metadata key {key} is not readable: {e}") from e
    return meta


def _unpermute(w, n_head: int):
    """llama.cpp's per-head row permutation of attn_q / attn_k (interleaved RoPE) undone: rows
    [n_head, Dh/2, 2] -> [n_head, 2, Dh/2] (convert_hf_to_gguf.py's ``permute`` inverted)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights(Weights):
    """The file's tensors under transformers' names, dequantized to float32 when taken."""

    def __init__(self, reader, path: Path, n_head: int, n_kv_head: int, n_layers: int):
        torch = require("torch")
        self.torch, self.path, self.used = torch, path, set()
        self.tensors, self.gguf_names = {}, {}
        names = {}
        for pattern, hf in TENSOR_NAMES.items():
            if "{i}" in pattern:
                for i in range(n_layers):
                    names[pattern.format(i=i)] = hf.format(i=i)
            else:
                names[pattern] = hf
        self.expected = {hf: g for g, hf in names.items()}  # for messages: the GGUF name of a missing tensor
        self.heads = {}
        for t in reader.tensors:
            hf = names.get(t.name, t.name)  # an unknown tensor keeps its GGUF name (refused as unused)
            if hf in self.tensors:
                raise ValueError(f"{path}: tensor {t.name} appears twice")
            self.tensors[hf], self.gguf_names[hf] = t, t.name
            if t.name.endswith("attn_q.weight"):
                self.heads[hf] = n_head
            elif t.name.endswith("attn_k.weight"):
                self.heads[hf] = n_kv_head

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))  # ggml lists the fastest dim first

    def take(self, name: str, shape: tuple[int, ...], field: str = ""):
        gguf = require("gguf")
        if name not in self.tensors:
            gname = self.expected.get(name, name)
            raise ValueError(f"{self.path}: tensor {gname} is missing")
        t, gname = self.tensors[name], self.gguf_names[name]
        if self.shape(name) != tuple(shape):
            why = f" (from {field})" if field else ""
            raise ValueError(
                f"{self.path}: the metadata disagrees with the weights: tensor {gname} has shape "
                f"{list(self.shape(name))}, the metadata implies {list(shape)}{why}"
            )
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(
                f"{self.path}: tensor {gname} is stored as {kind}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        except Exception as e:
            raise ValueError(f"{self.path}: tensor {gname} ({kind}) does not dequantize: {e}") from e
        if name in self.heads:
            w = _unpermute(w, self.heads[name])
        self.used.add(name)
        return checked_float32(gname, self.torch.from_numpy(w.copy()))


class GGUFModel:
    """A GGUF file's config (config.json's dict), weights and tokenizer, read with the ``gguf`` library."""

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
        if not is_gguf(path):
            raise ValueError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC.decode()})")
        reader = _reader(path)
        self.meta = meta = _metadata(reader, path)
        m = HFConfig(meta, file=path.name)
        arch = m.str("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"cannot import {path.name}: general.architecture = {arch!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self.config = self._config(m, arch, reader)
        c = self.config
        self.weights = GGUFWeights(
            reader, path, c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
        )

    def _config(self, m: HFConfig, arch: str, reader) -> dict:
        """config.json of transformers' LlamaConfig, from the ``{arch}.*`` and ``tokenizer.*`` keys."""
        a = f"{arch}."
        for key in ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length"):
            value = m.raw(a + key)
            if value is not None and value not in ("none", 1, 1.0):
                raise ValueError(
                    f"cannot import: GGUF key {a + key} = {show(value)}: only plain RoPE is implemented "
                    "(llama.cpp would scale it)"
                )
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):
            raise ValueError(
                "cannot import: tensor rope_freqs.weight (Llama 3's scaled RoPE frequencies): only plain "
                "RoPE is implemented"
            )
        D, H = m.int(a + "embedding_length"), m.int(a + "attention.head_count")
        Hkv = m.int(a + "attention.head_count_kv", H)
        if D % H and a + "attention.key_length" not in m:
            raise m.error(a + "embedding_length", f"a multiple of {a}attention.head_count ({H})", D)
        Dh = m.int(a + "attention.key_length", D // H)
        if m.int(a + "attention.value_length", Dh) != Dh:
            raise m.error(
                a + "attention.value_length",
                f"{a}attention.key_length ({Dh})",
                m.raw(a + "attention.value_length"),
            )
        rot = m.int(a + "rope.dimension_count", Dh)
        if rot != Dh:
            raise ValueError(
                f"cannot import: GGUF key {a}rope.dimension_count = {rot}: only RoPE over the whole head "
                f"({Dh} dims) is implemented for {arch}"
            )
        tokens = m.list("tokenizer.ggml.tokens")
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab = m.int(a + "vocab_size", int(embd.shape[1]) if embd is not None else len(tokens))
        config = {
            "model_type": arch,
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": D,
            "intermediate_size": m.int(a + "feed_forward_length"),
            "num_hidden_layers": m.int(a + "block_count"),
            "num_attention_heads": H,
            "num_key_value_heads": Hkv,
            "head_dim": Dh,
            "rms_norm_eps": m.float(a + "attention.layer_norm_rms_epsilon", positive=True),
            "rope_theta": m.float(a + "rope.freq_base", 10000.0, positive=True),
            "max_position_embeddings": m.int(a + "context_length"),
            "vocab_size": vocab,
            "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
            "hidden_act": "silu",
        }
        for key, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
            v = m.int(f"tokenizer.ggml.{key}_token_id", None, min=0)
            if v is not None:
                if v >= len(tokens):
                    raise m.error(f"tokenizer.ggml.{key}_token_id", f"a token id in [0, {len(tokens)})", v)
                config[f"{hf}_token_id"] = v
        return config

    def write_tokenizer(self, directory: Path) -> None:
        """tokenizer.json, tokenizer_config.json (chat template, special tokens) and generation_config.json
        (special ids) into ``directory``."""
        m = HFConfig(self.meta, file=self.path.name)
        kind = m.str("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"cannot import {self.path.name}: tokenizer.ggml.model = {kind!r} is not supported; "
                "supported: gpt2 (byte-level BPE)"
            )
        tokens = [str(t) for t in m.list("tokenizer.ggml.tokens")]
        merges = m.list("tokenizer.ggml.merges")
        types = m.list("tokenizer.ggml.token_type", [1] * len(tokens))
        if len(types) != len(tokens):
            raise m.error(
                "tokenizer.ggml.token_type", f"a list of {len(tokens)} token types", f"{len(types)} types"
            )
        pre = m.str("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"cannot import {self.path.name}: tokenizer.ggml.pre = {pre!r} is not supported; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        tok = _byte_level_bpe(tokens, merges, types, PRE_TOKENIZERS[pre], self.path.name)
        if m.bool("tokenizer.ggml.add_bos_token", False) and "bos_token_id" in self.config:
            from tokenizers import processors

            bos = tokens[self.config["bos_token_id"]]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.config["bos_token_id"])],
            )
        directory = Path(directory)
        tok.save(str(directory / "tokenizer.json"))
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
            v = self.meta.get(f"tokenizer.ggml.{key}_token_id")
            if isinstance(v, int) and 0 <= v < len(tokens):
                tcfg[f"{hf}_token"] = tokens[v]
        template = m.str("tokenizer.chat_template", None)
        if template is not None:
            tcfg["chat_template"] = template
        (directory / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
        gen = {
            k: self.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in self.config
        }
        (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))


def _byte_level_bpe(tokens: list[str], merges: list, types: list, pre: str, name: str):
    """A ``tokenizers`` byte-level BPE over the GGUF's vocabulary and merges."""
    require("tokenizers")
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token string: the first id, as llama.cpp's lookup finds it
    pairs = []
    for merge in merges:
        parts = str(merge).split(" ")
        if len(parts) != 2:
            raise ValueError(f"{name}: tokenizer.ggml.merges holds {show(merge)}, not two tokens apart")
        pairs.append((parts[0], parts[1]))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    except Exception as e:
        raise ValueError(f"{name}: the tokenizer's vocabulary and merges do not form a BPE: {e}") from e
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama3")
    if pre == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "llama3":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_CONTROL
    ]
    plain = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types)
        if k == TOKEN_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"{name}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens after adding its "
            f"control tokens, not the {len(tokens)} of tokenizer.ggml.tokens"
        )
    return tok
