"""`edgeattn serve` under load: concurrent clients batched in one graph call, and a long conversation
resumed from the prefix-state cache.

What it measures: a GLA model (random weights: speed and memory do not depend on them) exported with
``--dynamic-batch`` (the artifact of benchmarks/streams.py), served by ``edgeattn serve`` in a subprocess on
127.0.0.1 and driven by the official ``openai`` client (``AsyncOpenAI``, streaming, greedy):

1. N concurrent clients (default 1, 4, 16, 64), each streaming one completion of ``--max-tokens`` tokens
   from its own 32-byte prompt: aggregate tokens/s (all tokens / wall time from the first request to the
   last token) and its ratio to N = 1; p50 and p99 time to first token (TTFT) and inter-token latency
   (ITL, the gaps between streamed chunks); the server's RSS after the round.
2. A 10-turn chat (``--turns``) whose history grows to ``--history`` bytes (= tokens, byte-level): each
   turn sends the whole conversation with a new user message and takes a 16-token greedy reply. Run
   against a fresh server with the prefix cache (empty) and one with ``--state-cache-mb 0``: TTFT per turn,
   the ``cached_tokens`` reported, and the cached server's RSS growth over the conversation next to the
   state bytes of one stream. (``--parts`` runs one of the two.)

``--model qwen35``: the imported Qwen3.5 layout at a small size (``SMALL``) instead, exported with
``--dynamic-batch``: its softmax layers keep a KV buffer of ``--history`` + 512 tokens per stream, which
``Streams`` copies whole when a stream joins or leaves the batch.

    python benchmarks/serve.py [--d-model 768 --layers 12 --heads 12] [--threads 2]
    python benchmarks/serve.py --model qwen35 [--clients 1,4,16]   # the imported Qwen3.5 shape, small
    python benchmarks/serve.py --quick        # a tiny model, N = 1, 4: checks the harness

Prints markdown tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streams import build  # noqa: E402  (the same --dynamic-batch GLA artifact)

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
SMALL = dict(  # the imported Qwen3.5 layout (benchmarks/imported.py) at a small size: ~14M parameters
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
)


class Server:
    """`edgeattn serve` in a subprocess on a free port of 127.0.0.1; stopped with SIGTERM."""

    def __init__(self, artifact: Path, *args: str, log: Path):
        import httpx

        self.log = log
        cmd = [sys.executable, "-m", "edgeattn.cli.main", "serve", str(artifact), "--port", "0", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        self.url = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise SystemExit(f"edgeattn serve did not start:\n{log.read_text(errors='replace')[-3000:]}")

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def state_bytes(self) -> int:
        m = re.search(r"x ([\d.]+) MiB of state", self.log.read_text())
        return int(float(m.group(1)) * MiB)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._out.close()


async def stream_one(client, model: str, *, prompt=None, messages=None, max_tokens: int) -> dict:
    """One streamed request: TTFT, the chunk gaps, tokens and cached tokens (from the usage chunk)."""
    t0 = time.perf_counter()
    times, text, usage = [], [], None
    kw = dict(
        model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    kw["extra_body"] = {"ignore_eos": True}  # random weights: a reply of max_tokens whatever they emit
    if messages is None:
        stream = await client.completions.create(prompt=prompt, **kw)
    else:
        stream = await client.chat.completions.create(messages=messages, **kw)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        piece = chunk.choices[0].text if messages is None else (chunk.choices[0].delta.content or "")
        if piece:
            times.append(time.perf_counter())
            text.append(piece)
    done = time.perf_counter()
    return {
        "start": t0,
        "ttft": (times or [done])[0] - t0,  # a reply of invisible tokens only: its end
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "end": done,
        "tokens": usage.completion_tokens,
        "cached": usage.prompt_tokens_details.cached_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "text": "".join(text),
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def concurrency(server: Server, model: str, ns: list[int], max_tokens: int) -> list[dict]:
    import httpx
    import numpy as np
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=max(ns) + 8, max_keepalive_connections=max(ns) + 8)
    client = AsyncOpenAI(
        base_url=server.url + "/v1",
        api_key="none",
        max_retries=0,
        timeout=600,
        http_client=httpx.AsyncClient(limits=limits, timeout=600),
    )
    rng = np.random.default_rng(0)

    def prompt():
        return [int(x) for x in rng.integers(32, 127, 32)]

    await stream_one(client, model, prompt=prompt(), max_tokens=4)  # warm-up
    rows = []
    for n in ns:
        runs = await asyncio.gather(
            *(stream_one(client, model, prompt=prompt(), max_tokens=max_tokens) for _ in range(n))
        )
        wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
        gaps = [g for r in runs for g in r["gaps"]]
        rows.append(
            {
                "clients": n,
                "tokens": sum(r["tokens"] for r in runs),
                "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
                "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in runs], 50),
                "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in runs], 99),
                "itl_p50_ms": 1e3 * pct(gaps, 50),
                "itl_p99_ms": 1e3 * pct(gaps, 99),
                "rss_mib": server.rss() / MiB,
            }
        )
    await client.close()
    return rows


async def conversation(server: Server, model: str, turns: int, history: int, reply_tokens: int) -> list[dict]:
    import numpy as np
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    rng = np.random.default_rng(1)
    per_turn = max(1, history // turns - reply_tokens - 24)  # the template adds "user: ...\nassistant: "
    messages, rows = [], []
    rss0 = server.rss()
    for t in range(turns):
        messages.append({"role": "user", "content": "".join(chr(c) for c in rng.integers(97, 123, per_turn))})
        r = await stream_one(client, model, messages=messages, max_tokens=reply_tokens)
        messages.append({"role": "assistant", "content": r["text"]})
        rows.append(
            {
                "turn": t + 1,
                "prompt_tokens": r["prompt_tokens"],
                "cached_tokens": r["cached"],
                "ttft_ms": 1e3 * r["ttft"],
            }
        )
    rows[-1]["rss_growth_mib"] = (server.rss() - rss0) / MiB
    await client.close()
    return rows


def build_qwen35(args, workdir: Path) -> Path:
    """The imported Qwen3.5 shape at a small size (``SMALL``: 3 Gated DeltaNet layers to 1 softmax layer on a
    KV buffer of ``--history`` + 512 tokens, random weights, byte-level tokenizer), exported with a dynamic
    batch; reused when it exists."""
    import imported

    max_len = args.history + 512
    art = workdir / f"qwen35-small-{max_len}-dyn"
    if (art / "edgeattn.json").is_file():
        return art
    hf, _ = imported.build_hf(workdir, SMALL, max_len)
    imported.cli("import", str(hf), "--out", str(workdir / "ckpt-qwen35"), "--force")
    imported.cli(
        "export",
        str(workdir / "ckpt-qwen35"),
        "--out",
        str(art),
        "--dynamic-batch",
        "--no-checkpoint",
        "--force",
    )
    return art


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated numbers of concurrent clients")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request in the concurrency rounds")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--history", type=int, default=4096, help="bytes of conversation after the last turn")
    p.add_argument(
        "--model", choices=("gla", "qwen35"), default="gla", help="qwen35: the imported Qwen3.5 shape, small"
    )
    p.add_argument("--parts", default="concurrency,conversation", help="which measurements to run")
    p.add_argument("--workdir", type=Path, default=None, help="where the model is built (kept for reuse)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 and 4 clients, a short chat")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.heads = 64, 2, 2
        args.clients, args.max_tokens, args.turns, args.history = "1,4", 8, 3, 600
    ns = [int(x) for x in args.clients.split(",")]
    parts = set(args.parts.split(","))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="edgeattn-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    art = build(args, workdir) if args.model == "gla" else build_qwen35(args, workdir)
    params = json.loads((art / "edgeattn.json").read_text())["model"]
    params = {k: params.get(k) for k in ("d_model", "n_layers", "n_heads", "vocab_size", "mixer")}
    model = art.name
    slots = str(max(ns))
    common = ["--threads", str(args.threads), "--slots", slots, "--max-queue", slots]

    rows, cached, uncached, state_bytes = [], [], [], None
    if "concurrency" in parts:
        server = Server(art, *common, log=workdir / "serve-load.log")
        try:
            rows = asyncio.run(concurrency(server, model, ns, args.max_tokens))
            state_bytes = server.state_bytes()
        finally:
            server.stop()
    if "conversation" in parts:  # fresh servers: an empty cache, so its growth is the conversation's
        server = Server(art, *common, log=workdir / "serve-cache.log")
        try:
            state_bytes = server.state_bytes()
            cached = asyncio.run(conversation(server, model, args.turns, args.history, 16))
        finally:
            server.stop()
        server = Server(art, *common, "--state-cache-mb", "0", log=workdir / "serve-nocache.log")
        try:
            uncached = asyncio.run(conversation(server, model, args.turns, args.history, 16))
        finally:
            server.stop()

    print(f"{args.model}: {params}, --threads {args.threads}, --slots {slots}")
    if rows:
        base = rows[0]["tokens_per_s"]
        print(f"\n{args.max_tokens} streamed greedy tokens per request, one request per client:\n")
        print(
            "| clients | aggregate tok/s | x 1 client | TTFT p50 / p99 ms | ITL p50 / p99 ms | server RSS MiB |"
        )
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['clients']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                f"{r['rss_mib']:.0f} |"
            )
    if cached:
        print(
            f"\nA {args.turns}-turn chat to {cached[-1]['prompt_tokens']} prompt tokens, 16-token replies:\n"
        )
        print(
            "| turn | prompt tokens | cached_tokens | TTFT ms, cache | TTFT ms, --state-cache-mb 0 | speed-up |"
        )
        print("|---|---|---|---|---|---|")
        for a, b in zip(cached, uncached):
            print(
                f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_ms']:.0f} | "
                f"{b['ttft_ms']:.0f} | {b['ttft_ms'] / a['ttft_ms']:.1f}x |"
            )
        print(
            f"\nServer RSS growth over the cached conversation (from an empty cache): "
            f"{cached[-1]['rss_growth_mib']:.1f} MiB (one stream's state: {state_bytes / MiB:.2f} MiB)"
        )
    ttft_cached = [a["ttft_ms"] for a in cached[1:]]
    print(
        json.dumps(
            {
                "benchmark": "serve",
                "model": {"name": args.model, **params},
                "threads": args.threads,
                "max_tokens": args.max_tokens,
                "concurrency": rows,
                "conversation": {"cache": cached, "no_cache": uncached},
                "last_turn_speedup": uncached[-1]["ttft_ms"] / cached[-1]["ttft_ms"] if cached else None,
                "cached_ttft_ms_median_turns_2_on": statistics.median(ttft_cached) if ttft_cached else None,
                "state_bytes": state_bytes,
                "load_average": os.getloadavg(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
