"""edgeattn against onnxruntime-genai 0.18 on this CPU: decode, prefill and memory of equal-size models.

What it builds (random weights: speed and memory do not depend on them; vocabulary 256, d_model 768,
12 layers, 12 heads, about 92.5M parameters; ``--quick``: d_model 128, 2 layers, 2 heads):
- edgeattn ``gla``, ``gated_deltanet`` (the all-Gated-DeltaNet peer's architecture) and the ``softmax``
  KV-cache baseline (their default MLP width: softmax has 85.2M parameters at full size): ``EdgeLM``
  exported with ``export_model`` (fp32, onnxruntime target: the recurrent models as one graph for step
  and prefill, no checkpoint), run by edgeattn's ONNX Runtime session; the softmax baseline there is GroupQueryAttention over a preallocated KV buffer of max_length (as genai's
  Llama); ``edgeattn-softmax-growing`` is the portable target's growing cache (the form before);
- the same sizes as ``transformers`` configs (random init, ``save_pretrained``) built by onnxruntime-genai's
  own builder (``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e cpu``) and run by its
  Generator: Llama (GQA op, KV buffer shared between past and present), Qwen3.5 with every layer linear
  (Gated DeltaNet through ONNX Runtime's LinearAttention op) and Qwen3.5 with 3 Gated DeltaNet : 1
  attention. Each peer's MLP width is chosen so that its parameter count is closest to edgeattn's gla.

What it measures, each (model, threads) in a fresh worker process, the workers interleaved (repeat r
runs every configuration once, in an order rotated by r), median over ``--repeats``:
- decode ms/token (median of ``--steps`` single steps) at each context. How the context is reached:
  edgeattn sessions get a state of the right size set directly (``set_state``: random values; gla's
  state does not grow, softmax's KV cache holds c tokens); onnxruntime-genai has no API to set its
  cache, so its Generator prefills c random tokens through ``append_tokens`` in chunks of 1024;
- resident memory of the process (psutil RSS) after the steps at each context;
- prefill tokens/s: 1024 random tokens from an empty state (edgeattn: prefill.onnx in chunks; genai: one
  ``append_tokens`` call).
The growing cache at 16384 tokens needs ~10 GB: it is measured only up to ``--softmax-max-context``
(default 4096) unless asked.
The same per-runtime pieces (``EdgeattnRunner``, ``GenaiRunner``) also run in long-lived processes driven
by line commands (``serve``, ``ServedWorker``); ``measure_pair`` measures two of them alternately in small
blocks (benchmarks/imported.py ``--paired``).

    python benchmarks/peers.py [--threads 1,2] [--repeats 3] [--contexts 128,4096,16384] [--workdir DIR]
    python benchmarks/peers.py --quick          # tiny models: proves the harness (tests/test_peers.py)
    python benchmarks/peers.py --workdir DIR --report   # the table of the runs logged in DIR/runs.jsonl

The Qwen3.5 models carry the published rope layout (``qwen35_rope``: M-RoPE sections); without it
onnxruntime-genai 0.18's build of the 3:1 hybrid failed on its first step (RotaryEmbedding: 'position_ids'
has 3 dimensions).

Prints a markdown table, ratios against edgeattn gla, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

FULL = dict(d_model=768, n_layers=12, n_heads=12)
QUICK = dict(d_model=128, n_layers=2, n_heads=2)
VOCAB = 256
MODELS = (
    "edgeattn-gla",
    "edgeattn-gated_deltanet",
    "edgeattn-softmax",
    "edgeattn-softmax-growing",
    "genai-edgeattn-gla",
    "genai-llama",
    "genai-qwen35-gdn",
    "genai-qwen35-hybrid",
)
LABELS = {
    "edgeattn-gla": "edgeattn `gla` (ONNX Runtime session)",
    "edgeattn-gated_deltanet": "edgeattn `gated_deltanet` (ONNX Runtime session)",
    "edgeattn-softmax": "edgeattn `softmax` baseline (GQA op, preallocated KV buffer)",
    "edgeattn-softmax-growing": "edgeattn `softmax`, growing KV cache (portable form)",
    "genai-edgeattn-gla": "edgeattn `gla` exported with --genai, run by onnxruntime-genai's Generator",
    "genai-llama": "onnxruntime-genai, Llama (GQA op, preallocated KV buffer)",
    "genai-qwen35-gdn": "onnxruntime-genai, Qwen3.5 layout, all layers Gated DeltaNet",
    "genai-qwen35-hybrid": "onnxruntime-genai, Qwen3.5 3 GDN : 1 attention",
}
MiB = 2**20


# ---------------------------------------------------------------------------------------------------------
# building the models
# ---------------------------------------------------------------------------------------------------------


def build_edgeattn(
    root: Path, size: dict, mixer: str, max_len: int, target: str = "onnxruntime", genai: bool = False
) -> tuple[Path, int]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    model = EdgeLM(EdgeConfig(vocab_size=VOCAB, mixer=mixer, max_seq_len=max_len, **size))
    params = sum(p.numel() for p in model.parameters())
    ckpt = model.save(root / f"{mixer}_ckpt")
    name = ("genai-" if genai else "") + f"edgeattn-{mixer}" + ("-growing" if target == "portable" else "")
    art = export_model(ckpt, root / name, target=target, include_checkpoint=False, force=True, genai=genai)
    if genai:  # greedy, and room for the longest context
        conf = json.loads((art / "genai_config.json").read_text())
        conf["search"].update(max_length=max_len, do_sample=False, num_beams=1)
        (art / "genai_config.json").write_text(json.dumps(conf, indent=2))
    return art, params


def _hf_config(kind: str, size: dict, intermediate: int, max_len: int):
    d, L, H = size["d_model"], size["n_layers"], size["n_heads"]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=d,
        intermediate_size=intermediate,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=H,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    from transformers import Qwen3_5TextConfig

    if kind == "qwen35-gdn":
        layer_types = ["linear_attention"] * L
    else:  # 3 Gated DeltaNet : 1 full attention, as Qwen3.5 itself
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)]
    return Qwen3_5TextConfig(
        **common,
        rope_parameters=qwen35_rope(d // H),
        head_dim=d // H,
        layer_types=layer_types,
        linear_num_key_heads=H,
        linear_num_value_heads=H,
        linear_key_head_dim=d // H,
        linear_value_head_dim=d // H,
        linear_conv_kernel_dim=4,
    )


def qwen35_rope(head_dim: int, theta: float = 10000.0) -> dict:
    """Qwen3.5's published rope layout for a head size: partial rotary 0.25, interleaved M-RoPE sections
    over its rotary pairs as the published configs split them ([11, 11, 10] for 32 pairs). Without the
    sections onnxruntime-genai's builder emits RotaryEmbedding nodes that its Generator feeds 3-D
    position ids (the first step fails); with them it emits MRotaryEmbedding and runs."""
    p = int(head_dim * 0.25) // 2
    sections = [p // 3 + (p % 3 > 0), p // 3 + (p % 3 > 1), p // 3]
    return {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": 0.25,
        "mrope_section": sections,
        "mrope_interleaved": True,
    }


def byte_tokenizer():
    """A byte-level tokenizer of exactly 256 tokens (the byte-level BPE alphabet, no merges), fast format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(alphabet)
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=order[0], eos_token=order[1], pad_token=order[1]
    )


