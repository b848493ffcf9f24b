"""The serving engine without HTTP: greedy text equals a lone Session.generate alone, batched, with the
prompt prefilled in pieces and resumed from the prefix cache; stop strings, cancel, the queue; the prefix
cache's LRU, disk files and disk budget; artifacts that cannot batch served one at a time."""

import asyncio
import logging
import os

import numpy as np
import pytest

from edgeattn.runtimes import open_session
from edgeattn.serve.cache import PrefixCache, model_directory
from edgeattn.serve.engine import Engine, QueueFull, Request, ShuttingDown
from tests.serve_helpers import SERVE_PREFILL, export_tiny, greedy_ids, greedy_text, text_prompt


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _with_engine(art, body, **kw):
    engine = Engine(art, **kw)
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.stop(0)


def _ids(text: str) -> list[int]:
    return list(text.encode())


def test_greedy_alone_and_batched_equals_session_generate(serve_gla):
    # prompts across several prefill pieces (piece = 2 chunks), chunk-aligned and not, one of 1 token
    prompts = [text_prompt(n, i) for i, n in enumerate((1, 7, SERVE_PREFILL, 2 * SERVE_PREFILL + 3, 90, 41))]
    want = [greedy_text(serve_gla, p, 24) for p in prompts]

    async def body(engine):
        alone = await engine.submit(Request(_ids(prompts[4]), max_tokens=24, temperature=0)).text()
        handles = [engine.submit(Request(_ids(p), max_tokens=24, temperature=0)) for p in prompts]
        return alone, await asyncio.gather(*(h.text() for h in handles)), handles, engine.metrics["steps"]

    alone, batched, handles, steps = _run(
        _with_engine(serve_gla, body, slots=6, prefill_piece=2 * SERVE_PREFILL, cache_mb=0)
    )
    assert alone == want[4]
    assert batched == want
    assert all(h.finish_reason == "length" and h.completion_tokens == 24 for h in handles)
    assert steps < 24 + 6 * 24  # the six decoded together, not one after another


def test_cached_prefix_resumes_and_the_text_stays_exact(serve_gla):
    first = _ids(text_prompt(70, 1))
    reply = greedy_ids(serve_gla, first, 20)
    second = first + reply + _ids(text_prompt(23, 2))  # a next turn: the history, then new text
    want = greedy_text(serve_gla, second, 20)

    async def body(engine):
        h1 = engine.submit(Request(first, max_tokens=20, temperature=0))
        t1 = await h1.text()
        h2 = engine.submit(Request(second, max_tokens=20, temperature=0))
        t2 = await h2.text()
        h3 = engine.submit(Request(second, max_tokens=20, temperature=0))  # the same prompt again
        t3 = await h3.text()
        # every prompt's state and every reply's: the first prompt, its reply, the second prompt, its reply
        entry = engine.state_bytes + 4 * engine.manifest.vocab_size
        assert engine.cache.bytes == 4 * entry
        return t1, h1, t2, h2, t3, h3

    t1, h1, t2, h2, t3, h3 = _run(_with_engine(serve_gla, body, slots=2))
    assert t1 == greedy_text(serve_gla, first, 20) and h1.cached_tokens == 0
    assert h2.cached_tokens == len(first) + len(reply)  # the state after the first prompt and its reply
    assert t2 == want
    assert h3.cached_tokens == len(second) and t3 == want

    # the resumed state equals a fresh prefill up to rounding (other chunk boundaries, the reply stepped)
    sess = open_session(serve_gla)
    fresh = sess.prefill(np.array([second]))[0]
    sess.reset()
    sess.prefill(np.array([first]))
    for tok in reply:
        sess.step(np.array([[tok]]))
    resumed = sess.prefill(np.array([second[len(first) + len(reply) :]]))[0]
    assert np.abs(resumed - fresh).max() < 1e-4


def test_a_long_prompt_is_prefilled_between_the_steps_of_others(serve_gla):
    async def body(engine):
        short = engine.submit(Request(_ids("short"), max_tokens=60, temperature=0))
        first = await short.__anext__()  # the short one decodes
        long = engine.submit(Request(_ids(text_prompt(30 * SERVE_PREFILL, 3)), max_tokens=1, temperature=0))
        got = [first]
        async for piece in short:
            got.append(piece)
            if long.finish_reason is not None:
                break
        await long.text()
        return len("".join(got))

    # 30 pieces of prefill, a step of the short stream after each: it advances while the long one prefills
    advanced = _run(_with_engine(serve_gla, body, slots=2, prefill_piece=SERVE_PREFILL, cache_mb=0))
    assert advanced >= 20


