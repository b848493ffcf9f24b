"""The browser as an edge device: tokens/s and time to first token of `edgeattn web`'s page in headless
Chromium (onnxruntime-web, WASM, each of ``--threads``, cross-origin isolated) against ONNX Runtime in Python
on the same artifact and thread count, and the page's memory over a long generation.

Models: untrained byte-level GLA of two sizes (``small``: d_model 256, 4 layers, 4 heads, ~3.6M parameters;
``full``: d_model 768, 12 layers, 12 heads, ~92.5M), exported fp32 to the ``portable`` target (standard
ops, two graphs) and the ``onnxruntime`` target (the fused com.microsoft.LinearAttention, one graph), both of
which run in onnxruntime-web. Per artifact:

- ORT Python: ``OnnxRuntimeSession(threads=N)``, greedy ``generate_ids`` from a 64-byte prompt;
- page: ``window.edgeattn.generate`` of the same prompt and length (after a warm-up generation of half as
  many tokens in the same page, as for Python: WebAssembly reaches TurboFan's code only after a while); the
  ids must equal Python's (``same`` column);
- time to first token: prefill of the prompt + the first token's choice; tokens/s: the tokens after the
  first over the time of their steps (the same definition on both sides); the median of ``--repeats`` runs
  per side, Python and page alternated;
- memory (``--memory-tokens``, default 10,000, on the small models, at the last thread count): the WASM heap, the JS heap (after a
  garbage collection through CDP) and the renderer's resident memory after 1,000 tokens and at the end.

    python benchmarks/web.py [--sizes small,full] [--threads 1,2] [--tokens 256] [--workdir DIR]

Needs chromium and web/node_modules (scripts/setup_env.sh). Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {
    "small": dict(d_model=256, n_layers=4, n_heads=4),
    "full": dict(d_model=768, n_layers=12, n_heads=12),
}
TARGETS = ("portable", "onnxruntime")
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib"  # 64+ bytes


def build(root: Path, size: str) -> tuple[dict[str, Path], int]:
    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeConfig, EdgeLM

    torch.manual_seed(0)
    model = EdgeLM(EdgeConfig(vocab_size=256, mixer="gla", **SIZES[size]))
    params = sum(p.numel() for p in model.parameters())
    arts = {t: root / f"{size}-{t}" for t in TARGETS}
    if not all((a / "edgeattn.json").is_file() for a in arts.values()):
        ckpt = model.save(root / f"{size}-ckpt")
        for target, art in arts.items():
            export_model(ckpt, art, target=target, include_checkpoint=False, force=True)
    return arts, params


def python_session(art: Path, threads: int, warmup: int):
    from edgeattn.export.manifest import Manifest
    from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession

    sess = OnnxRuntimeSession(Manifest.load(art), threads=threads)
    list(sess.generate_ids(sess.tokenizer.encode(PROMPT), warmup, temperature=0))  # warm-up, as the page
    return sess


def python_run(sess, n: int) -> dict:
    sess.reset()
    prompt = sess.tokenizer.encode(PROMPT)
    t0 = time.perf_counter()
    ids, first = [], None
    for tok in sess.generate_ids(prompt, n, temperature=0):
        if first is None:
            first = time.perf_counter()
        ids.append(tok)
    end = time.perf_counter()
    return {"ttft_ms": (first - t0) * 1e3, "tokens_per_s": (len(ids) - 1) / (end - first), "ids": ids}


def generate_js(tokens: int) -> str:
    return f"edgeattn.generate({{prompt: {json.dumps(PROMPT)}, max_new_tokens: {tokens}, temperature: 0}})"


def page_run(browser, n: int) -> dict:
    ids = browser.evaluate(generate_js(n), timeout=1200)
    out = browser.evaluate("({ttft: edgeattn.ttft_ms, tps: edgeattn.tokens_per_s, error: edgeattn.error})")
    if out["error"]:
        raise RuntimeError(out["error"])
    return {"ttft_ms": out["ttft"], "tokens_per_s": out["tps"], "ids": ids}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def memory_run(browser, n: int) -> dict:
    def sample() -> dict:
        browser.gc()
        m = browser.metrics()
        return {
            "wasm_mib": browser.evaluate("edgeattn.wasmBytes()") / 2**20,
            "js_mib": m["JSHeapUsedSize"] / 2**20,
            "rss_mib": browser.renderer_rss() / 2**20,
        }

    browser.evaluate(generate_js(n) + ", 0")  # not awaited: sampled while it runs
    browser.wait_for("edgeattn.tokens.length >= 1000", timeout=1200)
    early = sample()
    browser.wait_for("edgeattn.done", timeout=3600)
    late = sample()
    if browser.evaluate("edgeattn.error"):
        raise RuntimeError(browser.evaluate("edgeattn.error"))
    return {"tokens": browser.evaluate("edgeattn.tokens.length"), "at_1000": early, "at_end": late}


def main() -> None:
    from edgeattn.web import build_site
    from edgeattn.web.serve import serve_site
    from tests.browser import Browser, browser_missing

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,full")
    ap.add_argument("--threads", default="1,2", help="thread counts, each on both sides")
    ap.add_argument("--tokens", type=int, default=256, help="generated tokens per timed run")
    ap.add_argument("--full-tokens", type=int, default=64, help="generated tokens per timed run of `full`")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (median), alternated")
    ap.add_argument("--memory-tokens", type=int, default=10000, help="0 skips the memory run")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="keep (and reuse) the artifacts and sites here"
    )
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    missing = browser_missing()
    if missing:
        sys.exit(f"error: {missing}")
    tmp = None if args.workdir else tempfile.TemporaryDirectory()
    root = args.workdir or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)

    rows, memory = [], {}
    for size in args.sizes.split(","):
        arts, params = build(root, size)
        n = args.full_tokens if size == "full" else args.tokens
        warmup = max(16, n // 2)
        for target, art in arts.items():
            site = build_site(art, root / f"site-{size}-{target}", force=True)
            for th in threads:
                sess = python_session(art, th, warmup)
                with serve_site(site) as url, Browser() as browser:
                    t0 = time.perf_counter()
                    browser.goto(f"{url}?threads={th}", timeout=600)
                    browser.wait_for("window.edgeattn && (edgeattn.ready || edgeattn.error)", timeout=600)
                    load_s = time.perf_counter() - t0
                    # warm-up: Chrome runs WebAssembly first through its baseline compiler (Liftoff) and
                    # moves hot functions to TurboFan in the background; the first hundred steps ran 2-3x slower
                    browser.evaluate(generate_js(warmup), timeout=1200)
                    py, web = [], []
                    for _ in range(args.repeats):  # alternated, so that the machine's load hits both alike
                        py.append(python_run(sess, n))
                        web.append(page_run(browser, n))
                    wasm = browser.evaluate("edgeattn.wasmBytes()") / 2**20
                    if size == "small" and args.memory_tokens and th == threads[-1]:
                        memory[target] = memory_run(browser, args.memory_tokens)
                    th_page = browser.evaluate("edgeattn.threads")
                del sess
                rows.append(
                    {
                        "size": size,
                        "params_m": round(params / 1e6, 1),
                        "target": target,
                        "tokens": n,
                        "threads": th_page,
                        "py_ttft_ms": round(median(py, "ttft_ms"), 1),
                        "web_ttft_ms": round(median(web, "ttft_ms"), 1),
                        "py_tok_s": round(median(py, "tokens_per_s"), 1),
                        "web_tok_s": round(median(web, "tokens_per_s"), 1),
                        "ratio": round(median(py, "tokens_per_s") / median(web, "tokens_per_s"), 2),
                        "same": all(p["ids"] == w["ids"] for p, w in zip(py, web)),
                        "web_load_s": round(load_s, 1),
                        "wasm_heap_mib": round(wasm),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    head = (
        f"{'model':>12} {'target':>11} {'threads':>7} {'tokens':>6} {'TTFT py':>9} {'TTFT web':>9} {'tok/s py':>9} "
        f"{'tok/s web':>9} {'py/web':>6} {'same':>5} {'load':>6} {'WASM heap':>10}"
    )
    print(head)
    for r in rows:
        model = f"{r['size']} {r['params_m']}M"
        print(
            f"{model:>12} {r['target']:>11} {r['threads']:>7} {r['tokens']:>6} "
            f"{r['py_ttft_ms']:>7.1f}ms {r['web_ttft_ms']:>7.1f}ms {r['py_tok_s']:>9.1f} {r['web_tok_s']:>9.1f} "
            f"{r['ratio']:>5.2f}x {str(r['same']):>5} {r['web_load_s']:>5.1f}s {r['wasm_heap_mib']:>6} MiB"
        )
    for target, m in memory.items():
        a, b = m["at_1000"], m["at_end"]
        print(
            f"memory, small {target}, 1,000 -> {m['tokens']:,} tokens: WASM heap {a['wasm_mib']:.1f} -> "
            f"{b['wasm_mib']:.1f} MiB, JS heap {a['js_mib']:.2f} -> {b['js_mib']:.2f} MiB, renderer RSS "
            f"{a['rss_mib']:.0f} -> {b['rss_mib']:.0f} MiB"
        )
    print(json.dumps(with_cpu({"benchmark": "web", "threads": threads, "rows": rows, "memory": memory})))


if __name__ == "__main__":
    main()
