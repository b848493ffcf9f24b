"""Speculative decoding (edgeattn.runtimes.speculative): the same tokens as plain decoding, the same state after,
the target's distribution when sampling, on every family with a state and a softmax hybrid's KV buffer.

Random tiny models write text that ignores the prompt, so prompt lookup alone would rarely draft and never
test rollback: a crafted drafter that knows plain decoding's output forces every kind of round (all drafts
kept, a wrong draft in the middle, a wrong first draft, drafts that run past a stop token)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edgeattn.export import export_model
from edgeattn.runtimes import open_session
from edgeattn.runtimes import speculative as spec
from tests.export_helpers import PREFILL, make_checkpoint

FAMILIES = ["gla", "gated_deltanet", "mamba2", "gla,softmax"]
PROMPT = list(b"def f(x):\n    return x + 1\n\ndef f(x):\n    return")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for mixer in FAMILIES:
        d = root / mixer.replace(",", "_")
        ckpt = make_checkpoint(d / "ckpt", mixer)
        # verifying reads every drafted position's logits: --prefill-logits all (the default, last, is refused)
        out[mixer] = export_model(
            ckpt, d / "art", prefill_chunk=PREFILL, include_checkpoint=False, prefill_logits="all"
        )
    return out


class Oracle:
    """Drafts from a known continuation of the prompt, wrong on purpose by a cycle of patterns: all right, wrong
    at the third draft, wrong at the first. Records the kinds of rounds the target saw."""

    PATTERNS = ("right", "third wrong", "first wrong")

    def __init__(self, prompt, truth, vocab):
        self.schedule = spec.FixedSchedule(4)
        self.prompt, self.truth, self.vocab = list(prompt), list(truth), vocab
        self.round = 0
        self.seen = set()

    def propose(self, context, k, dec=None):
        n = len(context) - len(self.prompt)
        assert context[: len(self.prompt)] == self.prompt and context[len(self.prompt) :] == self.truth[:n]
        drafts = self.truth[n : n + k]
        pattern = self.PATTERNS[self.round % len(self.PATTERNS)]
        self.round += 1
        wrong = {"right": None, "third wrong": 2, "first wrong": 0}[pattern]
        if wrong is not None and wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            self.seen.add(pattern)
        elif drafts:
            self.seen.add("right" if len(drafts) == k else "past the end")
        return drafts, None


def plain(sess, prompt, n, **kw):
    sess.reset()
    out = list(sess.generate_ids(prompt, n, **kw))
    return out, sess.get_state(), sess.position


def speculative(sess, prompt, n, drafter, **kw):
    sess.reset()
    out = list(sess.generate_ids(prompt, n, speculative=drafter, **kw))
    return out, sess.get_state(), sess.position


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("mixer", FAMILIES)
def test_greedy_same_tokens_and_state_every_kind_of_round(artifacts, mixer):
    sess = open_session(artifacts[mixer], threads=1)
    want, state, position = plain(sess, PROMPT, 48, temperature=0, stop_ids=())
    oracle = Oracle(PROMPT, want + [0] * 32, sess.manifest.vocab_size)
    got, got_state, got_position = speculative(sess, PROMPT, 48, oracle, temperature=0, stop_ids=())
    assert got == want
    assert got_position == position == len(PROMPT) + 48
    assert_same_state(got_state, state)
    assert {"right", "third wrong", "first wrong"} <= oracle.seen
    stats = sess.speculative_stats
    assert stats.tokens == 48 and stats.rounds < 48 and 0 < stats.accepted < stats.drafted
    # the state continues exactly: one more plain step from each gives the same logits
    tok = np.array([[want[-1]]])
    a = sess.step(tok)
    sess.set_state(state, position=position)
    np.testing.assert_allclose(sess.step(tok), a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ["gla", "gla,softmax"])
def test_greedy_stop_token_inside_the_drafts(artifacts, mixer):
    """A stop token chosen in the middle of a round: not yielded, consumed into the state as plain decoding's."""
    sess = open_session(artifacts[mixer], threads=1)
    free, _, _ = plain(sess, PROMPT, 30, temperature=0, stop_ids=())
    stop = free[17]
    want, state, position = plain(sess, PROMPT, 30, temperature=0, stop_ids=(stop,))
    assert len(want) < 30 and stop not in want
    oracle = Oracle(PROMPT, free, sess.manifest.vocab_size)
    oracle.PATTERNS = ("right",)
    got, got_state, got_position = speculative(sess, PROMPT, 30, oracle, temperature=0, stop_ids=(stop,))
    assert got == want and got_position == position
    assert_same_state(got_state, state)