def _hf_params(kind: str, size: dict, intermediate: int, max_len: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(kind, size, intermediate, max_len))
    return sum(p.numel() for p in model.parameters())


def save_hf(model, hf: Path, qwen35: bool = False) -> Path:
    """``save_pretrained`` plus the byte-level tokenizer (the builder copies one into its output); a Qwen3.5
    model is renamed ``Qwen3_5ForConditionalGeneration``, the name genai's builder knows it by."""
    model.save_pretrained(hf)
    byte_tokenizer().save_pretrained(hf)
    if qwen35:  # save_pretrained writes the class's own name back
        data = json.loads((hf / "config.json").read_text())
        data["architectures"] = ["Qwen3_5ForConditionalGeneration"]
        (hf / "config.json").write_text(json.dumps(data))
    return hf


def genai_build(hf: Path, out: Path, max_len: int, cache: Path, precision: str = "fp32") -> Path:
    """onnxruntime-genai's own builder (``-e cpu -p PRECISION``) on a transformers directory; the search made
    greedy and long enough for ``max_len`` tokens."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(cache)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"onnxruntime-genai's builder failed for {hf.name}: {tail[0]}")
    conf = json.loads((out / "genai_config.json").read_text())
    conf["search"].update(max_length=max_len, do_sample=False, num_beams=1)
    conf["model"]["context_length"] = max(int(conf["model"].get("context_length", 0)), max_len)
    (out / "genai_config.json").write_text(json.dumps(conf, indent=2))
    return out


def build_genai(root: Path, kind: str, size: dict, target_params: int, max_len: int) -> tuple[Path, int]:
    """A transformers model of ~target_params (MLP width searched in steps of 32), built by genai's builder."""
    import torch
    from transformers import AutoModelForCausalLM

    base = _hf_params(kind, size, 32, max_len)
    per_unit = (_hf_params(kind, size, 64, max_len) - base) / 32  # parameters per unit of MLP width
    inter = max(32, round((32 + (target_params - base) / per_unit) / 32) * 32)
    cfg = _hf_config(kind, size, inter, max_len)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    hf = save_hf(model, root / f"hf-{kind}", qwen35=kind != "llama")
    return genai_build(hf, root / f"genai-{kind}", max_len, root / "cache"), params


