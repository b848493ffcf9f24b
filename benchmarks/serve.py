"""`edgeattn serve` under load: concurrent clients batched in one graph call, and a long conversation
resumed from the prefix-state cache.

What it measures: a GLA model (random weights: speed and memory do not depend on them) exported with
``--dynamic-batch`` (the artifact of benchmarks/streams.py), served by ``edgeattn serve`` in a subprocess on
127.0.0.1 and driven by the official ``openai`` client (``AsyncOpenAI``, streaming, greedy):

1. N concurrent clients (default 1, 4, 16, 64), each streaming one completion of ``--max-tokens`` tokens
   from its own 32-byte prompt: aggregate tokens/s (all tokens / wall time from the first request to the
   last token) and its ratio to N = 1; p50 and p99 time to first token (TTFT) and inter-token latency
   (ITL, the gaps between streamed chunks); the server's RSS after the round.
2. A 10-turn chat (``--turns``): each turn sends the whole conversation with a new user message of
   ``--user-tokens`` (30-50) tokens and takes a greedy reply of ``--reply-tokens`` (340), so that the
   prompt reaches ~4k tokens at turn 10. Run against a fresh server with the prefix cache (empty) and one
   with ``--state-cache-mb 0``: TTFT per turn, its prompt tokens and the ``cached_tokens`` reported. For
   the reply's state to be found next turn the text the client sends back must encode to the same token
   ids, which a byte-level vocabulary with random weights does not give (it emits invalid UTF-8): the
   models get a ``tokenizer.json`` built here (``char_tokenizer``: every token one printable character,
   a concatenating decoder, so decode -> encode gives the ids back; checked before the run, and each
   reply's text re-encoded to its token count). Then ``--rss-conversations`` (4) more such chats run
   together on each server; the RSS growth they cause divided by their number is set next to the bytes
   of one stream's state (the server fixes glibc's mmap threshold, so freed states go back to the
   system). ``--tokenizer bytes`` runs the older chat instead: the byte-level tokenizer, user messages
   that fill ``--history`` bytes over the turns and 16-token replies (which come back re-encoded).
   (``--parts`` runs one of the two parts.)

``--model qwen35``: the imported Qwen3.5 layout at a small size (``SMALL``) instead, exported with
``--dynamic-batch``: its softmax layers keep a KV buffer of ``--history`` + 512 tokens per stream (its
prompts are prefilled one at a time: GroupQueryAttention takes a batch of one for several tokens).

    python benchmarks/serve.py [--d-model 768 --layers 12 --heads 12] [--threads 2]
    python benchmarks/serve.py --model qwen35 [--clients 1,4,16]   # the imported Qwen3.5 shape, small
    python benchmarks/serve.py --model qwen35 --qwen-size medium    # the same layout at the GLA's size
    python benchmarks/serve.py --quick        # a tiny model, N = 1, 4: checks the harness

Prints markdown tables, then one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streams import build, model_parser  # noqa: E402  (the same --dynamic-batch GLA artifact)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from edgeattn.bench.machine import with_cpu  # noqa: E402
from tests import serve_helpers  # noqa: E402  (the tests' server launcher)

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
# The same layout at about the GLA's size (92M parameters): 9 Gated DeltaNet and 3 softmax layers, hidden 768.
MEDIUM = dict(
    SMALL,
    hidden_size=768,
    num_hidden_layers=12,
    intermediate_size=2304,
    num_attention_heads=6,
    head_dim=128,
    linear_num_key_heads=6,
    linear_num_value_heads=12,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
QWEN_SIZES = {"small": SMALL, "medium": MEDIUM}


class Server(serve_helpers.Server):
    """`edgeattn serve` in a subprocess on a free port of 127.0.0.1 (the tests' launcher, given the time a
    large model needs to load), with the server's RSS and one stream's state bytes."""

    def __init__(self, artifact: Path, *args: str):
        try:
            super().__init__(artifact, *args, timeout=300)
        except RuntimeError as e:  # it did not start: its log, not a traceback
            raise SystemExit(str(e)) from None

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def state_bytes(self) -> int:
        m = re.search(r"x ([\d.]+) MiB of state", self.log())
        return int(float(m.group(1)) * MiB)


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


def char_tokenizer(vocab_size: int):
    """A ``tokenizers`` tokenizer of ``vocab_size`` tokens, each one printable character (and a newline,
    for the chat template), with no merges and a concatenating decoder (``decoders.Fuse``): any ids decode
    to a text that encodes back to them, so a reply comes back to the server as the tokens it was."""
    from tokenizers import Tokenizer, decoders, models

    chars = ["\n"] + [c for c in map(chr, range(0x20, 0x250)) if c.isprintable()]
    if vocab_size > len(chars):
        raise SystemExit(
            f"char_tokenizer has {len(chars)} characters, the model's vocabulary is {vocab_size}"
        )
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars[:vocab_size])}, merges=[]))
    tok.decoder = decoders.Fuse()
    return tok


def with_char_tokenizer(art: Path) -> Path:
    """A sibling of artifact ``art`` (its files linked) whose manifest names a ``char_tokenizer`` of its
    vocabulary; its round trip is checked on random ids first."""
    import numpy as np

    data = json.loads((art / "edgeattn.json").read_text())
    V = data["vocab_size"]
    tok = char_tokenizer(V)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, V, 20_000)]
    if tok.encode(tok.decode(ids)).ids != ids:
        raise SystemExit("char_tokenizer: decode -> encode does not give the ids back")
    out = art.parent / f"{art.name}-chars"
    out.mkdir(exist_ok=True)
    for f in art.iterdir():
        if f.name not in ("edgeattn.json", "tokenizer.json") and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    tok.save(str(out / "tokenizer.json"))
    old = data.get("tokenizer") or {}
    data["tokenizer"] = {
        "type": "huggingface",
        "path": "tokenizer.json",
        "vocab_size": V,
        "eos_token_ids": old.get("eos_token_ids", []),
        "bos_token_id": None,
        "pad_token_id": None,
        "chat_template": None,
    }
    if "tokenizer.json" in data.get("files", {}):  # an imported model lists its own, with a checksum
        from edgeattn.artifact.manifest import sha256_file

        path = out / "tokenizer.json"
        data["files"]["tokenizer.json"] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (out / "edgeattn.json").write_text(json.dumps(data, indent=1))
    return out


async def conversation(server: Server, model: str, args, seed: int = 1) -> list[dict]:
    """One chat of ``args.turns`` turns (see the module docstring): a row per turn."""
    import numpy as np
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1200)
    rng = np.random.default_rng(seed)
    tok = char_tokenizer(args.vocab) if args.tokenizer == "chars" else None
    if tok is None:  # the older chat: long user messages filling --history bytes, 16-token replies
        reply_tokens = 16
        per_turn = max(
            1, args.history // args.turns - reply_tokens - 24
        )  # the template: "user: ...\nassistant: "
    else:
        reply_tokens = args.reply_tokens
    lo, hi = (int(x) for x in args.user_tokens.split("-"))
    messages, rows = [], []
    for t in range(args.turns):
        n = per_turn if tok is None else int(rng.integers(lo, hi + 1))
        words = rng.integers(97, 123, n)
        words[rng.random(n) < 0.18] = 32  # lowercase words and spaces
        messages.append({"role": "user", "content": "".join(chr(c) for c in words)})
        r = await stream_one(client, model, messages=messages, max_tokens=reply_tokens)
        messages.append({"role": "assistant", "content": r["text"]})
        row = {
            "turn": t + 1,
            "prompt_tokens": r["prompt_tokens"],
            "cached_tokens": r["cached"],
            "completion_tokens": r["tokens"],
            "ttft_ms": 1e3 * r["ttft"],
        }
        if tok is not None:  # the reply's text is its tokens, one character each
            row["reply_round_trips"] = len(tok.encode(r["text"]).ids) == r["tokens"]
        rows.append(row)
    await client.close()
    return rows


async def conversations(server: Server, model: str, args) -> tuple[list[dict], float]:
    """The timed chat alone, then ``--rss-conversations`` more together: (its rows, RSS growth per chat
    of the latter, in bytes)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    await stream_one(client, model, prompt=[3, 4, 5, 6], max_tokens=4)  # warm-up (the graphs' first runs)
    await client.close()
    rows = await conversation(server, model, args)
    k = args.rss_conversations
    if not k:
        return rows, None
    rss0 = server.rss()
    await asyncio.gather(*(conversation(server, model, args, seed=100 + i) for i in range(k)))
    return rows, (server.rss() - rss0) / k