@pytest.mark.parametrize("mixer", FAMILIES)
def test_ngram_greedy_same_tokens(artifacts, mixer):
    sess = open_session(artifacts[mixer], threads=1)
    prompt = list(b"abcabcabcabc hello hello hello ")
    want, state, position = plain(sess, prompt, 60, temperature=0, stop_ids=())
    got, got_state, got_position = speculative(sess, prompt, 60, "ngram", temperature=0, stop_ids=())
    assert got == want and got_position == position
    assert_same_state(got_state, state)


def test_sampling_with_fixed_drafts_draws_plain_samplings_tokens(artifacts):
    """Fixed drafts (prompt lookup, the oracle): each position's token is drawn from the target with the stream's
    generator, so a seed gives plain sampling's tokens, repetition penalty and top-k included."""
    sess = open_session(artifacts["gla,softmax"], threads=1)
    kw = dict(
        temperature=0.8,
        top_k=40,
        seed=3,
        stop_ids=(),
        repetition_penalty=1.2,
        repetition_window=16,
        logit_bias={32: 3.0, 101: -2.0},
    )
    want, state, _ = plain(sess, PROMPT, 40, **kw)
    oracle = Oracle(PROMPT, want + [0] * 32, sess.manifest.vocab_size)
    got, got_state, _ = speculative(sess, PROMPT, 40, oracle, **kw)
    assert got == want
    assert_same_state(got_state, state)
    assert speculative(sess, PROMPT, 40, "ngram", **kw)[0] == want


# ---- rollback by the verify call's per-token states (export option verify_states) ----

STEPS_FAMILIES = {  # mixer -> checkpoint options: a gated recurrence, a linearized form, a KV-buffer hybrid
    "gla": {},
    "hedgehog_window": {"feature_dim": 8, "window": 3},
    "gla,softmax": {},
}


@pytest.fixture(scope="module")
def steps_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    out = {}
    for mixer, kw in STEPS_FAMILIES.items():
        d = root / mixer.replace(",", "_")
        ckpt = make_checkpoint(d / "ckpt", mixer, **kw)  # the default last-token logits, with logits_count
        out[mixer] = export_model(
            ckpt, d / "art", prefill_chunk=PREFILL, include_checkpoint=False, verify_states=True
        )
    return out


