"""Speculative decoding against plain decoding at batch 1: decode tokens/s and tokens per graph call.

What it measures: for each task of ``benchmarks/speculative_tasks.json`` (prompt-grounded ones that quote,
rewrite or continue code or text given in the prompt, and free generation), greedy decoding of ``-n`` new
tokens from one artifact, plain (``Session.generate_ids``) and with ``speculative=`` each drafter of
``--drafters`` ("ngram", or a draft artifact's directory), in one process, interleaved (plain, drafter, ...,
then again), ``--repeats`` times. Decode time runs from the first generated token (the prompt's prefill is the
same call in both and is left out) to the last; the median per task is reported with

- tokens/s plain and speculative, and their ratio;
- tokens per call: tokens produced per verify call (plain decoding: 1);
- whether the speculative text equals the plain text (greedy: it must; sampled with prompt lookup's fixed
  drafts too, the same seed drawing the same tokens).

``--temperature T`` (with ``--seed``, ``--repetition-penalty``, ``--repetition-window``) samples instead of
greedy decoding: a small model's greedy text falls into loops that any drafter predicts.

The summary is the geometric mean of the ratios over the grounded tasks and over the free ones.

    python benchmarks/speculative.py ART [--chat] [--drafters ngram,DRAFT] [-n 128] [--threads 2] [--repeats 3]
    python benchmarks/speculative.py ART --quick      # two tasks, 24 tokens, one repeat: checks the harness

``--server 4,16``: instead, ``edgeattn serve ART --slots N`` in a subprocess without and with ``--speculative
ngram`` (``--repeats`` rounds of each, interleaved: medians and their ranges) (an artifact exported with ``--dynamic-batch``), driven by N concurrent clients of the official
``openai`` client, each streaming greedy completions of the tasks in turn (client i starts at task i): aggregate
tokens/s over the round (all tokens / wall time; every reply ``-n`` tokens long, ``ignore_eos``), per server and
number of clients, grounded and free tasks apart, and whether every text equals the plain server's.
``--kinds free`` (or ``grounded``) runs only the tasks of that kind.

``--llama GGUF --llama-bin DIR``: beside edgeattn, llama.cpp's own self-speculative decoding on the same prompts
(the GGUF the artifact was exported from): ``llama-speculative-simple --spec-type ngram-simple`` (prompt lookup),
greedy, with drafts and without (a lookup n-gram too long to match: the same loop and timer), built from
llama-cpp-python 0.3.36's vendored sources into DIR (``cmake -S vendor/llama.cpp -B DIR $(ggml_cmake_args)
-DLLAMA_BUILD_EXAMPLES=ON`` then ``cmake --build DIR --target llama-speculative-simple``), interleaved with
edgeattn's runs task by task. (``llama-completion`` decoded the same prompts 2-3x slower per token here, so it
is not the baseline.)

Rollback (issue 35 item 3): ``--rollbacks readvance,states`` runs each drafter once per way a partly rejected
round rolls back (``states`` only on an artifact exported with ``--verify-states``; ``auto``, the default, is
what a user gets), and ``--against ART2`` (repeatable) runs another artifact of the same model beside the first,
interleaved (its own plain decoding too): the column "vs first plain" divides by the first artifact's plain
tokens/s, so that a ``--verify-states`` export is compared with the export without it (its graph is not the same:
its plain decoding may pay for the extra outputs).

``--chat`` feeds each task's ``chat`` message through the artifact's chat template (an instruct model such
as SmolLM2-135M-Instruct), otherwise its ``raw`` prompt (a base model). Prints a markdown table, then one
JSON line.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

TASKS = Path(__file__).with_name("speculative_tasks.json")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def timed(sess, prompt_ids, n, speculative, sampling=None, rollback="auto"):
    """(tokens, decode seconds from the first token to the last, tokens per call or 1.0)."""
    sess.reset()
    sess.speculative_rollback = rollback
    out, first = [], None
    for tok in sess.generate_ids(prompt_ids, n, speculative=speculative, **(sampling or {"temperature": 0})):
        if first is None:
            first = time.perf_counter()
        out.append(tok)
    elapsed = time.perf_counter() - first if first is not None else 0.0
    per_call = sess.speculative_stats.mean_accepted if speculative is not None else 1.0
    return out, elapsed, per_call


def server_metrics(url: str) -> dict:
    """The server's step calls and (``--speculative``) drafted and kept tokens, from its /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = {}
    for key, name in (
        ("steps", "edgeattn_steps_total"),
        ("drafted", "edgeattn_speculative_drafted_total"),
        ("accepted", "edgeattn_speculative_accepted_total"),
    ):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        got[key] = int(float(m.group(1))) if m else 0
    return got


