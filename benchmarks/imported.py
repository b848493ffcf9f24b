"""An imported Qwen3.5 model: edgeattn's export against onnxruntime-genai's own builder, on this CPU.

One transformers Qwen3.5 text model with random weights (speed and memory do not depend on them), saved with
``save_pretrained`` with a byte-level tokenizer, then for each precision (fp32, int4)
- ``edgeattn import`` + ``export_model`` (onnxruntime target, ``precision``): Gated DeltaNet layers through
  ONNX Runtime's LinearAttention op, the gated full-attention layers through GroupQueryAttention over a
  preallocated KV buffer (past and present one buffer);
- ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu``, run by its Generator.
int4 on both sides is ONNX Runtime's MatMulNBits (edgeattn: block 32, symmetric, accuracy level 4; genai:
its CPU defaults). Measured by benchmarks/peers.py's workers (a fresh process per model and repeat,
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

    python benchmarks/imported.py [--threads 2] [--precisions fp32,int4] [--repeats 1]
        [--contexts 128,4096,16384] [--workdir DIR]
    python benchmarks/imported.py --workdir DIR --report   # the table of the runs logged in DIR/runs.jsonl
    python benchmarks/imported.py --workdir DIR --models edgeattn-qwen35   # build/run only these, table of all
    python benchmarks/imported.py --quick

Prints a markdown table and ratios genai / edgeattn, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (the workers, the run loop and the table of benchmarks/peers.py)

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


def name_of(runtime: str, precision: str) -> str:
    return f"{runtime}-qwen35" + ("" if precision == "fp32" else f"-{precision}")


def labels(precisions) -> dict:
    out = {}
    for p in precisions:
        out[name_of("edgeattn", p)] = f"edgeattn {p} (ONNX Runtime session)"
        out[name_of("genai", p)] = f"onnxruntime-genai {p} (its builder + Generator)"
    return out


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
    res = subprocess.run([sys.executable, "-m", "edgeattn.cli.main", *args], capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        raise RuntimeError(f"edgeattn {args[0]} failed: {tail[0]}")


def build_edgeattn(root: Path, hf: Path, precision: str, prefill_chunk: int, optimize: bool = True) -> Path:
    """``edgeattn import`` (once) and ``edgeattn export --precision P --no-checkpoint``; ``optimize=False``:
    ``export_model(..., optimize=False)`` (no fused norms and projections), in its own process too."""
    ckpt = root / "ckpt"
    if not ckpt.is_dir():
        cli("import", str(hf), "--out", str(ckpt), "--force")
    out = root / name_of("edgeattn", precision)
    if not optimize:
        code = (
            "import sys; from edgeattn.export import export_model; export_model(sys.argv[1], sys.argv[2], "
            "precision=sys.argv[3], prefill_chunk=int(sys.argv[4]), include_checkpoint=False, force=True, "
            "optimize=False)"
        )
        args = [str(ckpt), str(out), precision, str(prefill_chunk)]
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
            raise RuntimeError(f"edgeattn export failed: {tail[0]}")
        return out
    cli(
        "export",
        str(ckpt),
        "--out",
        str(out),
        "--precision",
        precision,
        "--no-checkpoint",
        "--force",
        "--prefill-chunk",
        str(prefill_chunk),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and short contexts (seconds)")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--contexts", default="128,4096,16384")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="edgeattn's prefill graph's tokens")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the built models here (reused)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    ap.add_argument("--report", action="store_true", help="only the table of the runs in --workdir")
    ap.add_argument("--models", default="", help="only these (e.g. edgeattn-qwen35,genai-qwen35-int4)")
    ap.add_argument("--no-optimize", action="store_true", help="edgeattn: export without the graph optimizer")
    ap.add_argument("--build-memory", type=float, default=9.0, help="GiB to wait for before each build")
    args = ap.parse_args()
    shape = QUICK if args.quick else FULL
    contexts = [16, 64] if args.quick else sorted(int(c) for c in args.contexts.split(","))
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if set(precisions) - set(PRECISIONS):
        ap.error(f"precisions must be among {', '.join(PRECISIONS)}")
    repeats = 1 if args.quick else args.repeats
    steps = 4 if args.quick else args.steps
    prefill = 64 if args.quick else 1024
    chunk = 16 if args.quick else args.prefill_chunk
    max_len = (
        max(*contexts, prefill) + steps + 8
    )  # genai's worker asks for this; edgeattn's KV buffer the same

    tmp = tempfile.TemporaryDirectory(prefix="edgeattn-imported-") if args.workdir is None else None
    root = Path(tmp.name) if tmp else args.workdir
    root.mkdir(parents=True, exist_ok=True)
    log = root / "runs.jsonl"
    try:
        cache = root / "built.json"
        key = {"shape": shape, "max_len": max_len, "chunk": chunk}
        built = json.loads(cache.read_text()) if cache.is_file() else {"key": key, "models": {}}
        if built["key"] != key:
            built = {"key": key, "models": {}}
        models = built["models"]
        wanted = [name_of(r, p) for p in precisions for r in ("edgeattn", "genai")]
        if args.models:
            wanted = [n for n in wanted if n in args.models.split(",")]
        todo = [
            (r, p)
            for p in precisions
            for r in ("edgeattn", "genai")
            if name_of(r, p) in wanted and "error" in models.get(name_of(r, p), {"error": "not built"})
        ]
        if todo and not args.report:
            t = time.time()
            hf, params = build_hf(root, shape, max_len)
            for runtime, p in todo:  # one at a time: the 0.8B fp32 model is ~3.2 GB per process
                name = name_of(runtime, p)
                if not args.quick:
                    wait_for_memory(args.build_memory, args.timeout)
                try:
                    if runtime == "edgeattn":
                        path = build_edgeattn(root, hf, p, chunk, optimize=not args.no_optimize)
                    else:
                        path = peers.genai_build(hf, root / name, max_len, root / "cache", precision=p)
                    models[name] = {"path": str(path), "params": params}
                except Exception as e:  # reported, not fatal
                    msg = str(e).strip().splitlines()
                    models[name] = {"error": msg[0] if msg else type(e).__name__, "params": params}
                cache.write_text(json.dumps(built))
                print(f"built {name} ({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            shutil.rmtree(root / "cache", ignore_errors=True)
        order = [name_of(r, p) for p in precisions for r in ("edgeattn", "genai")]
        models = {n: models.get(n, {"error": "not built", "params": 0}) for n in order}
        if not args.report:
            configs = [
                {"model": n, "path": m["path"], "threads": th, "contexts": contexts, "steps": steps}
                | {"prefill": prefill}
                for th in threads
                for n, m in models.items()
                if "error" not in m and n in wanted
            ]
            peers.run_interleaved(configs, repeats, args.timeout, log, {})
        runs = peers.read_log(log)  # this invocation's runs and earlier ones in the same --workdir
        repeats = max((len(v) for v in runs.values()), default=0)
    finally:
        if tmp is not None:
            tmp.cleanup()

    results = {k: peers.summarize(v) for k, v in runs.items()}
    print(
        f"\nQwen3.5 text model {shape['hidden_size']}x{shape['num_hidden_layers']}, median of {repeats} run(s)"
    )

    def counterpart(name: str) -> str | None:
        return name.replace("genai-", "edgeattn-") if name.startswith("genai-") else None

    ratios = peers.print_table(results, models, contexts, threads, labels(precisions), counterpart)
    params = next((m["params"] for m in models.values() if m.get("params")), 0)
    print(
        json.dumps(
            {
                "shape": shape,
                "params": params,
                "contexts": contexts,
                "threads": threads,
                "precisions": precisions,
                "repeats": repeats,
                "steps": steps,
                "errors": {k: v["error"] for k, v in models.items() if "error" in v},
                "results": {
                    k: {**v, "contexts": {str(c): x for c, x in v.get("contexts", {}).items()}}
                    for k, v in results.items()
                },
                "ratios": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