def test_stop_strings_cancel_and_the_queue(serve_gla):
    prompt = text_prompt(12, 5)
    full = greedy_text(serve_gla, prompt, 40)
    stop = full[10:12]
    cut = full[: full.find(stop)]

    async def body(engine):
        h = engine.submit(Request(_ids(prompt), max_tokens=40, temperature=0, stop=[stop, "\x00never"]))
        text = await h.text()
        # slots 1, queue 1: a third request is refused; cancelling the running one frees its slot
        a = engine.submit(Request(_ids(prompt), max_tokens=10_000, temperature=0))
        b = engine.submit(Request(_ids(prompt), max_tokens=3, temperature=0))
        with pytest.raises(QueueFull):
            engine.submit(Request(_ids(prompt), max_tokens=3))
        await a.__anext__()
        a.cancel()
        await a.text()
        b_text = await b.text()
        with pytest.raises(ValueError, match="max-prompt-tokens"):
            engine.submit(Request(_ids(text_prompt(200, 0)), max_tokens=3))
        with pytest.raises(ValueError, match="max_tokens"):
            engine.submit(Request(_ids(prompt), max_tokens=0))
        with pytest.raises(ValueError, match="temperature"):
            engine.submit(Request(_ids(prompt), temperature=float("nan")))
        with pytest.raises(ValueError, match="token ids must lie"):
            engine.submit(Request([1, 999]))
        engine.begin_shutdown(0)
        with pytest.raises(ShuttingDown):
            engine.submit(Request(_ids(prompt)))
        return text, h, a, b_text

    text, h, a, b_text = _run(_with_engine(serve_gla, body, slots=1, max_queue=1, max_prompt_tokens=100))
    assert stop in full[:40] and text == cut and h.finish_reason == "stop"
    assert a.completion_tokens < 10_000 and a.finish_reason == "length"
    assert b_text == full[: len(b_text)] and len(b_text.encode()) == 3


def test_utf8_characters_are_never_split():
    from edgeattn.artifact.tokenizer import ByteTokenizer

    text = "a€b😀c"
    d = ByteTokenizer().decoder()
    pieces = [d.push(b) for b in text.encode()] + [d.flush()]
    assert "".join(pieces) == text
    assert [p for p in pieces if p] == list(text)  # each character whole, once complete


