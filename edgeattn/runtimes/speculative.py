"""Speculative decoding: draft several tokens cheaply, verify them in ONE call of the target's one graph, keep
the longest prefix the target itself would have produced, and roll the state back past the rest.

    sess.generate(prompt, speculative="ngram")            # prompt lookup: n-gram matches in the text so far
    sess.generate(prompt, speculative="runs/small.onnx")  # a draft artifact with the same tokenizer
    edgeattn run ART --speculative ngram|DRAFT_ART

A round: the tokens not yet in the target's state (the last one chosen, and any the previous round has to
re-advance) plus k drafts go through the graph as one chunk; its logits at each position choose the next
token exactly as plain decoding would (the stream's ``Decoder``: greedy, temperature / top-k / top-p with the
stream's generator, repetition penalty, stop ids, ``max_new_tokens``), and a draft is kept while it equals the
token chosen. Sampling:
- drafts that are fixed tokens (prompt lookup, a draft model at temperature 0): the token at each position is
  drawn from the target's distribution and the draft kept when equal. That is the standard rejection rule for
  a draft distribution q concentrated on the draft d (keep d with probability min(1, p(d) / q(d)) = p(d), else
  draw from the residual max(p - q, 0), which is p without d), so the output is the target's distribution;
  here it even draws the same tokens as plain sampling with the same seed.
- a draft model sampling at the stream's temperature returns its distributions q, and the rule runs as written
  (Leviathan et al. 2023, Chen et al. 2023).

Rollback: the one-graph session keeps the state the verify call read (its two buffers,
``OnnxRuntimeSession._mark`` / ``_rewind``); after a partly rejected round it returns to that state and the
accepted tokens are re-advanced, not in a call of their own but as the first tokens of the next round's
verify call (a CPU call reads the weights once whatever its few tokens: the re-advance costs almost nothing).
Recurrent and convolution states come back whole; a KV buffer comes back by its position (its slots past the
position are never read before being written again). The draft model's own state goes back through
``get_state`` / ``set_state`` (a small model's state, copied once a round). The other way, an artifact exported
with ``verify_states`` returns every fixed-size state after each token of the verify call, and the round keeps
the one after its last kept token (``rollback="states"``): measured slower on the CPU (ONNX Runtime computes
those outputs in every call), so re-advancing is the default (benchmarks/RESULTS.md).

Adaptive draft length (``Schedule``): each round drafts the k that maximizes the expected tokens per second
from the measured cost of a call on each number of tokens and the running chance that a draft is kept; where
drafts fail, k falls to 0 and the round is plain decoding (one token, the step graph's call); after rounds
without drafts the loop decodes plainly for stretches that grow with them (``PLAIN_STRETCH``), without the
round's bookkeeping, so free generation runs at plain decoding's speed. A batch of streams (``Streams``) drafts
in the epochs whose realized progress beats plain decoding's (``DraftGuard``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edgeattn.runtimes.decode import Decoder
from edgeattn.runtimes.sampling import draw, next_distribution

MAX_DRAFT = 16  # drafts per round at most
MAX_TODO = 16  # tokens to re-advance at most before a round drafts again
# After n rounds in a row without a kept draft, the next min(n, PLAIN_STRETCH) tokens are decoded plainly: a round
# costs more Python than a step (drafting, the schedule, timing), which a small model's call does not hide
# (sampled text rarely repeats), so the loop falls back to plain decoding, trying drafts again ever more rarely.
PLAIN_STRETCH = 16


@dataclass
class SpeculativeStats:
    """What a speculative run did: rounds (verify calls), drafted and accepted tokens, tokens produced."""

    rounds: int = 0
    drafting_rounds: int = 0  # rounds with at least one draft
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens produced (a stop token included)
    readvanced: int = 0  # kept tokens fed again after a rollback (the cost of rolling back)

    @property
    def mean_accepted(self) -> float:
        """Tokens produced per verify call (plain decoding: 1)."""
        return self.tokens / max(self.rounds, 1)

    @property
    def acceptance(self) -> float:
        """The fraction of drafted tokens that were kept."""
        return self.accepted / max(self.drafted, 1)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafting_rounds": self.drafting_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens": self.tokens,
            "readvanced": self.readvanced,
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance": round(self.acceptance, 4),
        }


# ----------------------------------------------------------------------------------------------------------
# drafters: propose(context, k, dec) -> (draft tokens, their distributions or None)
# ----------------------------------------------------------------------------------------------------------


class NgramDrafter:
    """Prompt lookup: the longest suffix of the text (``min_n`` to ``max_n`` tokens) that occurred before, and
    the tokens that followed its latest occurrence (continued periodically where they run into the end: a
    repeating pattern drafts its next period). Fixed tokens: no distributions."""

    cheap = True  # drafting costs next to nothing: draft first, then let the schedule cut by the match's size

    def __init__(self, min_n: int = 2, max_n: int = 8):
        self.match = 0  # the size of the n-gram the last drafts followed (0: none)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)
        self._index = {n: {} for n in self.sizes}  # n -> n-gram -> the end of its latest occurrence
        self._seen, self._last = 0, None  # how many tokens are indexed, and the last of them

    def _extend(self, context: list[int]) -> None:
        n = self._seen
        if n > len(context) or (n and context[n - 1] != self._last):  # another text: start over
            self._index = {size: {} for size in self.sizes}
            n = 0
        # index the n-grams that end before the last token (a continuation exists for each), a later occurrence
        # replacing an earlier one; by C-level zips over slices of the new part (a prompt of thousands of tokens
        # is indexed at its first round, every round after adds one token)
        L = len(context)
        for size in self.sizes:
            e0 = max(n, 1, size)  # the first end not indexed yet
            if e0 < L:
                grams = zip(*(context[e0 - size + j : L - size + j] for j in range(size)))
                self._index[size].update(zip(grams, range(e0, L)))
        self._seen, self._last = len(context), context[-1] if context else None

    def propose(self, context: list[int], k: int, dec: Decoder | None = None):
        self._extend(context)
        L = len(context)
        for n in self.sizes:
            if L <= n:
                continue
            e = self._index[n].get(tuple(context[-n:]))
            if e is not None:
                self.match = n
                drafts = []
                for i in range(e, e + k):  # past the end: the drafts themselves (a repeating pattern)
                    drafts.append(context[i] if i < L else drafts[i - L])
                return drafts, None
        self.match = 0
        return [], None


class ModelDrafter:
    """A draft artifact's session (the same tokenizer): k tokens by its own decoding, greedy when the target
    is greedy, else sampled at the target's temperature / top-k / top-p with their distributions returned
    (the rejection rule needs them). Its state follows the committed text: before drafting it consumes the
    tokens committed since its last round, after going back (``set_state``) to the state it saved at the end
    of the committed text when its drafts were not all kept."""

    def __init__(self, session, target=None, seed: int | None = None):
        if session.manifest.batch_size != 1:
            raise ValueError("the draft artifact must be exported with --batch 1")
        if target is not None:
            check_same_tokenizer(target.manifest, session.manifest)
        self.sess = session
        # its own stream of random numbers: the target's generator draws the acceptances, and a draft drawn from
        # the same sequence would be correlated with them
        self.rng = np.random.default_rng(None if seed is None else (int(seed), 1))
        self.consumed: list[int] = []  # the tokens in the draft's state
        self.saved = None  # (state, position, tokens): the state after a committed prefix
        self.logits = None  # the draft's logits after ``consumed``

    def _sync(self, context: list[int]) -> None:
        """Bring the draft's state to ``context`` (its logits after the last token in ``self.logits``): from
        where it is when that is a prefix, else from the state saved at the previous round's committed text
        (all but its last token) when that is, else from the start. The state before the last token is saved
        (a prefix of every later context: the committed text only grows)."""
        s = self.sess
        if not (len(self.consumed) < len(context) and self.consumed == context[: len(self.consumed)]):
            if (
                self.saved is not None
                and len(self.saved[2]) < len(context)
                and context[: len(self.saved[2])] == self.saved[2]
            ):
                state, position, self.consumed = self.saved
                s.set_state(state, position=position)
            else:
                s.reset()
                self.consumed = []
        new = context[len(self.consumed) :]
        if len(new) > 1:
            s.prefill(np.asarray([new[:-1]], np.int64))
        self.saved = (s.get_state(), s.position, list(context[:-1]))
        self.logits = s.step(np.asarray([new[-1:]], np.int64))[0]
        self.consumed = list(context)

    def propose(self, context: list[int], k: int, dec: Decoder):
        s = self.sess
        with s.lock:
            limit = s.manifest.max_length
            if limit is not None:  # the draft's own KV buffer: room for the context and k - 1 drafts
                k = min(k, limit - len(context) + 1)
            if k <= 0:
                return [], None
            self._sync(context)
            greedy = dec is None or dec.temperature <= 0
            drafts, qs = [], []
            for i in range(k):
                if greedy:
                    d = int(np.argmax(self.logits))
                else:
                    _, q = next_distribution(self.logits, **dec.sampling)
                    if q is None:  # a temperature so small that it is greedy: q is one-hot
                        q = np.zeros(self.logits.size)
                        q[int(np.argmax(self.logits))] = 1.0
                    d = draw(q, self.rng)
                    qs.append(q)
                drafts.append(d)
                if i < k - 1:
                    self.logits = s.step(np.array([[d]], np.int64))[0]
                    self.consumed.append(d)
            return drafts, (None if greedy else qs)


def _tokenizer_key(manifest) -> tuple:
    info = manifest.data.get("tokenizer") or {}
    kind = info.get("type", "byte")
    path = info.get("path", "tokenizer.json") if kind != "byte" else None
    digest = (manifest.data.get("files", {}).get(path) or {}).get("sha256") if path else None
    return manifest.vocab_size, kind, digest


def check_same_tokenizer(target, draft) -> None:
    """ValueError unless the two manifests' models read the same token ids (vocabulary, tokenizer file)."""
    if _tokenizer_key(target) != _tokenizer_key(draft):
        raise ValueError(
            f"the draft artifact {draft.root} has another tokenizer than {target.root} (vocabulary "
            f"{draft.vocab_size} vs {target.vocab_size}, or another tokenizer file): drafts must be the same ids"
        )


