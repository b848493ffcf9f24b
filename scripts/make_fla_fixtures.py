"""Regenerate tests/fixtures/fla/<model_type>/: tiny random models built with fla's own classes
(flash-linear-attention 0.6), saved with ``save_pretrained``, and fla's logits on fixed input ids.

fla's layers call Triton, which runs on this CPU only in its interpreter: TRITON_INTERPRET=1 is set before
Triton is imported and every ``triton.autotune`` keeps its first config (the autotuner benchmarks through a
GPU driver). The logits are fla's forward, the reference of tests/test_import_fla.py.

    PYTHONPATH=$PWD .venv/bin/python scripts/make_fla_fixtures.py [gla gated_deltanet ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "fla"
T = 80  # > 64: fla's layers run their chunk kernels (fused_recurrent for T <= 64)
N_GREEDY = 30

# model_type -> tiny config keyword arguments (the rest are fla's defaults)
CONFIGS = {
    "gla": dict(
        hidden_size=32,
        num_heads=2,
        expand_k=0.5,
        expand_v=1.0,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    ),
    "delta_net": dict(
        attn_mode="fused_recurrent",  # fla's chunk DeltaNet refuses float32
        hidden_size=32,
        num_heads=2,
        expand_k=0.5,
        expand_v=1.0,
        conv_size=4,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    ),
    "gated_deltanet": dict(
        hidden_size=32,
        head_dim=8,
        num_heads=2,
        num_v_heads=4,
        expand_v=2.0,
        conv_size=4,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    ),
    "retnet": dict(  # fla's rotary embeddings on q/k; grouped k/v heads
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        expand_k=1.0,
        expand_v=2.0,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    ),
    "retnet_relu": dict(  # a feature map, no output gate
        model_type="retnet",
        hidden_size=32,
        num_heads=2,
        expand_k=0.5,
        expand_v=1.0,
        feature_map="relu",
        use_output_gate=False,
        hidden_ratio=2,
        num_hidden_layers=2,
        vocab_size=64,
    ),
    "linear_attn": dict(  # fla's default feature map (elementwise_product, learned); grouped k/v heads
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        expand_k=1.0,
        expand_v=1.0,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    ),
    "linear_attn_elu": dict(  # elu + 1 features, q/k sum norms, the normalized form
        model_type="linear_attn",
        hidden_size=32,
        num_heads=2,
        expand_k=0.5,
        expand_v=1.0,
        feature_map="elu",
        norm_q=True,
        norm_k=True,
        norm_feature_map=True,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    ),
}


def patch_triton_for_cpu() -> None:
    """Run Triton kernels in the interpreter, each autotuned kernel with its first config. Call before
    anything imports triton or fla."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.autotuner as autotuner

    if getattr(autotuner.Autotuner, "_edgeattn_first_config", False):
        return
    init = autotuner.Autotuner.__init__

    def first_config(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.configs = self.configs[:1]

    autotuner.Autotuner.__init__ = first_config
    autotuner.Autotuner._edgeattn_first_config = True
    _loop_variables_as_tensors()


def _loop_variables_as_tensors() -> None:
    """The interpreter runs ``for i in range(n)`` with Python ints, but fla's kernels call ``i.to(...)``
    (compiled Triton makes loop variables tensors): make the variable of every ``range`` / ``tl.range`` loop
    a tensor, as the interpreter does for assignments."""
    import ast

    from triton.runtime.interpreter import ASTTransformer

    def visit_For(self, node):
        node = self.generic_visit(node)
        it = node.iter
        name = it.func.attr if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) else None
        name = it.func.id if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) else name
        if name == "range" and isinstance(node.target, ast.Name):
            to_tensor = ast.Attribute(
                value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor", ctx=ast.Load()
            )
            wrap = ast.Assign(
                targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                value=ast.Call(
                    func=to_tensor,
                    args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                    keywords=[],
                ),
            )
            node.body.insert(0, ast.copy_location(wrap, node))
        return node

    ASTTransformer.visit_For = visit_For


def build(name: str, seed: int = 0):
    """A tiny random fla model (fp32, eval), its norm weights and gate biases perturbed so they matter.
    ``name`` is a key of CONFIGS (a model_type, or a variant that names its model_type)."""
    patch_triton_for_cpu()
    import fla.models  # noqa: F401  (registers fla's model types with transformers' Auto classes)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(CONFIGS[name])
    cfg = AutoConfig.for_model(kwargs.pop("model_type", name), **kwargs)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 2 and "embeddings" not in name:  # larger weights: logits that differ
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    return model


def fla_logits(model, ids):
    """fla's forward over ids [1, T] -> float32 logits [T, vocab] (numpy)."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)[None], use_cache=False).logits[0].float().numpy()


def fla_greedy(model, prompt, n: int) -> list[int]:
    """n greedy tokens, each from fla's full forward over the sequence so far (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(fla_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]


def make(name: str, out: Path = OUT) -> Path:
    import numpy as np

    model = build(name)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=T).astype(np.int64)
    logits = fla_logits(model, ids)
    greedy = fla_greedy(model, ids[:8], N_GREEDY)
    np.savez_compressed(d / "reference.npz", ids=ids, logits=logits, greedy=np.array(greedy, np.int64))
    (d / "generation_config.json").unlink(missing_ok=True)
    return d


def main(argv: list[str]) -> None:
    for name in argv or sorted(CONFIGS):
        d = make(name)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(json.dumps({"fixture": name, "dir": str(d), "bytes": size}))


if __name__ == "__main__":
    main(sys.argv[1:])