def _hf_tokenizers(tmp_path):
    """A byte-level BPE without merges (every multi-byte character split across tokens) and one trained
    with merges (tokens that end inside a character), as tokenizer.json files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    plain = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    trained = Tokenizer(models.BPE())
    for tok in (plain, trained):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, 日本語のテキスト, a€b😀c 😀😀 €€ ÿÿ"] * 20
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=264, initial_alphabet=alphabet))
    paths = []
    for name, tok in (("plain", plain), ("trained", trained)):
        paths.append(tmp_path / f"{name}.json")
        tok.save(str(paths[-1]))
    return paths


def _counted(decode, lengths: list):
    def counted(ids):
        lengths.append(len(ids))
        return decode(ids)

    return counted


def test_streamed_text_equals_decoding_the_whole_reply(tmp_path):
    from tokenizers import Tokenizer

    from edgeattn.artifact.tokenizer import HFTokenizer

    text = "héllo wörld, 日本語のテキスト: a€b😀c ÿ " * 30
    rng = np.random.default_rng(0)
    for path in _hf_tokenizers(tmp_path):
        ref = Tokenizer.from_file(str(path))  # the reference: the tokenizers library decoding at once
        tok = HFTokenizer(path, {})
        valid = ref.encode(text).ids
        assert any(ref.decode(valid[:k]).endswith("\ufffd") for k in range(len(valid)))  # split characters
        lengths = []  # of every id list the decoder decodes
        tok.decode = _counted(tok.decode, lengths)
        for ids in (valid, [int(i) for i in rng.integers(0, ref.get_vocab_size(), 400)]):
            lengths.clear()
            d = tok.decoder()
            pieces = [d.push(i) for i in ids] + [d.flush()]
            assert "".join(pieces) == ref.decode(ids)
            assert max(lengths) <= 16  # a window of the ids each time, never the whole reply
            if ids is valid:  # valid UTF-8: no piece holds a replacement character (a split one)
                assert not any("\ufffd" in piece for piece in pieces)


def test_prefix_cache_lru_and_disk(serve_gla, tmp_path, caplog):
    sess = open_session(serve_gla)
    m = sess.manifest
    shapes = {e.input: tuple(e.shape) for e in m.state}
    states = []
    for n in (5, 9, 14):
        sess.reset()
        logits = sess.prefill(np.arange(n)[None] % 200)[0]
        states.append((list(np.arange(n) % 200), sess.get_state(), logits))
    size = sum(a.nbytes for a in states[0][1].values()) + states[0][2].nbytes
    cache = PrefixCache(m.fingerprint, shapes, 2 * size)  # room for two entries
    for toks, st, lg in states:
        cache.put(toks, st, lg)
    assert cache.bytes == 2 * size and len(cache) == 2
    assert cache.lookup(list(range(5)) + [7]) is None  # the oldest (5 tokens) was evicted
    hit = cache.lookup(list(range(14)) + [1, 2])
    assert hit.n == 14 and np.array_equal(hit.logits, states[2][2])

    disk = PrefixCache(m.fingerprint, shapes, 0, tmp_path / "c")  # disk only
    for toks, st, lg in states:
        disk.put(toks, st, lg)
    files = sorted(disk.directory.iterdir())
    assert len(files) == 3
    again = PrefixCache(m.fingerprint, shapes, size, tmp_path / "c")  # "after a restart"
    hit = again.lookup(list(range(9)) + [3])
    assert hit.n == 9
    for name, a in states[1][1].items():
        np.testing.assert_array_equal(hit.state[name], a)
    # a flipped byte in the longest entry: skipped with one log line, the next longest used instead
    path = next(f for f in files if f.name.startswith("14-"))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))
    fresh = PrefixCache(m.fingerprint, shapes, size, tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        hit = fresh.lookup(list(range(14)))
    assert hit.n == 9
    assert len(caplog.records) == 1 and "corrupt" in caplog.records[0].getMessage()
    foreign = PrefixCache("0" * 64, shapes, size, tmp_path / "c")  # another model's cache: never used
    assert foreign.lookup(list(range(14))) is None


@pytest.mark.parametrize("kind", ["kv_buffer", "fixed_batch"])
def test_artifacts_that_cannot_batch_are_served_one_at_a_time(serve_root, kind):
    if kind == "kv_buffer":  # a hybrid with a softmax layer on a GroupQueryAttention KV buffer
        art = export_tiny(serve_root, "gated_deltanet,softmax", dynamic_batch=False, max_seq_len=160)
    else:
        art = export_tiny(serve_root, "gla", dynamic_batch=False)
    prompts = [text_prompt(n, i) for i, n in enumerate((20, 9, 35))]
    want = [greedy_text(art, p, 16) for p in prompts]
    second = _ids(prompts[0]) + greedy_ids(art, _ids(prompts[0]), 16) + _ids("more")

    async def body(engine):
        hs = [engine.submit(Request(_ids(p), max_tokens=16, temperature=0)) for p in prompts]
        texts = await asyncio.gather(*(h.text() for h in hs))
        h = engine.submit(Request(second, max_tokens=16, temperature=0))
        return engine, texts, await h.text(), h

    engine, texts, t2, h2 = _run(_with_engine(art, body, slots=4))
    assert engine.serial_reason and engine.slots == 1
    assert texts == want
    assert h2.cached_tokens == len(prompts[0]) + 16 and t2 == greedy_text(art, second, 16)
    if kind == "kv_buffer":
        assert engine.max_length is not None


def test_a_kv_buffer_hybrid_exported_with_a_dynamic_batch_is_batched(serve_root):
    # Gated DeltaNet + a softmax layer on a GroupQueryAttention KV buffer of 96 tokens
    art = export_tiny(serve_root, "gated_deltanet,softmax", max_seq_len=96)
    prompts = [text_prompt(n, 50 + i) for i, n in enumerate((12, 9, 35, 12))]  # two prefilled together
    want = [greedy_text(art, p, 16) for p in prompts]
    second = _ids(prompts[0]) + greedy_ids(art, _ids(prompts[0]), 16) + _ids("more")

    async def body(engine):
        hs = [engine.submit(Request(_ids(p), max_tokens=16, temperature=0)) for p in prompts]
        texts = await asyncio.gather(*(h.text() for h in hs))
        h = engine.submit(Request(second, max_tokens=16, temperature=0))
        t2 = await h.text()
        full = engine.submit(Request(_ids(prompts[2]), max_tokens=1000, temperature=0))  # 35 + 61 = 96
        await full.text()
        return engine, texts, t2, h, full, engine.metrics["steps"]

    engine, texts, t2, h2, full, steps = _run(_with_engine(art, body, slots=4))
    assert engine.serial_reason is None and engine.slots == 4
    assert texts == want
    assert h2.cached_tokens == len(prompts[0]) + 16 and t2 == greedy_text(art, second, 16)
    assert full.finish_reason == "length" and full.completion_tokens == 96 - 35
    assert full.usage["completion_tokens"] == 61


def test_ignore_eos_goes_on_past_end_of_sequence(serve_gla):
    # a byte-level model whose end-of-sequence id is a token it emits: the reply stops there, unless
    # ignore_eos (vLLM's extension) asks for max_tokens whatever comes
    art = serve_gla
    prompt = _ids(text_prompt(12, 77))
    free = greedy_ids(art, prompt, 12)
    eos = free[5]

    async def body(engine):
        engine.eos = frozenset([eos])
        a = engine.submit(Request(prompt, max_tokens=12, temperature=0))
        b = engine.submit(Request(prompt, max_tokens=12, temperature=0, ignore_eos=True))
        return await a.text(), a, await b.text(), b

    ta, a, tb, b = _run(_with_engine(art, body, slots=2, cache_mb=0))
    sess = open_session(art)
    want = list(sess.generate_ids(prompt, 12, temperature=0, stop_ids=[eos]))
    assert a.finish_reason == "stop" and a.completion_tokens == len(want) and len(want) <= 5
    assert ta == bytes(want).decode("utf-8", errors="replace")
    assert b.finish_reason == "length" and b.completion_tokens == 12
    assert tb == bytes(free).decode("utf-8", errors="replace")


def test_branches_resume_from_the_longest_shared_prefix(serve_gla):
    # issue 31.7: a regenerated reply, a prompt continued differently and a second user with the same system
    # prompt (a message boundary) resume from the cache, and their greedy text is the one without a cache
    C = SERVE_PREFILL
    system = _ids(text_prompt(3 * C + 5, 31))  # its boundary is cached at 3 C (a multiple of the chunk)
    first = system + _ids(text_prompt(20, 32))
    second = system + _ids(text_prompt(27, 33))
    longer = first + _ids("y = ")
    # the texts depend on the prompts: a state resumed from the wrong prefix would show
    assert len({greedy_text(serve_gla, p, 12) for p in (first, second, longer)}) == 3

    async def body(engine):
        # as if the replies were text that encodes back to their ids: the client could extend them
        engine.tokenizer.round_trips = lambda ids: True
        got = []
        for prompt in (first, first, longer, second):
            h = engine.submit(Request(prompt, max_tokens=12, temperature=0, boundaries=[len(system)]))
            got.append((await h.text(), h.cached_tokens))
        return got

    got = _run(_with_engine(serve_gla, body, slots=1))
    assert [n for _, n in got] == [0, len(first), len(first), 3 * C]
    assert [t for t, _ in got] == [greedy_text(serve_gla, p, 12) for p in (first, first, longer, second)]


def test_entries_a_conversation_left_behind_are_evicted_first():
    def state(v):
        return {"s": np.full((1, 4), v, np.float32)}

    logits = np.zeros(8, np.float32)
    entry = 4 * 4 + 8 * 4
    cache = PrefixCache("f" * 64, {"s": (1, 4)}, 5 * entry)  # room for five entries
    system = [1, 2, 3]
    cache.put(system, state(0), logits, boundary=True)
    turn1 = system + [4]
    cache.put(turn1, state(1), logits)  # the prompt
    cache.put(turn1 + [5], state(2), logits)  # its reply
    assert cache.lookup(turn1).n == 4 and cache.lookup(turn1 + [5, 6]).n == 5  # regenerate, next turn
    turn2 = turn1 + [5, 6]
    cache.put(turn2, state(3), logits, demote_below=5)  # resumed from the reply: turn 1's prompt is left
    cache.put(turn2 + [7], state(4), logits)
    assert len(cache) == 5 and cache.bytes == 5 * entry  # kept while there is room
    cache.put([9, 9], state(5), logits)  # another conversation: turn 1's prompt goes first
    assert cache.lookup(turn1 + [8]).n == 3  # the system prompt (a boundary) stays
    assert cache.lookup(turn1 + [5, 8]).n == 5  # the reply turn 2 resumed from stays
    assert cache.lookup(turn2 + [7, 1]).n == 7 and len(cache) == 5


# ---- the disk budget ----

SHAPES = {"s": (1, 256)}


def _entry(v: float) -> tuple[dict, np.ndarray]:
    return {"s": np.full((1, 256), v, np.float32)}, np.full(8, v, np.float32)


def _files(directory) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in directory.iterdir()}


def _sub(root, fingerprint: str = "f" * 64):
    """Where a cache on ``root`` keeps the state files of the model with ``fingerprint``."""
    return model_directory(root, fingerprint)


def _consistent(cache: PrefixCache) -> None:
    """Every indexed key is held (memory or disk), every file is indexed, the byte count is the files'."""
    indexed = set().union(*cache._lengths.values()) if cache._lengths else set()
    assert indexed == set(cache._mem) | set(cache._disk)
    assert {f.path.name for f in cache._disk.values()} == set(_files(cache.directory))
    assert cache.disk_bytes == sum(_files(cache.directory).values())