def build_qwen35(args, workdir: Path) -> Path:
    """The imported Qwen3.5 shape at a small size (``SMALL``: 3 Gated DeltaNet layers to 1 softmax layer on a
    KV buffer of ``--history`` + 512 tokens, random weights, byte-level tokenizer), exported with a dynamic
    batch; reused when it exists."""
    import imported

    max_len = args.history + 512
    art = workdir / f"qwen35-{args.qwen_size}-{max_len}-dyn"
    if (art / "edgeattn.json").is_file():
        return art
    hf, _ = imported.build_hf(workdir / args.qwen_size, QWEN_SIZES[args.qwen_size], max_len)
    imported.cli("import", str(hf), "--out", str(workdir / args.qwen_size / "ckpt"), "--force")
    imported.cli(
        "export",
        str(workdir / args.qwen_size / "ckpt"),
        "--out",
        str(art),
        "--dynamic-batch",
        "--no-checkpoint",
        "--force",
    )
    return art


def main(argv=None) -> int:
    p = model_parser(__doc__)
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated numbers of concurrent clients")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request in the concurrency rounds")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--user-tokens", default="30-50", help="tokens of each user message (a range)")
    p.add_argument("--reply-tokens", type=int, default=340, help="max_tokens of each reply in the chat")
    p.add_argument("--rss-conversations", type=int, default=4, help="chats run together to measure RSS")
    p.add_argument(
        "--tokenizer",
        choices=("chars", "bytes"),
        default="chars",
        help="bytes: the older chat (byte-level tokenizer, user messages filling --history, 16-token replies)",
    )
    p.add_argument(
        "--history",
        type=int,
        default=4096,
        help="conversation tokens the KV buffer must hold (qwen35: + 512)",
    )
    p.add_argument(
        "--model", choices=("gla", "qwen35"), default="gla", help="qwen35: the imported Qwen3.5 shape, small"
    )
    p.add_argument(
        "--qwen-size",
        choices=tuple(QWEN_SIZES),
        default="small",
        help="qwen35's size: small (~14M parameters) or medium (~92M, the GLA's size)",
    )
    p.add_argument("--parts", default="concurrency,conversation", help="which measurements to run")
    p.add_argument("--workdir", type=Path, default=None, help="where the model is built (kept for reuse)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 and 4 clients, a short chat")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.heads = 64, 2, 2
        args.clients, args.max_tokens, args.turns, args.history = "1,4", 8, 3, 600
        args.reply_tokens, args.rss_conversations = 40, 2
    ns = [int(x) for x in args.clients.split(",")]
    parts = set(args.parts.split(","))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="edgeattn-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    art = build(args, workdir) if args.model == "gla" else build_qwen35(args, workdir)
    if args.tokenizer == "chars":
        art = with_char_tokenizer(art)
    args.vocab = json.loads((art / "edgeattn.json").read_text())["vocab_size"]
    params = json.loads((art / "edgeattn.json").read_text())["model"]
    params = {k: params.get(k) for k in ("d_model", "n_layers", "n_heads", "vocab_size", "mixer")}
    model = art.name
    slots = str(max(ns))
    common = ["--threads", str(args.threads), "--slots", slots, "--max-queue", slots]

    rows, cached, uncached, state_bytes, rss = [], [], [], None, {}
    if "concurrency" in parts:
        server = Server(art, *common)
        try:
            rows = asyncio.run(concurrency(server, model, ns, args.max_tokens))
            state_bytes = server.state_bytes()
        finally:
            server.stop()
    if "conversation" in parts:  # fresh servers: an empty cache, so its growth is the conversations'
        for label, extra in (("cache", ()), ("no_cache", ("--state-cache-mb", "0"))):
            server = Server(art, *common, *extra)
            try:
                state_bytes = server.state_bytes()
                convo, rss[label] = asyncio.run(conversations(server, model, args))
            finally:
                server.stop()
            if label == "cache":
                cached = convo
            else:
                uncached = convo

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
        reply = "16-token replies" if args.tokenizer == "bytes" else f"replies of {args.reply_tokens} tokens"
        print(f"\nA {args.turns}-turn chat to {cached[-1]['prompt_tokens']} prompt tokens, {reply}:\n")
        print(
            "| turn | prompt tokens | cached_tokens | reply re-encodes | TTFT ms, cache | "
            "TTFT ms, --state-cache-mb 0 | speed-up |"
        )
        print("|---|---|---|---|---|---|---|")
        for a, b in zip(cached, uncached):
            same = {True: "yes", False: "no", None: "-"}[a.get("reply_round_trips")]
            print(
                f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {same} | {a['ttft_ms']:.0f} | "
                f"{b['ttft_ms']:.0f} | {b['ttft_ms'] / a['ttft_ms']:.1f}x |"
            )
        if rss.get("cache") is not None:
            print(
                f"\nServer RSS growth per conversation ({args.rss_conversations} more chats run together after the "
                f"first): {rss['cache'] / MiB:.2f} MiB with the cache, {rss['no_cache'] / MiB:.2f} MiB without "
                f"(one stream's state: {state_bytes / MiB:.2f} MiB)"
            )
    ttft_cached = [a["ttft_ms"] for a in cached[1:]]
    print(
        json.dumps(
            with_cpu(
                {
                    "benchmark": "serve",
                    "model": {"name": args.model, **params},
                    "threads": args.threads,
                    "max_tokens": args.max_tokens,
                    "concurrency": rows,
                    "conversation": {"cache": cached, "no_cache": uncached},
                    "rss_growth_per_conversation": rss,
                    "tokenizer": args.tokenizer,
                    "last_turn_speedup": uncached[-1]["ttft_ms"] / cached[-1]["ttft_ms"] if cached else None,
                    "cached_ttft_ms_median_turns_2_on": statistics.median(ttft_cached)
                    if ttft_cached
                    else None,
                    "state_bytes": state_bytes,
                    "load_average": os.getloadavg(),
                }
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