def build_all(root: Path, models: list[str], size: dict, max_len: int) -> dict[str, dict]:
    built = {}
    gla, gla_params = build_edgeattn(root, size, "gla", max_len)
    built["edgeattn-gla"] = {"path": str(gla), "params": gla_params}
    for name in models:
        if name in built:
            continue
        try:
            if name in ("edgeattn-softmax", "edgeattn-gated_deltanet"):
                path, params = build_edgeattn(root, size, name.removeprefix("edgeattn-"), max_len)
            elif name == "genai-edgeattn-gla":
                path, params = build_edgeattn(root, size, "gla", max_len, genai=True)
            elif name == "edgeattn-softmax-growing":
                path, params = build_edgeattn(root, size, "softmax", max_len, target="portable")
            else:
                path, params = build_genai(root, name.removeprefix("genai-"), size, gla_params, max_len)
            built[name] = {"path": str(path), "params": params}
        except Exception as e:  # one model that cannot be built is reported, not fatal
            built[name] = {"error": str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}
    return built


# ---------------------------------------------------------------------------------------------------------
# the worker: one model, one thread count, one process
# ---------------------------------------------------------------------------------------------------------


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class EdgeattnRunner:
    """One edgeattn model in this process: reach a context, time single steps, time a prefill."""

    def __init__(self, path: str, threads: int):
        import numpy as np

        from edgeattn.runtimes import open_session

        self.np = np
        self.sess = open_session(path, threads=threads)
        self.rng = np.random.default_rng(0)

    def context(self, c: int) -> None:
        """A state of c tokens set directly: the KV cache's dynamic length, or the fixed recurrent size."""
        np, rng = self.np, self.rng
        state = {}
        for e in self.sess.manifest.state:
            shape = [c if isinstance(d, str) else d for d in e.shape]
            if e.name == "position":  # a preallocated KV buffer's fill level
                state[e.input] = np.full(shape, c, np.float32)
            elif e.shared:  # a preallocated KV buffer [B, H, L, D]: its first c slots hold tokens
                state[e.input] = np.zeros(shape, np.float32)
                state[e.input][:, :, :c] = rng.standard_normal((*shape[:2], c, shape[3])) * 0.1
            else:
                state[e.input] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        self.sess.set_state(state, position=c)

    def step(self, token: int) -> float:
        """One decode step of ``token``; its seconds."""
        ids = self.np.array([[token]], dtype=self.np.int64)
        t = time.perf_counter()
        self.sess.step(ids)
        return time.perf_counter() - t

    def prefill(self, n: int) -> float:
        """Tokens/s of one prefill of n random tokens from an empty state."""
        ids = self.rng.integers(0, VOCAB, (1, n), dtype=self.np.int64)
        self.sess.reset()
        t = time.perf_counter()
        self.sess.prefill(ids)
        return n / (time.perf_counter() - t)


class GenaiRunner:
    """One onnxruntime-genai model in this process: its Generator has no API to set its cache, so a context
    is reached by prefilling random tokens through ``append_tokens`` in chunks of 1024."""

    def __init__(self, path: str, max_len: int):
        import numpy as np
        import onnxruntime_genai as og

        self.np, self.og = np, og
        self.model = og.Model(path)  # CPU: the provider the builder wrote into genai_config.json
        self.rng = np.random.default_rng(0)
        self.max_len = max_len
        self.gen, self.pos = None, 0

    def _generator(self, length: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=length, do_sample=False)
        return self.og.Generator(self.model, params)

    def context(self, c: int) -> None:
        """Prefill random tokens up to c (a fresh Generator when already past c)."""
        if self.gen is None or self.pos > c:
            self.gen = None  # its KV buffer freed before the next one is allocated
            self.gen, self.pos = self._generator(self.max_len), 0
        while self.pos < c:
            n = min(1024, c - self.pos)
            self.gen.append_tokens(self.rng.integers(2, VOCAB, n, dtype=self.np.int32))
            self.pos += n

    def step(self, token: int = 0) -> float:
        """One decode step (the Generator picks its token); its seconds."""
        t = time.perf_counter()
        self.gen.generate_next_token()
        self.pos += 1
        return time.perf_counter() - t

    def prefill(self, n: int) -> float:
        """Tokens/s of one prefill of n random tokens by a fresh Generator (the context's one dropped)."""
        self.gen = None
        gen = self._generator(n + 8)
        ids = self.rng.integers(2, VOCAB, n, dtype=self.np.int32)
        t = time.perf_counter()
        gen.append_tokens(ids)
        return n / (time.perf_counter() - t)