def test_the_disk_cache_stays_within_its_budget_least_recently_used_first(tmp_path):
    probe = PrefixCache("f" * 64, SHAPES, 0, tmp_path / "probe")
    probe.put([1], *_entry(1))
    size = probe.disk_bytes  # one file: every entry here has the same size
    assert size > 256 * 4
    budget = 3 * size + size // 2  # room for three files
    d = tmp_path / "c"
    cache = PrefixCache("f" * 64, SHAPES, 0, d, disk_capacity_bytes=budget)  # disk only: hits read the files
    for i in range(40):
        cache.put([i, i + 1], *_entry(i))
        assert sum(_files(_sub(d)).values()) <= budget
        _consistent(cache)
    assert len(_files(_sub(d))) == len(cache) == 3
    assert cache.lookup([0, 1, 5]) is None  # evicted: a miss, on disk and off

    cache.put([100], *_entry(100))  # A
    cache.put([101], *_entry(101))  # B
    cache.put([102], *_entry(102))  # C
    assert cache.lookup([100, 7]).n == 1  # A used: B is now the least recently used
    cache.put([103], *_entry(103))
    assert cache.lookup([101, 7]) is None
    for t in (100, 102, 103):
        hit = cache.lookup([t, 7])
        state, logits = _entry(t)
        np.testing.assert_array_equal(hit.state["s"], state["s"])
        np.testing.assert_array_equal(hit.logits, logits)
    _consistent(cache)

    # with memory too (two entries): a key evicted from the disk stays findable while in memory, not after
    both = PrefixCache("f" * 64, SHAPES, 2 * (256 + 8) * 4, tmp_path / "b", disk_capacity_bytes=size)
    both.put([200], *_entry(200))
    both.put([201], *_entry(201))  # the disk holds 201 only
    assert len(_files(_sub(tmp_path / "b"))) == 1 and len(both) == 2
    assert both.lookup([200, 1]).n == 1  # from memory
    both.put([202], *_entry(202))  # memory: 200 and 202 (201 leaves it, and is on disk no more)
    assert both.lookup([201, 1]) is None and both.lookup([200, 1]).n == 1
    _consistent(both)
    both.put([203], *_entry(203))
    both.put([204], *_entry(204))
    assert both.lookup([200, 1]) is None
    assert set(_files(_sub(tmp_path / "b"))) == {f"1-{both.key([204])}.state"}
    _consistent(both)