def serve_round(artifact, clients: int, prompts: list, n: int, threads: int, speculative: bool) -> dict:
    """One server (plain or ``--speculative ngram``), ``clients`` concurrent clients each streaming every prompt
    in turn from its own start: {"tok_s", "texts"} (texts by (client, prompt index))."""
    import asyncio
    import re
    import subprocess
    import sys
    import tempfile

    import openai

    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    extra = ["--speculative", "ngram"] if speculative else []
    cmd = [sys.executable, "-m", "edgeattn.cli.main", "serve", str(artifact), "--port", "0"]
    cmd += ["--slots", str(clients), "--threads", str(threads), "--state-cache-mb", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = None
        for _ in range(600):
            m = re.search(r"listening on (http://[\d.]+:\d+)", open(log.name).read())
            if m:
                url = m.group(1)
                break
            if proc.poll() is not None:
                raise SystemExit(f"edgeattn serve exited:\n{open(log.name).read()}")
            time.sleep(0.1)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = Path(artifact).resolve().name

        async def one(i):
            texts, tokens = {}, 0
            for j in range(len(prompts)):
                k = (i + j) % len(prompts)
                r = await client.completions.create(
                    model=model,
                    prompt=prompts[k],
                    max_tokens=n,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    # every reply max_tokens long on both servers: where their texts part (int4 at accuracy
                    # level 4), an end-of-sequence token would make them different amounts of work
                    extra_body={"ignore_eos": True},
                )
                parts = []
                async for ch in r:
                    if ch.choices:
                        parts.append(ch.choices[0].text)
                    if ch.usage:
                        tokens += ch.usage.completion_tokens
                texts[(i, k)] = "".join(parts)
            return texts, tokens

        async def all_clients():
            for _ in range(60):  # ready
                try:
                    await client.models.list()
                    break
                except openai.APIError:
                    await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            out = await asyncio.gather(*(one(i) for i in range(clients)))
            seconds = time.perf_counter() - t0
            await client.close()
            return out, seconds

        out, seconds = asyncio.run(all_clients())
        texts = {k: v for t, _ in out for k, v in t.items()}
        return {"tok_s": sum(tok for _, tok in out) / seconds, "texts": texts, **server_metrics(url)}
    finally:
        proc.terminate()
        proc.wait(30)


def server_main(args, tasks) -> None:
    """``--server``: plain against speculative servers at each number of clients (see the docstring)."""
    from edgeattn.runtimes import open_session

    tok = open_session(args.artifact, threads=1).tokenizer
    rows = []
    for clients in [int(c) for c in args.server.split(",")]:
        for kind in args.kinds:
            sel = [t for t in tasks if t["kind"] == kind]
            prompts = [tok.apply_chat_template(t["chat"]) if args.chat else t["raw"] for t in sel]
            runs = {False: [], True: []}
            for _ in range(args.repeats):  # interleaved: plain, speculative, plain, ...
                for speculative in (False, True):
                    runs[speculative].append(
                        serve_round(
                            args.artifact, clients, prompts, args.max_new_tokens, args.threads, speculative
                        )
                    )
            plain, spec = ([r["tok_s"] for r in runs[k]] for k in (False, True))
            rows.append(
                {
                    "clients": clients,
                    "kind": kind,
                    "plain_tok_s": round(statistics.median(plain), 1),
                    "spec_tok_s": round(statistics.median(spec), 1),
                    "speedup": round(statistics.median(spec) / statistics.median(plain), 3),
                    "plain_range": [round(min(plain), 1), round(max(plain), 1)],
                    "spec_range": [round(min(spec), 1), round(max(spec), 1)],
                    # each round's tokens/s, in the order run (plain and speculative interleaved)
                    "plain_rounds": [round(x, 1) for x in plain],
                    "spec_rounds": [round(x, 1) for x in spec],
                    "repeats": args.repeats,
                    "same_text": all(r["texts"] == runs[False][0]["texts"] for r in runs[True]),
                    # per round: the servers' step calls, and the speculative one's drafted and kept tokens
                    "plain_steps": [r["steps"] for r in runs[False]],
                    "spec_steps": [r["steps"] for r in runs[True]],
                    "drafted": [r["drafted"] for r in runs[True]],
                    "accepted": [r["accepted"] for r in runs[True]],
                }
            )
            print(rows[-1], flush=True)
    print(
        f"{args.artifact.name}, edgeattn serve, greedy, {args.threads} threads, {cpu_name()}, load {os.getloadavg()}"
    )
    print()
    print(
        "| clients | kind | plain tok/s [min-max] | speculative tok/s [min-max] | ratio of medians | same text "
        "| step calls plain / speculative | drafted / kept |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        (a, b), (c, d) = r["plain_range"], r["spec_range"]
        calls = f"{'+'.join(map(str, r['plain_steps']))} / {'+'.join(map(str, r['spec_steps']))}"
        kept = f"{'+'.join(map(str, r['drafted']))} / {'+'.join(map(str, r['accepted']))}"
        print(
            f"| {r['clients']} | {r['kind']} | {r['plain_tok_s']} [{a}-{b}] | {r['spec_tok_s']} [{c}-{d}] | "
            f"{r['speedup']:.2f}x | {r['same_text']} | {calls} | {kept} |"
        )
    print(
        json.dumps(
            {
                "benchmark": "speculative_serve",
                "artifact": str(args.artifact),
                "chat": args.chat,
                "threads": args.threads,
                "max_new_tokens": args.max_new_tokens,
                "cpu": cpu_name(),
                "load": os.getloadavg(),
                "rows": rows,
            }
        )
    )


LLAMA_NGRAM = "ngram-simple"  # llama.cpp's prompt-lookup drafter (common/speculative.cpp)


def llama_run(bin_dir: Path, gguf: Path, text: str, n: int, threads: int, drafts: bool) -> dict:
    """llama.cpp's own ``llama-speculative-simple --spec-type ngram-simple`` (self-speculative prompt lookup,
    greedy), built from the vendored sources (``--llama-bin``), on ``text`` (special tokens parsed, as the
    chat template writes them), about ``n`` new tokens; ``drafts`` False: the same program with a lookup
    n-gram of 1024 tokens, which never matches (no drafts: plain decoding through the same loop and timer).
    {"tok_s", "tokens", "drafted", "accepted"} from what it prints (decode only: the prompt timed apart)."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(gguf), "-f", f.name, "-n", str(n)]
        cmd += ["--temp", "0", "-t", str(threads), "-c", "4096", "--spec-type", LLAMA_NGRAM]
        cmd += [] if drafts else ["--spec-ngram-simple-size-n", "1024"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    d, a = re.search(r"n_drafted = (\d+)", log), re.search(r"n_accept  = (\d+)", log)
    if proc.returncode != 0 or not m or not d or not a:
        last = (log.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"{cmd[0]} failed ({proc.returncode}) or printed no decode timing: {last}")
    tokens, secs = int(m.group(1)), float(m.group(2))
    return {"tok_s": tokens / secs, "tokens": tokens, "drafted": int(d.group(1)), "accepted": int(a.group(1))}


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--against", type=Path, action="append", default=[], help="another artifact, interleaved")
    ap.add_argument("--rollbacks", default="auto", help="comma-separated: auto, readvance, states")
    ap.add_argument("--chat", action="store_true", help="the tasks' chat messages through the chat template")
    ap.add_argument("--drafters", default="ngram", help="comma-separated: ngram and/or draft artifacts")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tasks", type=Path, default=TASKS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kinds", default="grounded,free", help="comma-separated: the tasks' kinds to run")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled with --seed")
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--repetition-window", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server", default=None, help="comma-separated numbers of clients: the server instead")
    ap.add_argument("--llama", type=Path, default=None, help="a GGUF: llama.cpp plain and ngram beside")
    ap.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's built binaries (with --llama)")
    args = ap.parse_args()
    bins = ("llama-speculative-simple",)
    if args.llama is not None and (
        not args.llama.is_file()
        or args.llama_bin is None
        or not all((args.llama_bin / b).is_file() for b in bins)
    ):
        ap.error(f"--llama needs a GGUF file and --llama-bin, a folder with {' and '.join(bins)}")
    sampling = {
        "temperature": args.temperature,
        "repetition_penalty": args.repetition_penalty,
        "repetition_window": args.repetition_window,
        "seed": args.seed,
    }
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in ("grounded", "free") for k in kinds):
        ap.error(f"--kinds: comma-separated grounded, free; got {args.kinds!r}")
    args.kinds = kinds
    try:
        tasks = json.loads(args.tasks.read_text())["tasks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--tasks {args.tasks}: not a tasks file ({e})")
    if args.max_new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        ap.error("-n must be >= 2, --repeats and --threads >= 1")
    for a in [args.artifact, *args.against]:
        if not a.is_dir():
            ap.error(f"{a} is not an artifact directory")
    rollbacks = [r.strip() for r in args.rollbacks.split(",") if r.strip()]
    if not rollbacks or any(r not in ("auto", "readvance", "states") for r in rollbacks):
        ap.error(f"--rollbacks: comma-separated auto, readvance, states; got {args.rollbacks!r}")
    sessions = {}
    for a in [args.artifact, *args.against]:
        s = ap.open_session(a, threads=args.threads)  # not an artifact, or a damaged one: one line
        reason = s.speculative_refusal() if hasattr(s, "speculative_refusal") else "not onnxruntime"
        if reason:
            ap.error(reason)
        sessions[a] = s
    sess = sessions[args.artifact]
    tasks = [t for t in tasks if t["kind"] in args.kinds]
    if args.quick:
        tasks = [next(t for t in tasks if t["kind"] == k) for k in args.kinds]
        args.max_new_tokens, args.repeats = 24, 1
    if args.server:
        return server_main(args, tasks)
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    for d in drafters:
        if d != "ngram" and not Path(d).is_dir():
            ap.error(f"--drafters: {d!r} is neither 'ngram' nor an artifact directory")
    # a draft artifact is opened once (its own session, the same threads)
    opened = {
        d: d if d == "ngram" else ap.open_session(d, "--drafters", threads=args.threads) for d in drafters
    }
    tok = sess.tokenizer
    # (artifact, drafter, rollback): "states" only where the artifact has per-token states
    variants = [
        (a, d, r)
        for a, s in sessions.items()
        for d in drafters
        for r in rollbacks
        if r != "states" or s.manifest.verify_states
    ]
    rows, llama_rows = [], []
    llama = args.llama is not None
    for task in tasks:
        text = tok.apply_chat_template(task["chat"]) if args.chat else task["raw"]
        ids = tok.encode(text)
        for s in sessions.values():
            timed(s, ids, 4, None)  # warm-up
        plain_t = {a: [] for a in sessions}
        spec = {v: ([], []) for v in variants}
        want = {}
        same = {v: True for v in variants}
        for _ in range(args.repeats):
            for a, s in sessions.items():
                out, t, _ = timed(s, ids, args.max_new_tokens, None, sampling)
                want[a] = out
                plain_t[a].append((len(out) - 1) / max(t, 1e-9))
                for v in variants:
                    if v[0] != a:
                        continue
                    got, t, per_call = timed(s, ids, args.max_new_tokens, opened[v[1]], sampling, v[2])
                    same[v] &= got == out
                    spec[v][0].append((len(got) - 1) / max(t, 1e-9))
                    spec[v][1].append(per_call)
        if llama:  # the same prompt through llama.cpp, plain and self-speculative, interleaved
            runs = {k: [] for k in ("plain", "spec")}
            for _ in range(args.repeats):
                for k, drafts in (("plain", False), ("spec", True)):
                    runs[k].append(
                        llama_run(args.llama_bin, args.llama, text, args.max_new_tokens, args.threads, drafts)
                    )
            lp, ls = (statistics.median(r["tok_s"] for r in runs[k]) for k in ("plain", "spec"))
            last = runs["spec"][-1]
            llama_rows.append(
                {
                    "task": task["name"],
                    "kind": task["kind"],
                    "tokens": runs["plain"][-1]["tokens"],
                    "plain_tok_s": round(lp, 1),
                    "spec_tok_s": round(ls, 1),
                    "speedup": round(ls / lp, 3),
                    "accepted_per_drafted": round(last["accepted"] / max(last["drafted"], 1), 3),
                }
            )
        first = statistics.median(plain_t[args.artifact])
        for a, d, r in variants:
            plain, s = statistics.median(plain_t[a]), statistics.median(spec[a, d, r][0])
            label = d if d == "ngram" else Path(d).name
            rows.append(
                {
                    "task": task["name"],
                    "kind": task["kind"],
                    "artifact": a.name,
                    "drafter": label if r == "auto" else f"{label}/{r}",
                    "rollback": r,
                    "prompt_tokens": len(ids),
                    "tokens": len(want[a]),
                    "plain_tok_s": round(plain, 1),
                    "spec_tok_s": round(s, 1),
                    "speedup": round(s / plain, 3),
                    "vs_first_plain": round(s / first, 3),
                    "tokens_per_call": round(statistics.median(spec[a, d, r][1]), 2),
                    "same_text": same[a, d, r],
                }
            )
    how = "greedy" if args.temperature <= 0 else f"sampled {sampling}"
    print(
        f"{args.artifact.name}, batch 1, {how}, {args.threads} threads, {cpu_name()}, load {os.getloadavg()}"
    )
    print()
    several = len(sessions) > 1
    print(
        f"| task | kind |{' artifact |' if several else ''} drafter | tokens | plain tok/s | speculative tok/s | "
        f"ratio |{' vs first plain |' if several else ''} tokens/call | same text |"
    )
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if several else ""))
    for r in rows:
        art = f" {r['artifact']} |" if several else ""
        vs = f" {r['vs_first_plain']:.2f}x |" if several else ""
        print(
            f"| {r['task']} | {r['kind']} |{art} {r['drafter']} | {r['tokens']} | {r['plain_tok_s']} | "
            f"{r['spec_tok_s']} | {r['speedup']:.2f}x |{vs} {r['tokens_per_call']} | {r['same_text']} |"
        )
    summary = {}
    for a, d in sorted({(r["artifact"], r["drafter"]) for r in rows}):
        for kind in args.kinds:
            sel = [r for r in rows if r["artifact"] == a and r["drafter"] == d and r["kind"] == kind]
            summary[f"{a}/{d}/{kind}" if several else f"{d}/{kind}"] = {
                "speedup_geomean": round(geomean([r["speedup"] for r in sel]), 3),
                "vs_first_plain_geomean": round(geomean([r["vs_first_plain"] for r in sel]), 3),
                "tokens_per_call_mean": round(statistics.mean(r["tokens_per_call"] for r in sel), 2)
                if sel
                else None,
            }
    if llama:
        print()
        print(
            f"llama.cpp ({args.llama.name}): llama-speculative-simple --spec-type {LLAMA_NGRAM}, without and with drafts"
        )
        print()
        print("| task | kind | tokens | plain tok/s | ngram tok/s | ratio | accepted / drafted |")
        print("|---|---|---|---|---|---|---|")
        for r in llama_rows:
            print(
                f"| {r['task']} | {r['kind']} | {r['tokens']} | {r['plain_tok_s']} | {r['spec_tok_s']} | "
                f"{r['speedup']:.2f}x | {r['accepted_per_drafted']} |"
            )
        for kind in args.kinds:
            sel = [r for r in llama_rows if r["kind"] == kind]
            summary[f"llama.cpp-{LLAMA_NGRAM}/{kind}"] = {
                "speedup_geomean": round(geomean([r["speedup"] for r in sel]), 3),
                "tokens_per_call_mean": None,
            }
            # edgeattn's speculative tokens/s against llama.cpp's, each at its best (geomean over the tasks)
            mine = [
                r
                for r in rows
                if r["kind"] == kind and r["drafter"] == "ngram" and r["artifact"] == args.artifact.name
            ]
            if mine and sel:
                summary[f"edgeattn-ngram-vs-llama.cpp-{LLAMA_NGRAM}/{kind}"] = {
                    "speedup_geomean": round(
                        geomean([a["spec_tok_s"] / b["spec_tok_s"] for a, b in zip(mine, sel)]), 3
                    ),
                    "tokens_per_call_mean": None,
                }
    print()
    for k, v in sorted(summary.items()):
        print(f"{k}: {v['speedup_geomean']:.2f}x, {v['tokens_per_call_mean']} tokens per call")
    print(
        json.dumps(
            {
                "benchmark": "speculative",
                "artifact": str(args.artifact),
                "against": [str(a) for a in args.against],
                "chat": args.chat,
                "sampling": sampling,
                "threads": args.threads,
                "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats,
                "cpu": cpu_name(),
                "load": os.getloadavg(),
                "summary": summary,
                "rows": rows,
                "llama": {"gguf": str(args.llama), "spec_type": LLAMA_NGRAM, "rows": llama_rows}
                if llama
                else None,
            }
        )
    )


if __name__ == "__main__":
    main()
