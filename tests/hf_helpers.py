"""Tiny Hugging Face models built with transformers' own classes (the independent reference of the
import tests), a byte-level BPE tokenizer trained with `tokenizers` on stdlib text, and comparisons."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import numpy as np

# The PyTorch paths of transformers' hub-kernel functions: fla-core is installed here, and its Triton
# kernels cannot run on this CPU, so transformers would pick them. The reference is transformers' own code.
_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def import_export_cli():
    """`edgeattn import` and `edgeattn export` on one Typer app, run in process: ``invoke(*args)`` returns
    Click's result (exit_code, output)."""
    import typer
    from typer.testing import CliRunner

    from edgeattn.cli import export, import_

    app, runner = typer.Typer(), CliRunner()
    for mod in (import_, export):
        mod.register(app)
    return lambda *args: runner.invoke(app, [str(a) for a in args])


def torch_only(module) -> None:
    for name in _KERNEL_FUNCS:
        if hasattr(module, name):
            setattr(module, name, inspect.unwrap(getattr(module, name)))


def perturb(model, std: float = 0.3, seed: int = 0) -> None:
    """Random norm weights and gate parameters, so that the zero-centred norms and the gates matter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn(p.shape, generator=g) * std)


QWEN_TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def _tiny(modeling, model_cls, config_cls, defaults: dict, seed: int, kw: dict):
    """A tiny transformers model (fp32, eval, PyTorch paths only), its weights perturbed."""
    import torch

    torch_only(modeling)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**defaults, **kw})).eval()
    perturb(model, seed=seed)
    return model


def qwen3_5_text(seed: int = 0, **kw):
    """A tiny transformers Qwen3_5ForCausalLM."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _tiny(modeling, Qwen3_5ForCausalLM, Qwen3_5TextConfig, QWEN_TINY, seed, kw)


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=0, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def stdlib_text(n_bytes: int = 6000) -> str:
    with open(os.__file__, encoding="utf-8") as f:
        return f.read(n_bytes)


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(out: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer trained on a few KB of the standard library, saved as a Hugging Face
    model directory's tokenizer.json + tokenizer_config.json (with a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([stdlib_text()], trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def llama(config: dict, seed: int = 0, **kw):
    """A tiny transformers LlamaForCausalLM of ``config`` (a LlamaConfig's keywords; ``kw`` override them)."""
    import transformers.models.llama.modeling_llama as modeling
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(modeling, LlamaForCausalLM, LlamaConfig, config, seed, kw)


MAMBA2_TINY = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=8,
    expand=2,
    state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    tie_word_embeddings=False,
)


def mamba2(seed: int = 0, **kw):
    """A tiny transformers Mamba2ForCausalLM."""
    import transformers.models.mamba2.modeling_mamba2 as modeling
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return _tiny(modeling, Mamba2ForCausalLM, Mamba2Config, MAMBA2_TINY, seed, kw)


RWKV_TINY = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    context_length=1024,
    rescale_every=6,
    tie_word_embeddings=False,
)


def rwkv(seed: int = 0, **kw):
    """A tiny transformers RwkvForCausalLM (fp32, eval), its time mixing parameters randomised."""
    import torch
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(seed)
    model = RwkvForCausalLM(RwkvConfig(**{**RWKV_TINY, **kw})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "time_decay" in name or "time_first" in name or "ln" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
            elif "time_mix" in name:
                p.copy_(torch.rand(p.shape, generator=g))
            elif p.dim() == 2:  # transformers' init leaves the generated tokens all alike
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model