def test_a_restart_with_a_smaller_disk_budget_removes_the_oldest_files(tmp_path):
    d = tmp_path / "c"
    first = PrefixCache("f" * 64, SHAPES, 0, d)
    order = [5, 2, 7, 1, 9]  # by mtime, oldest first (not the names' order)
    for t in order:
        first.put([t, t], *_entry(t))
    size = max(_files(_sub(d)).values())
    for age, t in enumerate(order):
        os.utime(_sub(d) / f"2-{first.key([t, t])}.state", (1_000_000 + age, 1_000_000 + age))

    again = PrefixCache("f" * 64, SHAPES, 0, d, disk_capacity_bytes=3 * size)
    assert len(again) == 3 and sum(_files(_sub(d)).values()) <= 3 * size
    _consistent(again)
    for t in (5, 2):
        assert again.lookup([t, t, 0]) is None
    hit = again.lookup([7, 7, 0])  # the oldest kept; the hit makes it the most recently used (mtime too)
    np.testing.assert_array_equal(hit.state["s"], _entry(7)[0]["s"])

    last = PrefixCache("f" * 64, SHAPES, 0, d, disk_capacity_bytes=size)
    assert list(_files(_sub(d))) == [f"2-{first.key([7, 7])}.state"]
    assert last.lookup([7, 7]).n == 2 and last.lookup([9, 9]) is None