class LlamaRunner:
    """One llama.cpp GGUF model in this process, through llama-cpp-python's low-level bindings (its own
    interpreter: ``cfg["python"]``): f16 KV cache of ``max_len`` cells, logits of the last token of each
    call only (llama.cpp's default). Like genai it has no API to set its cache, so a context is reached by
    decoding random tokens in calls of 1024."""

    def __init__(self, path: str, threads: int, max_len: int):
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = max_len, 1024, threads, threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.batch = lc.llama_batch_init(1024, 0, 1)
        self.rng = np.random.default_rng(0)
        self.pos = 0

    def _decode(self, tokens) -> None:
        b, n = self.batch, len(tokens)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), self.pos + i, 1, i == n - 1
            b.seq_id[i][0] = 0
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError(f"llama_decode failed at position {self.pos}")
        self.pos += n

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self.pos = 0

    def context(self, c: int) -> None:
        if self.pos > c:
            self._clear()
        while self.pos < c:
            self._decode(self.rng.integers(2, VOCAB, min(1024, c - self.pos)))

    def step(self, token: int) -> float:
        t = time.perf_counter()
        self._decode([token])
        return time.perf_counter() - t

    def prefill(self, n: int) -> float:
        self._clear()
        ids = self.rng.integers(2, VOCAB, n)
        t = time.perf_counter()
        for c in range(0, n, 1024):
            self._decode(ids[c : c + 1024])
        return n / (time.perf_counter() - t)


def _cpu_ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process) from /proc: their difference over an
    interval is the CPU that other processes took (0, 0 where /proc is missing)."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle + iowait
    return sum(cpu) - idle, int(own[11]) + int(own[12])  # utime + stime


