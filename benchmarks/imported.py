"""An imported Qwen3.5 model: edgeattn's export against onnxruntime-genai's own builder, on this CPU.

One transformers Qwen3.5 text model with random weights (speed and memory do not depend on them), saved with
``save_pretrained`` with a byte-level tokenizer, then
- ``edgeattn import`` + ``export_model`` (fp32, onnxruntime target): Gated DeltaNet layers through ONNX
  Runtime's LinearAttention op, the full-attention layers with their KV cache as state;
- ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e cpu``, run by its Generator.
Measured by benchmarks/peers.py's workers (a fresh process per model and repeat, interleaved): decode
ms/token at each context (edgeattn: a random state of c tokens set directly; genai: c random tokens
prefilled), process RSS after the steps, prefill tokens/s.

The full size is the shape of Qwen3.5-0.8B's text model as transformers 5.23's Qwen3_5TextConfig defaults
describe it where this file does not say otherwise (``FULL`` below: check it against the published
config.json before quoting figures); ``--quick`` is a tiny model and short contexts (tests/test_imported_bench.py).

    python benchmarks/imported.py [--threads 1] [--repeats 3] [--contexts 128,4096,16384] [--workdir DIR]
    python benchmarks/imported.py --quick

Prints a markdown table and ratios genai / edgeattn, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (the workers and the summary of benchmarks/peers.py)

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
)
QUICK = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
)
MODELS = ("edgeattn-qwen35", "genai-qwen35")


def build_hf(root: Path, shape: dict, max_len: int) -> tuple[Path, int]:
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
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    hf = root / "hf-qwen35"
    model.save_pretrained(hf)
    del model
    peers.byte_tokenizer().save_pretrained(hf)
    data = json.loads((hf / "config.json").read_text())
    data["architectures"] = ["Qwen3_5ForConditionalGeneration"]  # the name genai's builder knows
    (hf / "config.json").write_text(json.dumps(data))
    return hf, params


def build_edgeattn(root: Path, hf: Path) -> Path:
    from edgeattn.convert import import_model
    from edgeattn.export import export_model

    import_model(hf, root / "ckpt", force=True)
    return export_model(root / "ckpt", root / "edgeattn-qwen35", include_checkpoint=False, force=True)


def build_genai(root: Path, hf: Path, max_len: int) -> Path:
    out = root / "genai-qwen35"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", "fp32", "-e", "cpu", "-c", str(root / "cache")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"onnxruntime-genai's builder failed: {tail[0]}")
    conf = json.loads((out / "genai_config.json").read_text())
    conf["search"].update(max_length=max_len, do_sample=False, num_beams=1)
    conf["model"]["context_length"] = max(int(conf["model"].get("context_length", 0)), max_len)
    (out / "genai_config.json").write_text(json.dumps(conf, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and short contexts (seconds)")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--contexts", default="128,4096,16384")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the built models here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    args = ap.parse_args()
    shape = QUICK if args.quick else FULL
    contexts = [16, 64] if args.quick else sorted(int(c) for c in args.contexts.split(","))
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    repeats = 1 if args.quick else args.repeats
    steps = 4 if args.quick else args.steps
    prefill = 64 if args.quick else 1024
    max_len = max(contexts) + steps + prefill + 64

    tmp = tempfile.TemporaryDirectory(prefix="edgeattn-imported-") if args.workdir is None else None
    root = Path(tmp.name) if tmp else args.workdir
    root.mkdir(parents=True, exist_ok=True)
    built, errors, runs = {}, {}, {}
    try:
        t = time.time()
        hf, params = build_hf(root, shape, max_len)
        built["edgeattn-qwen35"] = build_edgeattn(root, hf)
        try:
            built["genai-qwen35"] = build_genai(root, hf, max_len)
        except Exception as e:  # reported, not fatal
            errors["genai-qwen35"] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"built in {time.time() - t:.0f} s ({params} parameters)", file=sys.stderr)
        configs = [
            {"model": name, "path": str(path), "threads": th, "contexts": contexts, "steps": steps}
            | {"prefill": prefill}
            for th in threads
            for name, path in built.items()
        ]
        for r in range(repeats):
            for cfg in configs[r % len(configs) :] + configs[: r % len(configs)]:
                key = f"{cfg['model']}@{cfg['threads']}"
                res = peers.run_worker(cfg, args.timeout)
                runs.setdefault(key, []).append(res)
                print(f"[repeat {r + 1}/{repeats}] {key}: {res.get('error') or 'ok'}", file=sys.stderr)
    finally:
        if tmp is not None:
            tmp.cleanup()

    results = {k: peers.summarize(v) for k, v in runs.items()}
    ratios = {}
    for th in threads:
        print(f"\n{th} thread(s), batch 1, median of {repeats} fresh process(es)\n")
        head = " | ".join(f"decode@{c} ms" for c in contexts)
        print(f"| model | {head} | prefill tok/s | RSS@{contexts[-1]} MiB |")
        print("|---" * (len(contexts) + 3) + "|")
        for name in MODELS:
            r = results.get(f"{name}@{th}")
            if not r or "error" in r:
                print(f"| {name} | {(r or {}).get('error', errors.get(name, 'not run'))} |")
                continue
            ms = " | ".join(f"{r['contexts'][c]['ms']:.2f}" for c in contexts)
            rss = r["contexts"][contexts[-1]]["rss_mib"]
            print(f"| {name} | {ms} | {r['prefill_tps']:.0f} | {rss:.0f} |")
        e, g = results.get(f"edgeattn-qwen35@{th}", {}), results.get(f"genai-qwen35@{th}", {})
        if "contexts" in e and "contexts" in g:
            ratios[str(th)] = {
                f"decode@{c}": g["contexts"][c]["ms"] / e["contexts"][c]["ms"] for c in contexts
            } | {"prefill": e["prefill_tps"] / g["prefill_tps"]}
            print("\ngenai / edgeattn (decode ms; > 1: edgeattn faster), edgeattn / genai (prefill):")
            print("  " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[str(th)].items()))
    print(
        json.dumps(
            {
                "shape": shape,
                "params": params,
                "contexts": contexts,
                "threads": threads,
                "repeats": repeats,
                "steps": steps,
                "errors": errors,
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