def test_an_entry_larger_than_the_disk_budget_is_kept_in_memory_only(tmp_path, caplog):
    d = tmp_path / "c"
    _sub(d).mkdir(parents=True)
    (_sub(d) / "notes.txt").write_text("not a state file: left alone")
    cache = PrefixCache("f" * 64, SHAPES, 10 * 2**20, d, disk_capacity_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        for t in range(5):
            cache.put([t], *_entry(t))
    assert list(_files(_sub(d))) == ["notes.txt"] and cache.disk_bytes == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "larger than the disk budget" in lines[0], lines
    assert cache.lookup([3, 4]).n == 1  # from memory

    # 0: nothing on disk (the state files found at start are removed, nothing else)
    PrefixCache("f" * 64, SHAPES, 0, tmp_path / "z").put([1], *_entry(1))
    assert len(_files(_sub(tmp_path / "z"))) == 1
    PrefixCache("f" * 64, SHAPES, 0, tmp_path / "z", disk_capacity_bytes=0)
    assert _files(_sub(tmp_path / "z")) == {}


def test_a_failed_disk_write_keeps_the_entry_in_memory_only(tmp_path, caplog, monkeypatch):
    cache = PrefixCache("f" * 64, SHAPES, (256 + 8) * 4, tmp_path / "c")  # memory for one entry
    cache.put([1], *_entry(1))

    def full(fd):  # the disk fills while the file is written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        cache.put([2], *_entry(2))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cannot write" in lines[0] and "No space left" in lines[0], lines
    assert "\n" not in lines[0]
    assert len(_files(_sub(tmp_path / "c"))) == 1  # no half-written file, no temporary
    assert cache.lookup([2, 0]).n == 1  # in memory
    _consistent(cache)
    monkeypatch.undo()
    cache.put([3], *_entry(3))  # 2 leaves memory: never written, it is a miss; 1 is still on disk
    assert cache.lookup([2, 0]) is None and cache.lookup([1, 0]).n == 1
    _consistent(cache)


def test_a_state_file_deleted_by_another_server_is_a_miss_then_forgotten(tmp_path, caplog):
    a = PrefixCache("f" * 64, SHAPES, 0, tmp_path / "c")
    a.put([1, 2], *_entry(1))
    b = PrefixCache("f" * 64, SHAPES, 0, tmp_path / "c")  # another replica on the same directory
    for f in _sub(tmp_path / "c").iterdir():
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        assert b.lookup([1, 2, 3]) is None
    assert len(caplog.records) == 1 and len(b) == 0 and b.disk_bytes == 0


def test_the_engine_and_the_ray_deployment_get_the_disk_budget(serve_gla, tmp_path):
    from edgeattn.cli.serve import DEFAULT_DISK_MB as CLI_DEFAULT
    from edgeattn.serve.cache import DEFAULT_DISK_MB

    assert CLI_DEFAULT == DEFAULT_DISK_MB
    engine = Engine(serve_gla, cache_dir=tmp_path / "c", cache_disk_mb=3)
    assert engine.cache.disk_capacity == 3 * 2**20 and engine.cache.root == tmp_path / "c"
    assert Engine(serve_gla).cache.disk_capacity == DEFAULT_DISK_MB * 2**20
    with pytest.raises(ValueError, match="disk"):
        Engine(serve_gla, cache_disk_mb=-1)
    pytest.importorskip("ray.serve")
    from edgeattn.serve.ray import build_deployment

    app = build_deployment(serve_gla, "m", None, replicas=4, cache_dir=tmp_path, cache_disk_mb=100)
    assert app._bound_deployment.init_args[3]["cache_disk_mb"] == 25  # one directory shared by 4


@pytest.mark.parametrize("kind", ["batched", "serial"])
def test_a_request_whose_sampling_fails_ends_alone(serve_root, serve_gla, kind):
    # issue 31.2: a seed numpy refuses (the stream cannot start) and a logit_bias id outside the vocabulary
    # (passed converted, so that only the first sample fails, inside a step) slipped past the checks: each
    # ends with its own error,
    # the requests beside them complete with Session.generate's text, the engine serves on
    art = serve_gla if kind == "batched" else export_tiny(serve_root, "gla", dynamic_batch=False)
    prompts = [text_prompt(n, 90 + i) for i, n in enumerate((20, 33, 9))]
    want = [greedy_text(art, p, 16) for p in prompts]

    async def body(engine):
        engine.check = lambda r: None  # as if the HTTP layer's validation had missed them
        good = [engine.submit(Request(_ids(p), max_tokens=16, temperature=0)) for p in prompts[:2]]
        bad = [
            engine.submit(Request(_ids("x"), max_tokens=16, seed=-1)),
            engine.submit(Request(_ids("y"), max_tokens=16, logit_bias=(np.array([10**6]), np.ones(1)))),
        ]
        texts = await asyncio.gather(*(h.text() for h in good))
        errors = []
        for h in bad:
            with pytest.raises(RuntimeError) as info:
                await h.text()
            errors.append(str(info.value))
        after = await engine.submit(Request(_ids(prompts[2]), max_tokens=16, temperature=0)).text()
        return texts, errors, after, engine.metrics["failed"]

    texts, errors, after, failed = _run(_with_engine(art, body, slots=4, cache_mb=0))
    assert texts == want[:2] and after == want[2]
    assert "sampling failed: seed must be an integer in [0, 2**63 - 1], got -1" in errors[0]
    assert "logit_bias token ids must lie in [0, 256)" in errors[1]
    assert failed == 2


def test_a_state_file_swapped_with_another_is_refused(tmp_path, caplog):
    # issue 31.6: two entries of the same length with their files swapped: each is refused, never used as
    # the other's state
    d = tmp_path / "c"
    first = PrefixCache("f" * 64, SHAPES, 0, d)
    first.put([1, 2], *_entry(1))
    first.put([3, 4], *_entry(3))
    a, b = (_sub(d) / f"2-{first.key(t)}.state" for t in ([1, 2], [3, 4]))
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    again = PrefixCache("f" * 64, SHAPES, 0, d)
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        assert again.lookup([1, 2, 9]) is None and again.lookup([3, 4, 9]) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("other tokens" in line for line in lines), lines
    assert _files(_sub(d)) == {}


def test_oversized_state_files_and_links_out_of_the_directory_are_never_read(tmp_path, caplog):
    # issue 31.11: a file's size is checked against what an entry of its length can be before it is read
    # or counted; a link that leaves the directory is skipped (not counted, not read, not removed)
    d = tmp_path / "c"
    cache = PrefixCache("f" * 64, SHAPES, 0, d, vocab_size=8)
    cache.put([1, 2], *_entry(1))
    cache.put([3, 4], *_entry(3))
    bound = cache.max_file_bytes(2)
    assert max(_files(_sub(d)).values()) <= bound < 64 * 2**20
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(64 * 2**20)  # sparse: nothing written
    (_sub(d) / f"5-{cache.key([5] * 5)}.state").symlink_to(big)
    with open(_sub(d) / f"6-{cache.key([6] * 6)}.state", "wb") as f:
        f.truncate(64 * 2**20)
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        again = PrefixCache("f" * 64, SHAPES, 0, d, vocab_size=8)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and any("leaves" in line for line in lines), lines
    assert any("more than an entry of 6 tokens" in line for line in lines), lines
    assert len(again) == 2 and again.disk_bytes == sum(f.stat().st_size for f in _sub(d).glob("2-*"))
    assert big.exists() and (_sub(d) / f"5-{cache.key([5] * 5)}.state").is_symlink()
    # a file that grew after the index: refused from its size, before it is read
    grown = _sub(d) / f"2-{cache.key([3, 4])}.state"
    with open(grown, "r+b") as f:
        f.truncate(64 * 2**20)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgeattn.serve"):
        assert again.lookup([3, 4, 0]) is None
    assert len(caplog.records) == 1 and "more than a state of this size" in caplog.records[0].getMessage()


def test_servers_of_two_models_sharing_a_directory_keep_to_their_own_files(tmp_path):
    # issue 31.12: one subdirectory per model; each cache counts and trims its own files only
    d = tmp_path / "c"
    a = PrefixCache("a" * 64, SHAPES, 0, d)
    for t in range(3):
        a.put([t], *_entry(t))
    size = max(_files(_sub(d, "a" * 64)).values())
    b = PrefixCache("b" * 64, SHAPES, 0, d, disk_capacity_bytes=size)
    assert b.disk_bytes == 0 and len(_files(_sub(d, "a" * 64))) == 3
    for t in range(3):
        b.put([t], *_entry(10 + t))
    assert len(_files(_sub(d, "b" * 64))) == 1 and len(_files(_sub(d, "a" * 64))) == 3
    again = PrefixCache("a" * 64, SHAPES, 0, d)
    assert again.disk_bytes == 3 * size and again.lookup([2, 0]).n == 1
    np.testing.assert_array_equal(again.lookup([2, 0]).state["s"], _entry(2)[0]["s"])


def test_int8_kv_states_are_cached_as_their_filled_int8_slots(serve_root, tmp_path):
    # issue 37.1: an int8 KV buffer's entry holds its filled slots in int8 (in memory and on disk), not the
    # whole buffer in float32; a turn resumed from it (after a restart too) gives the text without a cache;
    # the start-up lines say how many conversations the cache holds, and warn below the slots
    import json
    import struct

    from edgeattn.export import export_model
    from edgeattn.serve.server import startup_lines
    from tests.export_helpers import make_checkpoint

    ckpt = serve_root / "ckpt_gated_deltanet_softmax_max_seq_len96"  # export_tiny's, shared
    if not ckpt.exists():
        make_checkpoint(ckpt, "gated_deltanet,softmax", max_seq_len=96)
    art = serve_root / "int8kv"
    if not art.exists():
        export_model(
            ckpt,
            art,
            prefill_chunk=SERVE_PREFILL,
            dynamic_batch=True,
            kv_dtype="int8",
        )
    prompt = _ids(text_prompt(21, 90))
    reply = greedy_ids(art, prompt, 8)
    second = prompt + reply + _ids("next")

    def entry_bytes(m, n):  # from the manifest: the int8 buffers' n slots, the rest float32, the logits
        total = 4 * m.vocab_size
        for e in m.state:
            shape = list(e.shape)
            if e.dtype == "int8":
                shape[2] = n
            total += np.dtype(e.dtype).itemsize * int(np.prod(shape))
        return total

    async def body(engine):
        h = engine.submit(Request(prompt, max_tokens=8, temperature=0, ignore_eos=True))
        return await h.text(), engine.cache.bytes, engine

    text, held, engine = _run(_with_engine(art, body, slots=2, cache_dir=tmp_path / "c"))
    m = engine.manifest
    assert any(e.dtype == "int8" for e in m.state) and text == greedy_text(art, prompt, 8)
    assert held == entry_bytes(m, len(prompt)) + entry_bytes(m, len(prompt) + 8)
    for f in engine.cache.directory.iterdir():
        n = int(f.name.split("-")[0])
        raw = f.read_bytes()
        header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
        kv = [v for k, v in header.items() if k != "__metadata__" and v["dtype"] == "I8"]
        assert kv and all(v["shape"][2] == n for v in kv)
        assert len(raw) < entry_bytes(m, n) + 4096

    async def resume(engine):
        h = engine.submit(Request(second, max_tokens=8, temperature=0))
        return await h.text(), h.cached_tokens

    got, cached = _run(_with_engine(art, resume, slots=2, cache_dir=tmp_path / "c"))  # a restart
    assert cached == len(prompt) + 8 and got == greedy_text(art, second, 8)

    full = entry_bytes(m, m.max_length)
    lines = startup_lines(Engine(art, slots=4, cache_mb=2 * full * 3 / 2**20), "m")
    assert any("holds 3 conversation(s)" in line for line in lines), lines
    assert any(
        "warning" in line and "fewer conversations (3) than there are slots (4)" in line for line in lines
    )
    lines = startup_lines(Engine(art, slots=2, cache_mb=2 * full * 3 / 2**20), "m")
    assert not any("warning" in line for line in lines)