def disturbance(before: tuple[int, int], after: tuple[int, int], seconds: float) -> float:
    """Other processes' CPU during an interval, in cores (0 .. the machine's cores)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, other / hz / max(seconds, 1e-9))


def _kernels(runner) -> dict:
    """Which GroupQueryAttention and MatMulNBits kernels an edgeattn session ran ({} for the peers)."""
    sess = getattr(runner, "sess", None)
    return {k: getattr(sess, k) for k in ("attention", "matmul") if hasattr(sess, k)}


def _measure(runner, cfg: dict) -> dict:
    """The one-shot worker's measurement: each context, one untimed step, the median of ``steps``, RSS; then
    one prefill of each size in ``cfg["prefill"]`` (an int or a list) and the RSS after the last (its
    activations stay in ONNX Runtime's arena): ``prefill_tps`` is the first size's, ``prefills`` every
    size's. With each figure the disturbance: other processes' CPU in cores while it was timed
    (``disturbance``)."""
    out = {"rss_load": _rss(), "contexts": {}}
    out |= _kernels(runner)
    for c in cfg["contexts"]:
        runner.context(c)
        runner.step(3)  # untimed: first touch after the load
        t, ticks = time.perf_counter(), _cpu_ticks()
        times = [runner.step(i % VOCAB) for i in range(cfg["steps"])]
        other = disturbance(ticks, _cpu_ticks(), time.perf_counter() - t)
        out["contexts"][str(c)] = {"ms": 1e3 * statistics.median(times), "rss": _rss(), "other": other}
    sizes = cfg["prefill"] if isinstance(cfg["prefill"], list) else [cfg["prefill"]]
    out["prefills"] = {}
    for n in sizes:
        t, ticks = time.perf_counter(), _cpu_ticks()
        tps = runner.prefill(n)
        other = disturbance(ticks, _cpu_ticks(), time.perf_counter() - t)
        out["prefills"][str(n)] = {"tps": tps, "other": other, "rss": _rss()}
    first = out["prefills"][str(sizes[0])]
    out["prefill_tps"] = first["tps"]
    out["prefill_other"] = max(v["other"] for v in out["prefills"].values())
    out["rss_prefill"] = _rss()
    return out


def _runner(cfg: dict):
    """The runner of ``cfg["model"]``, its thread count applied (OMP_NUM_THREADS; genai reads its session
    options from genai_config.json, so the thread count is written there)."""
    if cfg["threads"]:
        os.environ["OMP_NUM_THREADS"] = str(cfg["threads"])
    if cfg["model"].startswith("llama-"):
        return LlamaRunner(
            cfg["path"], cfg["threads"], cfg.get("max_len") or max(cfg["contexts"]) + cfg["steps"] + 8
        )
    if not cfg["model"].startswith("genai-"):
        return EdgeattnRunner(cfg["path"], cfg["threads"])
    conf_path = Path(cfg["path"]) / "genai_config.json"
    conf = json.loads(conf_path.read_text())
    opts = conf["model"]["decoder"].setdefault("session_options", {})
    if opts.get("intra_op_num_threads") != cfg["threads"]:
        opts.update(intra_op_num_threads=cfg["threads"], inter_op_num_threads=1)
        conf_path.write_text(json.dumps(conf, indent=2))
    return GenaiRunner(cfg["path"], cfg.get("max_len") or max(cfg["contexts"]) + cfg["steps"] + 8)


def worker_edgeattn(cfg: dict) -> dict:
    return _measure(EdgeattnRunner(cfg["path"], cfg["threads"]), cfg)


def worker_genai(cfg: dict) -> dict:
    return _measure(GenaiRunner(cfg["path"], max(cfg["contexts"]) + cfg["steps"] + 8), cfg)


def worker_main(cfg: dict) -> None:
    print(json.dumps(_measure(_runner(cfg), cfg)))


# ---------------------------------------------------------------------------------------------------------
# the served worker: one model in a long-lived process, driven line by line (paired measurements)
# ---------------------------------------------------------------------------------------------------------


def serve(cfg: dict) -> None:
    """``--serve CFG``: load ``cfg``'s model, answer ``{"ready": true, "rss": ...}``, then one JSON line per
    command line read from stdin: ``{"cmd": "context", "c": C}`` (reach context C; ``{"c", "rss"}``),
    ``{"cmd": "steps", "n": N}`` (N single decode steps; ``{"ms": [...], "span": [start, end]}``: ms per
    step, the block's wall-clock times),
    ``{"cmd": "prefill", "n": N}`` (N random tokens from an empty state; ``{"tps", "rss"}``),
    ``{"cmd": "rss"}``, ``{"cmd": "quit"}``. A failed command answers ``{"error": ...}``. Between commands
    the process is blocked reading stdin: it leaves the cores to the other process of a pair."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the answers' channel
    os.dup2(2, 1)  # whatever the runtimes print goes to stderr, not into the answers

    def answer(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        runner = _runner(cfg)
    except Exception as e:
        answer({"error": f"load failed: {type(e).__name__}: {e}"})
        return
    ready = {"ready": True, "rss": _rss()}
    ready |= _kernels(runner)
    answer(ready)
    token = 0
    while line := sys.stdin.readline():
        try:
            cmd = json.loads(line)
            kind = cmd["cmd"]
            if kind == "quit":
                break
            if kind == "context":
                runner.context(int(cmd["c"]))
                answer({"c": int(cmd["c"]), "rss": _rss()})
            elif kind == "steps":
                ms, start = [], time.time()
                for _ in range(int(cmd["n"])):
                    ms.append(1e3 * runner.step(token % VOCAB))
                    token += 1
                answer({"ms": ms, "span": [start, time.time()]})
            elif kind == "prefill":
                answer({"tps": runner.prefill(int(cmd["n"])), "rss": _rss()})
            elif kind == "rss":
                answer({"rss": _rss()})
            else:
                answer({"error": f"unknown command {kind!r}"})
        except Exception as e:  # the coordinator decides; this process stays ready for the next line
            answer({"error": f"{type(e).__name__}: {e}"})


class WorkerError(RuntimeError):
    pass


class ServedWorker:
    """A ``serve`` process of ``cfg`` driven from here; every answer is waited for at most ``timeout`` s
    (a reader thread queues its lines), and a process that died or went silent raises ``WorkerError``."""

    def __init__(self, cfg: dict, timeout: float):
        self.name, self.timeout = cfg["model"], timeout
        self.stderr = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", json.dumps(cfg)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the process closed its stdout: it ended

    def _died(self) -> WorkerError:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        self.stderr.seek(0)
        tail = self.stderr.read().strip().splitlines()[-1:]
        return WorkerError(f"{self.name} ended (exit {rc})" + (f": {tail[0]}" if tail else ""))

    def answer(self) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.close(kill=True)
            raise WorkerError(f"{self.name}: no answer in {self.timeout:.0f} s") from None
        if line is None:
            raise self._died()
        ans = json.loads(line)
        if "error" in ans:
            raise WorkerError(f"{self.name}: {ans['error']}")
        return ans

    def ask(self, cmd: str, **args) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a broken pipe: it ended
            raise self._died() from None
        return self.answer()

    def close(self, kill: bool = False) -> None:
        """``quit``, or (``kill``, or no exit within 30 s) killed."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def measure_pair(
    cfgs: list[dict],
    contexts: list[int],
    rounds: int,
    block: int,
    prefill: int,
    timeout: float,
    first: int = 0,
    gap: float = 0.0,
) -> dict:
    """Two models (``cfgs``: a base and a peer) measured alternately in one pair of served processes.

    Both load at once. Per context: each reaches it (one after the other), one untimed step each, then
    ``rounds`` rounds of a block of ``block`` steps on each, the first of the pair alternating by round
    (``first``: which opens round 0), ``gap`` s of pause before every block (ONNX Runtime's threads spin
    for a few ms after a run). Per model: the median of all its steps and the RSS after them, as the
    one-shot worker's result (``summarize`` reads it); per context the paired ratio peer / base: the
    median over rounds of (peer block median / base block median), with its min and max. Prefill: three
    each, alternating (A, B, B, A, A, B), the median tokens/s and the RSS after the last, and
    ``prefill_ratio`` base / peer tokens/s. ``{"error"}`` when a worker fails, dies or falls silent for
    ``timeout`` s."""
    base, peer = (c["model"] for c in cfgs)
    workers = [ServedWorker(c, timeout) for c in cfgs]
    res: dict = {base: {"contexts": {}}, peer: {"contexts": {}}, "ratios": {}}
    try:
        for w in workers:
            ready = w.answer()
            res[w.name]["rss_load"] = ready["rss"]
            for k in ("attention", "matmul"):
                if k in ready:
                    res[w.name][k] = ready[k]
        for c in contexts:
            for w in workers:  # one after the other: a context's prefill (genai) takes the cores
                w.ask("context", c=c)
            for w in workers:
                w.ask("steps", n=1)  # untimed: first touch of the context
            blocks: list[list[list[float]]] = [[], []]
            spans: list[list[list[float]]] = [[], []]
            for r in range(rounds):
                for i in (0, 1) if (r + first) % 2 == 0 else (1, 0):
                    time.sleep(gap)
                    ans = workers[i].ask("steps", n=block)
                    blocks[i].append(ans["ms"])
                    spans[i].append(ans["span"])
            for i, w in enumerate(workers):
                steps = [ms for b in blocks[i] for ms in b]
                res[w.name]["contexts"][str(c)] = {
                    "ms": statistics.median(steps),
                    "rss": w.ask("rss")["rss"],
                    "blocks": blocks[i],
                    "spans": spans[i],
                }
            per_round = [statistics.median(p) / statistics.median(b) for b, p in zip(*blocks)]
            res["ratios"][str(c)] = {
                "ratio": statistics.median(per_round),
                "min": min(per_round),
                "max": max(per_round),
                "rounds": per_round,
            }
        tps: list[list[float]] = [[], []]
        for j in (0, 1, 1, 0, 0, 1):
            i = j ^ (first % 2)
            time.sleep(gap)
            ans = workers[i].ask("prefill", n=prefill)
            tps[i].append(ans["tps"])
            res[workers[i].name]["rss_prefill"] = ans["rss"]
        for i, w in enumerate(workers):
            res[w.name]["prefill_tps"] = statistics.median(tps[i])
            res[w.name]["prefill_runs"] = tps[i]
        res["prefill_ratio"] = res[base]["prefill_tps"] / res[peer]["prefill_tps"]
    except (WorkerError, ValueError) as e:  # ValueError: an answer that is not JSON
        return {"error": str(e)}
    finally:
        for w in workers:
            w.close()
    return res


def run_worker(cfg: dict, timeout: float | None) -> dict:
    """One worker process for ``cfg`` (its interpreter ``cfg["python"]``, this one by default)."""
    cmd = [cfg.get("python") or sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    return run_json(cmd, timeout)


def run_json(cmd: list[str], timeout: float | None) -> dict:
    """Run ``cmd``; its last stdout line as JSON, or ``{"error": ...}`` (its last line of output, or why)."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if res.returncode != 0:
        lines = (res.stderr or res.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_interleaved(configs: list[dict], repeats: int, timeout: float, log: Path, runs: dict) -> dict:
    """Every configuration once per repeat, the order rotated by the repeat; each result appended to
    ``log`` (JSON lines) as it comes, so a cut-short run can still be reported; ``runs[key]`` collects them."""
    # imported here: the workers may run in an interpreter without edgeattn
    from edgeattn.bench.machine import with_cpu

    for r in range(repeats):
        for cfg in configs[r % len(configs) :] + configs[: r % len(configs)]:
            key = f"{cfg['model']}@{cfg['threads']}"
            res = run_worker(cfg, timeout)
            runs.setdefault(key, []).append(res)
            with open(log, "a") as f:
                f.write(json.dumps(with_cpu({"key": key, "cfg": cfg, "result": res})) + "\n")
            status = res.get("error") or " ".join(
                f"@{c} {v['ms']:.2f} ms" for c, v in res["contexts"].items()
            )
            print(f"[repeat {r + 1}/{repeats}] {key}: {status}", file=sys.stderr, flush=True)
    return runs


def read_log(log: Path) -> dict:
    """The runs logged by ``run_interleaved``: key -> list of results."""
    runs: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines() if log.is_file() else []:
        entry = json.loads(line)
        runs.setdefault(entry["key"], []).append(entry["result"])
    return runs


# ---------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------


def summarize(runs: list[dict]) -> dict:
    """Median over repeats of every figure; errors kept."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "not run"}
    ctxs = sorted({int(c) for r in ok for c in r["contexts"]})
    out = {"n": len(ok), "contexts": {}}
    for c in ctxs:
        vals = [r["contexts"][str(c)] for r in ok if str(c) in r["contexts"]]
        out["contexts"][c] = {
            "ms": statistics.median(v["ms"] for v in vals),
            "ms_min": min(v["ms"] for v in vals),
            "ms_max": max(v["ms"] for v in vals),
            "rss_mib": statistics.median(v["rss"] for v in vals) / MiB,
            "other": max((v.get("other", 0.0) for v in vals), default=0.0),  # the most disturbed run's
        }
    out["prefill_tps"] = statistics.median(r["prefill_tps"] for r in ok)
    sizes = sorted({int(n) for r in ok for n in r.get("prefills", {})})
    if sizes:  # per prefill size (runs logged before this field have only prefill_tps)
        out["prefills"] = {
            n: statistics.median(r["prefills"][str(n)]["tps"] for r in ok if str(n) in r.get("prefills", {}))
            for n in sizes
        }
    out["prefill_other"] = max(r.get("prefill_other", 0.0) for r in ok)
    out["rss_load_mib"] = statistics.median(r["rss_load"] for r in ok) / MiB
    if all("rss_prefill" in r for r in ok):  # runs logged before this field have none
        out["rss_prefill_mib"] = statistics.median(r["rss_prefill"] for r in ok) / MiB
    out |= {k: ok[0][k] for k in ("attention", "matmul") if k in ok[0]}  # edgeattn's kernels (_kernels)
    return out


def print_table(
    results: dict,
    built: dict,
    contexts: list[int],
    threads: list[int],
    labels: dict | None = None,
    base_of=lambda name: "edgeattn-gla",
    title: str = "median of fresh processes [min-max]",
    prefill: int | list[int] = 1024,
) -> dict:
    """The markdown table per thread count, then each model's ratios against ``base_of(model)`` (a model
    name, or None for no ratios): peer / base decode ms and RSS, base / peer prefill tokens/s (``prefill``:
    the prefill size, or a list of them: a column and a ratio each)."""
    labels = labels or LABELS
    ratios = {}
    sizes = prefill if isinstance(prefill, list) else [prefill]

    def tps(s: dict, n: int) -> float | None:
        got = s.get("prefills", {}).get(n, s.get("prefills", {}).get(str(n)))
        return got if got is not None else (s["prefill_tps"] if n == sizes[0] else None)

    for th in threads:
        print(f"\n{th} thread(s), batch 1, {title}\n")
        head = " | ".join(f"decode ms @{c}" for c in contexts)
        rss_head = " | ".join(f"RSS MiB @{c}" for c in contexts)
        print(
            f"| model | params | {head} | {rss_head} | "
            + " | ".join(f"prefill tok/s ({n})" for n in sizes)
            + " | RSS after prefill | other CPU (cores, max) |"
        )
        print("|---|---|" + "---|" * (2 * len(contexts) + len(sizes)) + "---|---|")
        for name, info in built.items():
            s = results.get(f"{name}@{th}", {"error": info.get("error", "not run")})
            if "error" in s:
                print(f"| {labels[name]} | - | {s['error']} |")
                continue
            cells = []
            for c in contexts:
                v = s["contexts"].get(c)
                cells.append(f"{v['ms']:.2f} [{v['ms_min']:.2f}-{v['ms_max']:.2f}]" if v else "-")
            rss = [f"{s['contexts'][c]['rss_mib']:.0f}" if c in s["contexts"] else "-" for c in contexts]
            other = max([v.get("other", 0.0) for v in s["contexts"].values()] + [s.get("prefill_other", 0.0)])
            print(
                f"| {labels[name]} | {info['params'] / 1e6:.1f}M | {' | '.join(cells)} | {' | '.join(rss)} "
                f"| {' | '.join('-' if tps(s, n) is None else f'{tps(s, n):,.0f}' for n in sizes)} "
                f"| {s.get('rss_prefill_mib', float('nan')):.0f} | {other:.2f} |"
            )
        printed = False
        for name in built:
            s = results.get(f"{name}@{th}", {})
            base_name = base_of(name)
            base = results.get(f"{base_name}@{th}", {})
            if base_name in (None, name) or "error" in s or not s or "error" in base or not base:
                continue
            if not printed:
                print(
                    f"\nratios, {th} thread(s): model / its edgeattn counterpart (decode > 1: edgeattn faster; "
                    "RSS > 1: edgeattn smaller; prefill > 1: edgeattn faster)"
                )
                printed = True
            r = {
                f"decode@{c}": s["contexts"][c]["ms"] / base["contexts"][c]["ms"]
                for c in contexts
                if c in s["contexts"] and c in base["contexts"]
            }
            r.update(
                {
                    f"rss@{c}": s["contexts"][c]["rss_mib"] / base["contexts"][c]["rss_mib"]
                    for c in contexts
                    if c in s["contexts"] and c in base["contexts"]
                }
            )
            r["prefill"] = base["prefill_tps"] / s["prefill_tps"]
            for n in sizes if len(sizes) > 1 else []:
                if tps(s, n) and tps(base, n):
                    r[f"prefill@{n}"] = tps(base, n) / tps(s, n)
            if "rss_prefill_mib" in s and "rss_prefill_mib" in base:
                r["rss_prefill"] = s["rss_prefill_mib"] / base["rss_prefill_mib"]
            ratios[f"{name}@{th}"] = r
            print(f"  {name} / {base_name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    return ratios


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny models and short contexts (seconds)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--contexts", default="128,4096,16384")
    ap.add_argument("--softmax-max-context", type=int, default=4096)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--workdir", type=Path, default=None, help="keep the built models here (reused)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument(
        "--report",
        action="store_true",
        help="only print the table of the runs logged in --workdir (runs.jsonl)",
    )
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    if args.serve:
        serve(json.loads(args.serve))
        return

    size = QUICK if args.quick else FULL
    contexts = [16, 64] if args.quick else sorted(int(c) for c in args.contexts.split(","))
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    repeats = 1 if args.quick else args.repeats
    steps = 4 if args.quick else args.steps
    prefill = 64 if args.quick else 1024
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    max_len = max(contexts) + steps + prefill + 64

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="edgeattn-peers-")
        root = Path(tmp.name)
    else:
        root = args.workdir
        root.mkdir(parents=True, exist_ok=True)
    try:
        cache = root / "built.json"
        key = {"size": size, "max_len": max_len, "models": models}
        built = json.loads(cache.read_text()) if cache.is_file() else None
        reuse = built and all(built["key"].get(k) == key[k] for k in ("size", "models"))
        if (
            not reuse or built["key"]["max_len"] < max_len
        ):  # models built for longer contexts serve shorter ones
            t = time.time()
            built = {"key": key, "models": build_all(root, models, size, max_len)}
            cache.write_text(json.dumps(built))
            print(f"built {len(models)} models in {time.time() - t:.0f} s", file=sys.stderr)
        built = {k: v for k, v in built["models"].items() if k in models}

        log = root / "runs.jsonl"  # every worker's result, as it comes: a cut-short run can still be reported
        runs: dict[str, list[dict]] = {}
        if args.report:
            runs = read_log(log)
            repeats = max((len(v) for v in runs.values()), default=0)
        configs = []
        for th in [] if args.report else threads:
            for name, info in built.items():
                if "error" in info:
                    continue
                ctx = contexts
                if name == "edgeattn-softmax-growing":
                    ctx = [c for c in contexts if c <= args.softmax_max_context]
                configs.append(
                    {"model": name, "path": info["path"], "threads": th, "contexts": ctx}
                    | {"steps": steps, "prefill": prefill}
                )
        if not args.report:
            run_interleaved(configs, repeats, args.timeout, log, runs)
    finally:
        if tmp is not None:
            tmp.cleanup()

    results = {k: summarize(v) for k, v in runs.items()}
    ratios = print_table(results, built, contexts, threads)
    skipped = {}
    if "edgeattn-softmax-growing" in built and any(c > args.softmax_max_context for c in contexts):
        skipped["edgeattn-softmax-growing"] = (
            f"contexts above {args.softmax_max_context} skipped (KV cache of ~10 GB at 16384 on 92.5M); "
            "--softmax-max-context to include"
        )
    for name, why in skipped.items():
        print(f"\nnote: {name}: {why}")
    import onnxruntime
    import onnxruntime_genai

    from edgeattn.bench.machine import with_cpu

    print(
        json.dumps(
            with_cpu(
                {
                    "size": size,
                    "contexts": contexts,
                    "threads": threads,
                    "repeats": repeats,
                    "steps": steps,
                    "params": {k: v.get("params") for k, v in built.items()},
                    "errors": {k: v["error"] for k, v in built.items() if "error" in v},
                    "results": {
                        k: {**v, "contexts": {str(c): x for c, x in v.get("contexts", {}).items()}}
                        for k, v in results.items()
                    },
                    "ratios": ratios,
                    "skipped": skipped,
                    "versions": {
                        "onnxruntime": onnxruntime.__version__,
                        "onnxruntime_genai": onnxruntime_genai.__version__,
                    },
                }
            )
        )
    )


if __name__ == "__main__":
    main()