@pytest.mark.parametrize("mixer", list(STEPS_FAMILIES))
def test_layer_steps_equal_the_state_after_each_prefix(mixer):
    """A mixer's per-token states (``last_steps``, the closed form the graph traces) against its own forward
    run on each prefix of the call (the recurrence itself), from a state that already holds tokens."""
    import torch

    from edgeattn.models import EdgeLM
    from tests.export_helpers import tiny_config

    torch.manual_seed(0)
    first = mixer.split(",")[0]
    for kw in [STEPS_FAMILIES[mixer]] + (
        [{"feature_dim": 8, "window": 9}] if first == "hedgehog_window" else []
    ):
        layer = EdgeLM(tiny_config(first, **kw)).eval().mixers[0]
        d = layer.cfg.d_model
        with torch.no_grad():
            _, state = layer(torch.randn(2, 5, d))
            x = torch.randn(2, 6, d)
            layer.emit_steps = True
            layer(x, state)
            steps, layer.emit_steps = layer.last_steps, False
            for t in range(6):
                _, want = layer(x[:, : t + 1], state)
                assert steps.keys() == want.keys()
                for name in want:
                    torch.testing.assert_close(steps[name][:, t], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", list(STEPS_FAMILIES))
def test_rollback_by_states_same_tokens_and_state_without_readvancing(steps_artifacts, mixer):
    sess = open_session(steps_artifacts[mixer], threads=1)
    assert sess.manifest.verify_states
    want, state, position = plain(sess, PROMPT, 48, temperature=0, stop_ids=())
    for rollback in ("readvance", "states"):
        sess.speculative_rollback = rollback
        oracle = Oracle(PROMPT, want + [0] * 32, sess.manifest.vocab_size)
        got, got_state, got_position = speculative(sess, PROMPT, 48, oracle, temperature=0, stop_ids=())
        assert got == want and got_position == position
        assert_same_state(got_state, state)
        assert {"right", "third wrong", "first wrong"} <= oracle.seen
        stats = sess.speculative_stats
        assert 0 < stats.accepted < stats.drafted
        assert (stats.readvanced == 0) == (rollback == "states")
    # sampled, fixed drafts: plain sampling's tokens with the same seed
    kw = dict(temperature=0.8, top_k=40, seed=3, stop_ids=(), repetition_penalty=1.2, repetition_window=16)
    sess.speculative_rollback = "auto"  # states, on this artifact
    want, state, _ = plain(sess, PROMPT, 40, **kw)
    got, got_state, _ = speculative(
        sess, PROMPT, 40, Oracle(PROMPT, want + [0] * 32, sess.manifest.vocab_size), **kw
    )
    assert got == want and sess.speculative_stats.readvanced == 0
    assert_same_state(got_state, state)


def test_verify_states_refusals(tmp_path, steps_artifacts, artifacts):
    with pytest.raises(ValueError, match=r"layer 0 \(gated_deltanet\) cannot give its"):
        export_model(
            make_checkpoint(tmp_path / "d", "gated_deltanet"), tmp_path / "d-art", verify_states=True
        )
    with pytest.raises(ValueError, match="verify_states adds outputs to the one graph"):
        export_model(
            make_checkpoint(tmp_path / "p", "gla"), tmp_path / "p-art", target="portable", verify_states=True
        )
    assert not (tmp_path / "d-art").exists() and not (tmp_path / "p-art").exists()
    import typer
    from typer.testing import CliRunner

    from edgeattn.cli import export as export_cli

    app = typer.Typer()
    export_cli.register(app)
    res = CliRunner().invoke(app, [str(tmp_path / "d"), "--out", str(tmp_path / "d-cli"), "--verify-states"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert res.output.strip().startswith("error: verify_states: layer 0 (gated_deltanet)"), res.output
    assert not (tmp_path / "d-cli").exists()
    sess = open_session(artifacts["gla"], threads=1)  # exported without the option
    sess.speculative_rollback = "states"
    with pytest.raises(ValueError, match="exported with --verify-states"):
        list(sess.generate_ids(PROMPT, 4, speculative="ngram"))
    sess.speculative_rollback = "backwards"
    with pytest.raises(ValueError, match="rollback must be one of"):
        list(sess.generate_ids(PROMPT, 4, speculative="ngram"))
    # a manifest whose KV buffer claims per-token states is refused when loaded
    import shutil

    art = shutil.copytree(steps_artifacts["gla,softmax"], tmp_path / "edited")
    m = json.loads((art / "edgeattn.json").read_text())
    next(e for e in m["state"] if e.get("shared"))["steps"] = "present.1.key.steps"
    (art / "edgeattn.json").write_text(json.dumps(m))
    with pytest.raises(
        ValueError,
        match=r"steps' must be the name of a graph output, on a state tensor that is not a shared KV buffer",
    ):
        open_session(art)


# ---- the rejection rule against the exact distribution, on a vocabulary of 4 ----

VOCAB, LENGTH, TEMPERATURE = 4, 3, 1.0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec4")
    arts = []
    for name, seed in (("target", 0), ("draft", 5)):
        ckpt = make_checkpoint(root / f"{name}-ckpt", "gla", seed=seed, vocab_size=VOCAB)
        arts.append(
            export_model(
                ckpt, root / name, prefill_chunk=PREFILL, include_checkpoint=False, prefill_logits="all"
            )
        )
    return arts


def exact_distribution(sess, prompt):
    """P(first LENGTH tokens) under plain sampling, by enumerating every sequence."""
    probs = {}

    def walk(seq, p, logits):
        if len(seq) == LENGTH:
            probs[tuple(seq)] = p
            return
        z = logits.astype(np.float64) / TEMPERATURE
        q = np.exp(z - z.max())
        q /= q.sum()
        state, pos = sess.get_state(), sess.position
        for t in range(VOCAB):
            sess.set_state(state, position=pos)
            walk(seq + [t], p * q[t], sess.step(np.array([[t]]))[0] if len(seq) + 1 < LENGTH else None)

    sess.reset()
    walk([], 1.0, sess.prefill(np.array([prompt]))[0])
    return probs


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic with the cells of expected count < 5 pooled, and its degrees of freedom."""
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat, df = stat + (o - e) ** 2 / e, df + 1
    if pool_e > 0:
        stat, df = stat + (pool_o - pool_e) ** 2 / pool_e, df + 1
    return stat, df


def critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def sample_counts(sess, draft, n):
    """Outcomes of ``n`` seeds, two drafts per round (the draft model samples them: its q is not one-hot)."""
    draft = spec.ModelDrafter(draft, sess)
    draft.schedule = spec.FixedSchedule(2)
    counts = {}
    for seed in range(n):
        sess.reset()
        out = list(
            sess.generate_ids(
                PROMPT_4, LENGTH, temperature=TEMPERATURE, seed=seed, stop_ids=(), speculative=draft
            )
        )
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


PROMPT_4 = [1, 2, 3, 0, 1, 2]
N_SAMPLES = 1500


def test_draft_model_sampling_is_the_targets_distribution(small_vocab):
    target, draft = (open_session(a, threads=1) for a in small_vocab)
    probs = exact_distribution(target, PROMPT_4)
    counts = sample_counts(target, draft, N_SAMPLES)
    assert target.speculative_stats.drafted > 0
    stat, df = chi_square(counts, probs, N_SAMPLES)
    assert stat < critical(df), (stat, df)


def test_chi_square_detects_a_wrong_rule(small_vocab, monkeypatch):
    """The test above can fail: keeping every sampled draft gives the draft's distribution, which it rejects."""
    target, draft = (open_session(a, threads=1) for a in small_vocab)
    probs = exact_distribution(target, PROMPT_4)
    monkeypatch.setattr(spec, "_choose", lambda dec, logits, d, q: dec.take(d))
    counts = sample_counts(target, draft, N_SAMPLES)
    stat, df = chi_square(counts, probs, N_SAMPLES)
    assert stat > critical(df), (stat, df)


def test_refusals(tmp_path, artifacts):
    sess = open_session(artifacts["gla"], threads=1)
    with pytest.raises(ValueError, match="'ngram' or a draft artifact"):
        list(sess.generate_ids(PROMPT, 4, speculative=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="speculative must be"):
        list(sess.generate_ids(PROMPT, 4, speculative=3))
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", vocab_size=128)
    other = export_model(ckpt, tmp_path / "other", prefill_chunk=PREFILL, include_checkpoint=False)
    with pytest.raises(ValueError, match="another tokenizer"):
        list(sess.generate_ids(PROMPT, 4, speculative=str(other)))
    last = export_model(  # the default: last-token logits
        make_checkpoint(tmp_path / "c2", "gla"),
        tmp_path / "last",
        prefill_chunk=PREFILL,
        include_checkpoint=False,
    )
    assert open_session(last).manifest.prefill_logits == "last"  # the default
    # its logits_count input gives the verify call every position's logits; an older export without it
    # (its manifest names none) is refused
    sess_last = open_session(last, threads=1)
    assert list(sess_last.generate_ids(PROMPT, 12, temperature=0, speculative="ngram")) == list(
        open_session(last, threads=1).generate_ids(PROMPT, 12, temperature=0)
    )
    m = json.loads((last / "edgeattn.json").read_text())
    del m["logits_count"]
    (last / "edgeattn.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="no logits_count input"):
        list(open_session(last, threads=1).generate_ids(PROMPT, 4, speculative="ngram"))
    two = export_model(
        make_checkpoint(tmp_path / "c3", "gla"),
        tmp_path / "two",
        prefill_chunk=PREFILL,
        include_checkpoint=False,
        one_graph=False,
    )
    with pytest.raises(ValueError, match="one-graph artifact"):
        list(open_session(two, threads=1).generate_ids(PROMPT, 4, speculative="ngram"))


def test_cli_run_speculative(artifacts, tmp_path):
    import typer
    from typer.testing import CliRunner

    from edgeattn.cli import run

    app = typer.Typer()
    run.register(app)
    runner = CliRunner()
    art = str(artifacts["gla,softmax"])
    args = [art, "--prompt", "abcabcabc hello hello hello ", "-n", "40", "--temperature", "0"]
    want = runner.invoke(app, args)
    assert want.exit_code == 0, want.output
    for draft in ("ngram", str(artifacts["gla"])):
        got = runner.invoke(app, [*args, "--speculative", draft])
        assert got.exit_code == 0, got.output
        assert got.stdout == want.stdout and "tokens per call" in got.stderr
    bad = runner.invoke(app, [*args, "--speculative", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and bad.output.strip().startswith("error: --speculative must be")


def test_benchmark_quick(artifacts):
    """benchmarks/speculative.py --quick runs and ends with its JSON line (the same greedy text in every row)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "speculative.py"),
            str(artifacts["gla"]),
            "--quick",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "speculative" and {r["kind"] for r in out["rows"]} == {"grounded", "free"}
    assert all(r["same_text"] for r in out["rows"])


# ---- serving: Streams.step_speculative (drafts per stream, the batch verified in one call) ----

STREAM_FAMILIES = ["gla", "mamba2", "gla,softmax"]
STREAM_PROMPTS = [PROMPT, PROMPT[:20], list(b"abcabcabcab"), list(b"xyz")]
STREAM_TOKENS = [24, 17, 30, 9]  # different lengths: rows leave the batch at different calls


@pytest.fixture(scope="module")
def batch_artifacts(serve_root):
    from tests.serve_helpers import export_tiny

    return {m: export_tiny(serve_root, m, prefill_logits="all") for m in STREAM_FAMILIES}


def run_streams(art, temperature, drafters=None, stop=None):
    """Every prompt of STREAM_PROMPTS as a stream of one ``Streams``, stepped to the end (plain, or speculative
    with ``drafters``, one per stream); each stream's tokens, state and next logits, and the graph calls."""
    from edgeattn.runtimes.streams import Streams

    s = Streams(art, threads=1)
    sids = [
        s.add(
            p,
            temperature=temperature,
            seed=i,
            max_new_tokens=n,
            stop_ids=() if stop is None or i else (stop,),
            speculative=None if drafters is None else drafters[i],
        )
        for i, (p, n) in enumerate(zip(STREAM_PROMPTS, STREAM_TOKENS))
    ]
    calls = 0
    while s.live:
        s.step() if drafters is None else s.step_speculative()
        calls += 1
    return [s.generated(x) for x in sids], [s.get_state(x) for x in sids], [s.logits(x) for x in sids], calls


@pytest.mark.parametrize("temperature", [0, 0.9])
@pytest.mark.parametrize("mixer", STREAM_FAMILIES)
def test_streams_speculative_same_tokens_state_and_logits(batch_artifacts, mixer, temperature):
    """Four streams of different lengths drafted by the oracle (all kept, wrong in the middle, wrong first, rows
    padded to the longest), one verify call per round: each stream's tokens (greedy; sampled, the same seed's),
    final state and next logits are plain ``Streams.step``'s. With a KV buffer (GroupQueryAttention takes
    several tokens with a past at batch 1 only) a stream drafts only while it is alone in the batch."""
    art = batch_artifacts[mixer]
    free = run_streams(art, temperature)[0]
    stop = free[0][11]  # stream 0 also stops at a token inside its drafts
    want, states, logits, plain_calls = run_streams(art, temperature, stop=stop)
    assert len(want[0]) < STREAM_TOKENS[0]
    V = open_session(art).manifest.vocab_size
    oracles = [Oracle(p, f + [0] * 32, V) for p, f in zip(STREAM_PROMPTS, free)]
    got, got_states, got_logits, calls = run_streams(art, temperature, oracles, stop=stop)
    assert got == want
    for a, b in zip(got_states, states):
        assert_same_state(a, b)
    for a, b in zip(got_logits, logits):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    seen = set().union(*(o.seen for o in oracles))
    assert {"right", "third wrong", "first wrong"} <= seen
    assert calls < plain_calls


class WrongOnce:
    """Two drafts in the first round only, the second wrong: the row keeps one and feeds three tokens again."""

    def __init__(self, prompt, truth, vocab):
        self.schedule = spec.FixedSchedule(2)
        self.prompt, self.truth, self.vocab, self.used = list(prompt), list(truth), vocab, False

    def propose(self, context, k, dec=None):
        if self.used:
            return [], None
        self.used = True
        n = len(context) - len(self.prompt)
        drafts = self.truth[n : n + 2]
        drafts[1] = (drafts[1] + 1) % self.vocab
        return drafts, None


def test_streams_calls_without_drafts_pad_nothing(batch_artifacts):
    """After a round that leaves the rows different numbers of tokens to feed, the calls without drafts feed the
    fewest any row has: no row is padded and sent back, so the calls come back to one token. (Padding them made
    the padded rows feed again next call, padding the others in turn: two-token calls for good, 25% slower free
    generation in a 4-stream server.)"""
    from edgeattn.runtimes.streams import Streams

    art = batch_artifacts["gla"]
    want = run_streams(art, 0)[0]
    s = Streams(art, threads=1)
    drafter = WrongOnce(STREAM_PROMPTS[0], want[0] + [0] * 8, open_session(art).manifest.vocab_size)
    sids = [
        s.add(p, temperature=0, max_new_tokens=n, stop_ids=(), speculative=drafter if i == 0 else None)
        for i, (p, n) in enumerate(zip(STREAM_PROMPTS, STREAM_TOKENS))
    ]
    lengths = []
    run_rows = s._run_rows
    s._run_rows = lambda ids: (lengths.append(ids.shape[1]), run_rows(ids))[1]
    while s.live:
        s.step_speculative()
    assert [s.generated(x) for x in sids] == want
    assert lengths[:2] == [3, 2] and set(lengths[2:]) == {1}, lengths


@pytest.mark.parametrize("draft_faster", [False, True])
def test_draft_guard_keeps_the_faster_kind(draft_faster):
    """Epochs of drafting and of plain decoding, each kind's realized progress per second: the faster runs, the
    slower is tried again ever more rarely (every MAX_GAP epochs at most)."""
    g = spec.DraftGuard()
    modes = []
    for _ in range(120):
        modes.append(g.mode)
        fast = (g.mode == "draft") == draft_faster
        assert not any(g.record(24 if fast else 8, 0.1, 16) for _ in range(g.EPOCH - 1))
        assert g.record(24 if fast else 8, 0.1, 16)
        g.close()
    assert modes[:2] == ["draft", "plain"]  # each kind once first
    slower = "plain" if draft_faster else "draft"
    assert modes[-64:].count(slower) <= 64 // g.MAX_GAP + 1
    assert slower in modes[-64:]  # still tried now and then
    # a kind within the margin of plain decoding does not draft: plain is the safe default
    g = spec.DraftGuard()
    for _ in range(40):
        for _ in range(g.EPOCH):
            g.record(16 if g.mode == "plain" else 16.5, 0.1, 16)
        g.close()
    assert g.best == "plain"


class AlwaysWrong:
    """Two drafts every round, the first always wrong: every drafting row goes back and feeds again."""

    cheap = True

    def __init__(self, vocab):
        self.schedule, self.vocab = spec.FixedSchedule(2), vocab

    def propose(self, context, k, dec=None):
        return [(context[-1] + 1) % self.vocab] * 2, None


def test_streams_stop_drafting_where_it_loses(batch_artifacts):
    """A batch whose drafts are never kept makes no progress in its drafting rounds: after the first epochs it
    decodes plainly, drafting again only now and then (DraftGuard), and gives plain decoding's tokens."""
    from edgeattn.runtimes.streams import Streams

    art = batch_artifacts["gla"]
    prompts = [PROMPT, PROMPT[:20], list(b"abcabcabcab"), list(b"xyz")]
    s = Streams(art, threads=1)
    plain = [s.add(p, temperature=0, max_new_tokens=150, stop_ids=()) for p in prompts]
    while s.live:
        s.step()
    want = [s.generated(x) for x in plain]
    V = open_session(art).manifest.vocab_size
    s = Streams(art, threads=1)
    sids = [
        s.add(p, temperature=0, max_new_tokens=150, stop_ids=(), speculative=AlwaysWrong(V)) for p in prompts
    ]
    drafting = []
    run_rows = s._run_rows
    s._run_rows = lambda ids: (drafting.append(ids.shape[1] > 1), run_rows(ids))[1]
    while s.live:
        s.step_speculative()
    assert [s.generated(x) for x in sids] == want
    assert s._guard.best == "plain"
    late = drafting[len(drafting) // 2 :]
    assert sum(late) <= len(late) // 4, drafting


def test_streams_speculative_ngram_and_refusals(batch_artifacts, artifacts):
    from edgeattn.runtimes.streams import SerialStreams, Streams

    art = batch_artifacts["gla"]
    want = run_streams(art, 0)[0]
    assert run_streams(art, 0, ["ngram"] * 4)[0] == want
    s = Streams(art, threads=1)
    with pytest.raises(ValueError, match="speculative must be 'ngram'"):
        s.add([1, 2], speculative="draft")
    with pytest.raises(ValueError, match="one stream at a time"):
        SerialStreams(artifacts["gla"], threads=1).add([1, 2], speculative="ngram")


def test_schedule_cost_stays_positive_under_noisy_times():
    """A slope fitted to noisy rounds extrapolated down from a long call reached 0: a division by zero that
    ended every request of a server."""
    s = spec.Schedule()
    for m, t in [(17, 2e-3), (16, 2e-4), (15, 1e-3), (3, 1e-3)]:
        s.observe(m, t)
    assert s.cost(1) > 0 and s.cost(2) > 0
    s.next_k(1, None)
    s.next_k(12, 100)


class _Row:
    """What ``Streams._batch_k`` reads of a stream: its tokens to feed, its drafter's match, its schedule."""

    def __init__(self, alpha):
        self.todo, self.drafter, self.schedule = [7], spec.NgramDrafter(), spec.Schedule()
        self.drafter.match = 3
        self.schedule.alphas[3] = alpha


@pytest.mark.parametrize("flat", [False, True])
def test_batch_draft_length_weighs_all_the_tokens_a_call_feeds(flat):
    """A batch's calls are timed by the tokens all their rows feed, so the sizes a server's batch passes through
    while clients come and go teach the cost of longer calls without drafting. Where a call costs its rows
    times its length (the linearized SmolLM2 on 2 cores: 0.85x of plain decoding on free text at 16 clients
    when timed by length alone) no draft pays, not even all rows' at 0.9; where it costs about the same
    whatever it feeds, every row drafting pays and one row alone does not (the 15 others pay for its call)."""
    from edgeattn.runtimes.streams import Streams

    s = Streams.__new__(Streams)
    s._timing = spec.Schedule()
    for rows in (4, 8, 12, 16, 10, 16):  # plain rounds: one token a row
        s._timing.observe(rows, 1e-3 * (rows if not flat else 10 + rows / 100))
    drafts = {i: [1, 2, 3, 4] for i in range(16)}
    s._streams = {i: _Row(0.9) for i in drafts}
    k_all = s._batch_k(drafts)
    k_one = s._batch_k({i: (d if i == 0 else []) for i, d in drafts.items()})
    assert k_one == 0
    assert (k_all >= 2) if flat else (k_all == 0), k_all