def make_drafter(target, speculative, seed: int | None = None):
    """The drafter that ``speculative`` names: "ngram", a draft artifact's directory, an open Session, or any
    object with ``propose(context, k, dec)``."""
    if isinstance(speculative, str) and speculative == "ngram":
        return NgramDrafter()
    if isinstance(speculative, (str, os.PathLike)):
        from edgeattn.runtimes import open_session

        if not os.path.isdir(speculative):
            raise ValueError(
                f"speculative must be 'ngram' or a draft artifact's directory; {str(speculative)!r} is neither"
            )
        threads = getattr(getattr(target, "sessions", {}).get("step"), "get_session_options", None)
        n = threads().intra_op_num_threads if threads else None
        return ModelDrafter(open_session(speculative, threads=n or None), target, seed=seed)
    from edgeattn.runtimes.base import Session

    if isinstance(speculative, Session):
        return ModelDrafter(speculative, target, seed=seed)
    if hasattr(speculative, "propose"):
        return speculative
    raise ValueError(
        f"speculative must be 'ngram', a draft artifact's directory, a Session or a drafter, got {speculative!r}"
    )


# ----------------------------------------------------------------------------------------------------------
# the draft length
# ----------------------------------------------------------------------------------------------------------


class Schedule:
    """How many tokens to draft next: the k that maximizes the expected tokens per second of a round,

        E(k) / t(n + k),    E(k) = 1 + a + a^2 + ... + a^k,

    with ``a`` the chance that a draft is kept given the ones before it were (a running estimate over the
    drafted positions) and ``t(m)`` the measured seconds of a whole round whose call fed m tokens (``n`` of
    them to re-advance and the last token): drafting, the graph call, choosing the tokens. k = 0 is plain
    decoding. A round's overhead counts, so a model whose call costs less than the Python around it drafts
    little. Where drafts keep failing ``a`` falls and drafting stops; it drifts back towards its prior while nothing is
    drafted, so drafting is retried now and then. On a CPU a call's cost grows with its tokens (int4
    MatMulNBits past one row, the vocabulary head per position), which this weighs instead of assuming it flat."""

    PRIOR = 0.6  # the chance a draft is kept, before any evidence (prompt lookup drafts only on a match)
    SLOPE = 0.25  # the cost of each token of a call beyond the first, as a fraction of a one-token call, until measured
    KEEP = 0.7  # weight of the old value in the running estimates
    MARGIN = 1.1
    stretch = True  # plain decoding for stretches after rounds that keep no draft (PLAIN_STRETCH)

    def __init__(self, max_k: int = MAX_DRAFT):
        self.max_k = max_k
        self.alphas: dict = {}  # the drafter's confidence (prompt lookup: the n-gram's size) -> chance a draft is kept
        self.times: dict[int, float] = {}  # call length -> running seconds
        self._slope = None  # seconds per fed token, fitted once two lengths are measured
        self._observed = 0

    def cost(self, m: int) -> float:
        """The expected seconds of a round that feeds m tokens: measured, or from the nearest measured length
        along the least-squares slope of the measurements (the prior slope while there is one)."""
        if m in self.times:
            return self.times[m]
        if self._slope is None:
            if not self.times:
                return 1.0 + self.SLOPE * (m - 1)
            near = next(iter(self.times))
            return self.times[near] * (1.0 + self.SLOPE * (m - 1)) / (1.0 + self.SLOPE * (near - 1))
        near = min(self.times, key=lambda x: abs(x - m))
        # down the slope from a longer call noisy measurements could reach 0 or below: half the fastest round
        return max(self.times[near] + self._slope * (m - near), 0.5 * min(self.times.values()))

    def next_k(self, n: int, remaining: int | None, bucket=None) -> int:
        """The draft length for a call that also feeds ``n`` tokens (the last token and any to re-advance), for
        drafts of the drafter's confidence ``bucket``."""
        top = self.max_k if remaining is None else min(self.max_k, remaining - 1)
        alpha = self.alphas.get(bucket, self.PRIOR)
        # drafting must promise MARGIN more tokens per second than plain decoding (the estimates are noisy)
        best, best_rate, expected, p = 0, self.MARGIN / self.cost(n), 1.0, 1.0
        for k in range(1, top + 1):
            p *= alpha
            expected += p
            rate = expected / self.cost(n + k)
            if rate <= best_rate:  # the rate of a linear cost and a geometric gain has one peak
                break
            best, best_rate = k, rate
        return best

    def observe(self, m: int, seconds: float) -> None:
        if self.times:  # at most twice the expected: one round stalled by a loaded CPU must not stop drafting
            seconds = min(seconds, 2.0 * self.cost(m))
        old = self.times.get(m)
        self.times[m] = seconds if old is None else self.KEEP * old + (1 - self.KEEP) * seconds
        self._observed += 1
        # least squares, in plain Python, when a length is new and every 16th round (it is overhead per token)
        if len(self.times) >= 2 and (old is None or self._observed % 16 == 0):
            n = len(self.times)
            mx = sum(self.times) / n
            my = sum(self.times.values()) / n
            sxx = sum((x - mx) ** 2 for x in self.times)
            sxy = sum((x - mx) * (y - my) for x, y in self.times.items())
            # at least a twentieth of the shortest round's cost per token: noise must not make long calls look
            # free (per token: a batch's rounds are keyed by the tokens of all its rows)
            floor = 0.05 * self.times[min(self.times)] / min(self.times)
            self._slope = max(sxy / sxx, floor)

    def update(self, drafted: int, accepted: int, bucket=None) -> None:
        if drafted == 0:  # nothing tried: back towards the prior, slowly
            for b, a in self.alphas.items():
                self.alphas[b] = a + 0.01 * (self.PRIOR - a)
            return
        alpha = self.alphas.get(bucket, self.PRIOR)
        tested = accepted + (accepted < drafted)
        rate = accepted / tested
        w = self.KEEP**tested  # each tested position counts as one observation
        self.alphas[bucket] = min(w * alpha + (1 - w) * rate, 0.98)


class FixedSchedule(Schedule):
    """Always ``k`` drafts (fewer near ``max_new_tokens``): a drafter with a ``schedule`` attribute brings its own
    (tests force their rounds with it; benchmarks compare against it)."""

    stretch = False  # every round drafts: no plain stretches

    def __init__(self, k: int):
        super().__init__(max_k=k)

    def next_k(self, n: int, remaining: int | None, bucket=None) -> int:
        return self.max_k if remaining is None else max(min(self.max_k, remaining - 1), 0)


class DraftGuard:
    """Whether a batch of streams drafts at all (``Streams.step_speculative``), from the throughput it realized.

    The batch's draft length (``Streams._batch_k``) weighs each row's expected tokens against the measured cost
    of a call, but not what a drafting call leaves behind: every row it pads, or whose drafts it rejects, goes
    back and feeds its tokens again, so later calls grow longer for the whole batch (the linearized SmolLM2 at
    16 streams: rows 10 tokens behind, 0.6x plain decoding). So rounds run in epochs of ``EPOCH`` rounds, each
    drafting or plain, and the tokens per second per row of each kind (running means) pick the next epoch's: the
    faster (drafting only with ``MARGIN`` over plain), the slower tried again after a number of epochs that
    doubles each time it loses again (up to ``MAX_GAP``). Progress is what entered the rows' states, not the tokens
    chosen: a row sent back to feed its tokens again has made none, so a drafting epoch's backlog counts against
    it. (The linearized SmolLM2's server still drafts a little in a batch: free text at 0.996x of plain at 16
    clients and 0.98x-1.03x at 4, over 7-9 rounds; benchmarks/RESULTS.md.)"""

    EPOCH = 8  # rounds per epoch
    MAX_GAP = 16  # epochs of the faster kind before the slower is tried again, at most
    MARGIN = 1.05
    KEEP = 0.5  # weight of the old rate

    def __init__(self):
        self.mode = "draft"  # this epoch's kind
        self.best = None
        self.rates: dict[str, float] = {}
        self.gap, self.since = 1, 0
        self.rounds = self.tokens = self.rows = 0
        self.seconds = 0.0

    def record(self, tokens: int, seconds: float, rows: int) -> bool:
        """Count a round of ``rows`` rows whose states took ``tokens`` more; True when the epoch is over
        (``close`` it)."""
        self.rounds += 1
        self.tokens += tokens
        self.seconds += seconds
        self.rows += rows
        return self.rounds >= self.EPOCH

    def close(self) -> None:
        """End the epoch and choose the next one's kind."""
        rate = self.tokens / max(self.seconds, 1e-9) / max(self.rows / max(self.rounds, 1), 1.0)
        old = self.rates.get(self.mode)
        self.rates[self.mode] = rate if old is None else self.KEEP * old + (1 - self.KEEP) * rate
        self.rounds = self.tokens = self.rows = 0
        self.seconds = 0.0
        if len(self.rates) < 2:  # each kind once first
            self.mode = "plain" if self.mode == "draft" else "draft"
            return
        best = "draft" if self.rates["draft"] > self.MARGIN * self.rates["plain"] else "plain"
        if best != self.best:
            self.best, self.gap, self.since = best, 1, 0
        if self.mode != best:  # the slower kind was tried and lost again: wait longer before the next try
            self.gap = min(2 * self.gap, self.MAX_GAP)
            self.mode, self.since = best, 0
            return
        self.since += 1
        if self.since >= self.gap:
            self.mode, self.since = ("plain" if best == "draft" else "draft"), 0


# ----------------------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------------------


def _choose(dec: Decoder, logits: np.ndarray, draft: int, q: np.ndarray | None) -> int | None:
    """The token at a drafted position: the target's own choice (``dec.next``) for a fixed draft, the rejection
    rule for a draft drawn from ``q``; recorded in ``dec`` (None: a stop token)."""
    if q is None:
        return dec.next(logits)
    logits, p = dec.distribution(logits)
    if p is None:
        return dec.take(int(np.argmax(logits)))
    if dec.rng.random() * q[draft] < p[draft]:  # accept with probability min(1, p(d) / q(d))
        return dec.take(draft)
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q: the rejection above cannot happen; draw from p
        return dec.take(draw(p, dec.rng))
    return dec.take(draw(residual / total, dec.rng))


ROLLBACKS = ("auto", "readvance", "states")


def generate(
    sess,
    dec: Decoder,
    ids: np.ndarray,
    drafter,
    stats: SpeculativeStats | None = None,
    rollback: str = "auto",
) -> Iterator[int]:
    """Yield the tokens that plain decoding of ``sess`` with ``dec`` would (see the module docstring), the
    state afterwards holding them (and a stop token) as plain decoding's does. ``ids``: the prompt [1, T].

    ``rollback``: after a partly rejected round, "readvance" goes back to the state before the call and feeds
    the kept tokens again at the start of the next call; "states" takes the state after the last kept token
    from the verify call itself (an artifact exported with ``verify_states``); "auto" (default): "states"
    where the artifact has them."""
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {', '.join(ROLLBACKS)}, got {rollback!r}")
    has_steps = bool(getattr(getattr(sess, "manifest", None), "verify_states", False))
    if rollback == "states" and not has_steps:
        raise ValueError(
            f"rollback 'states' needs an artifact exported with --verify-states; {sess.manifest.root} was not"
        )
    rollback = "states" if rollback == "auto" and has_steps else rollback
    reason = (
        sess.speculative_refusal()
        if hasattr(sess, "speculative_refusal")
        else (f"speculative decoding needs the onnxruntime backend, not {sess.backend!r}")
    )
    if reason:
        raise ValueError(reason)
    stats = stats if stats is not None else SpeculativeStats()
    schedule = getattr(drafter, "schedule", None) or Schedule()
    context = [int(t) for t in ids[0]]
    with sess.lock:
        logits = sess.prefill(ids)[0]
    tok = dec.next(logits)
    todo = [] if tok is None and dec.last is None else [int(dec.last)]  # chosen, not yet in the state
    stats.tokens += len(todo)
    if tok is not None:
        context.append(tok)
        yield tok
    idle = 0  # rounds in a row that kept no draft
    cheap = getattr(drafter, "cheap", False)
    while not dec.done:
        # plain decoding for a stretch (no drafting, no schedule): see PLAIN_STRETCH
        if idle and len(todo) == 1 and schedule.stretch:
            for _ in range(min(idle, PLAIN_STRETCH)):
                if dec.done:
                    break
                with sess.lock:
                    logits = sess._verify(np.asarray([todo], np.int64))[0, -1]
                tok = dec.next(logits)
                todo = [int(dec.last)]
                stats.rounds += 1
                stats.tokens += 1
                if tok is None:
                    break
                context.append(tok)
                yield tok
                # a cheap drafter looks each token up: a match of a size whose drafts pay ends the stretch
                if cheap and drafter.propose(context, 1, dec)[0]:
                    if schedule.next_k(1, None, getattr(drafter, "match", None)) > 0:
                        idle = 0
                        break
            if dec.done:
                break
        remaining = None if dec.max_new_tokens is None else dec.max_new_tokens - len(dec.generated)
        t0 = time.perf_counter()
        bucket = None
        if len(todo) > MAX_TODO:
            drafts, qs = [], None
        elif getattr(drafter, "cheap", False):  # draft all that may help, keep what the schedule says
            top = MAX_DRAFT if remaining is None else max(min(MAX_DRAFT, remaining - 1), 0)
            drafts, qs = drafter.propose(context, top, dec) if top > 0 else ([], None)
            bucket = getattr(drafter, "match", None)
            drafts = drafts[: schedule.next_k(len(todo), remaining, bucket)] if drafts else []
        else:
            k = schedule.next_k(len(todo), remaining)
            drafts, qs = drafter.propose(context, k, dec) if k > 0 else ([], None)
            drafts = drafts[:k]
        drafts = [int(d) for d in drafts]
        with sess.lock:
            mark = sess._mark()
            n_fed = len(todo) + len(drafts)
            # the logits at the last token and each draft: [len(drafts) + 1, V]; with per-token states the call
            # also gives the state after each token, for a partly rejected round
            steps = bool(drafts) and rollback == "states"
            logits = sess._verify(np.asarray([todo + drafts], np.int64), steps=steps)[0, len(todo) - 1 :]
            chosen = []  # this round's tokens (a stop token included)
            for i in range(len(drafts) + 1):
                if i < len(drafts):
                    tok = _choose(dec, logits[i], drafts[i], None if qs is None else qs[i])
                else:
                    tok = dec.next(logits[i])
                chosen.append(int(dec.last))
                if tok is not None:
                    context.append(tok)
                if dec.done or i == len(drafts) or tok != drafts[i]:
                    break
            kept = next(
                (i for i, (a, b) in enumerate(zip(chosen, drafts)) if a != b), min(len(chosen), len(drafts))
            )
            if chosen[: len(drafts)] == drafts:  # every draft kept: the state is right
                todo = chosen[len(drafts) :]
            elif steps:  # the state after the last kept token, from the call itself: nothing to re-advance
                sess._keep(mark, len(todo) + kept)
                todo = chosen[kept:]
            else:  # back to the state before this call; re-advance what it held that was kept
                sess._rewind(mark)
                stats.readvanced += len(todo) + kept
                todo = todo + chosen
        stats.rounds += 1
        stats.drafting_rounds += bool(drafts)
        stats.drafted += len(drafts)
        stats.accepted += kept
        stats.tokens += len(chosen)
        schedule.observe(n_fed, time.perf_counter() - t0)
        schedule.update(len(drafts), kept, bucket)
        idle = 0 if kept else idle + 1  # (a round whose drafts all failed counts as one without)
        yield from (t for t in chosen if t not in dec.stop_ids)  # a stop token ends the round, unyielded
    if todo:  # plain decoding leaves every chosen token (and the stop token) in the state
        with sess.lock:
            sess.prefill(np.asarray([todo], np.int64))
