"""The serving engine: continuous batching over ``Streams``, a prefix-state cache, text out. No HTTP here.

    engine = Engine(artifact_dir, slots=8, max_queue=32)
    await engine.start()                          # inside a running asyncio loop, which then owns it
    handle = engine.submit(Request(prompt_ids, max_tokens=64, temperature=0, stop=["\\n\\n"]))
    async for piece in handle:                    # text pieces, never a split UTF-8 character
        ...
    handle.finish_reason, handle.usage            # "stop" | "length"; prompt/completion/cached tokens
    handle.cancel()                               # the client went away: the slot is free at the next iteration
    await engine.stop(drain_s=5)                  # refuse new work, finish (or end) what runs, then return

One asyncio task owns the ``Streams`` instance; requests reach it through its inbox (``submit``, ``cancel``)
and get their text through their own queue. Each iteration of the task:

1. admits waiting requests while fewer than ``slots`` are active (prefilling or decoding);
2. prefills ONE bounded piece (``prefill_piece`` tokens, a multiple of the artifact's prefill tokens, cut
   short at a chat-message boundary) of the oldest admitted prompt, starting from the longest prefix the
   cache holds (under the request's ``cache_salt``), together with the piece of
   every other admitted prompt whose piece has the same length (one batched call: ``Streams.prefill_many``),
   ``PREFILL_ROUND_PIECES`` pieces' worth of tokens at most; a prompt that is done has its state cached
   and joins the batch;
3. steps every live stream in ONE step-graph call (``Streams.step``) and hands each its token; with
   ``speculative="ngram"`` (``edgeattn serve --speculative ngram``) each stream drafts by prompt lookup and ONE
   call verifies the batch (``Streams.step_speculative``), handing each stream the tokens it kept.

The graph calls and the cache run in one worker thread, so the loop stays free to serve HTTP while they
run; nothing else touches the streams. A request whose own sampling fails (its stream cannot start, or a
step cannot sample it: ``Streams.step(errors)``) ends alone with its error; a failed graph call ends all.
A request leaves the batch at an end-of-sequence token, a stop string, ``max_tokens`` or ``cancel``; the
state after its prompt, after its reply (every token consumed, an end-of-sequence token included) and at each of its ``boundaries`` (token counts where a chat message
begins, rounded down to a multiple of the prefill tokens) is cached under those token ids (see
``edgeattn.serve.cache``).

Exactness: greedy requests give ``Session.generate(..., temperature=0)``'s tokens alone, batched, streamed
or resumed from the cache. Without a cache hit the prompt is consumed in the same prefill-graph chunks as
``Session.prefill`` (pieces, boundaries included, are multiples of the chunk), so the numbers are the same,
and so they are after a hit on a boundary's state (a multiple of the chunk too); a hit on a prompt's or a
reply's state resumes from a
state that was computed with other chunk boundaries (the reply's tokens one step each), equal up to float
rounding (tests/test_serve_engine.py measures it and checks the greedy tokens).

Artifacts that ``Streams`` refuses (a fixed batch, a growing-cache softmax layer) run one request at a
time (``SerialStreams``); ``engine.serial_reason`` says why. Preallocated KV buffers (float32, float16 or
int8) batch like fixed-size states.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import os
from dataclasses import dataclass, field

import numpy as np

from edgeattn.runtimes.sampling import check_sampling, check_seed, logit_bias_arrays
from edgeattn.runtimes.streams import _is_kv, open_streams
from edgeattn.serve.cache import DEFAULT_DISK_MB, PrefixCache
from edgeattn.serve.logprobs import Recorder, prompt_logprobs

MiB = 2**20
DEFAULT_PREFILL_TOKENS = 256  # the bound of one prefill piece between two steps (rounded to the chunk)
PREFILL_ROUND_PIECES = 2  # prompt tokens prefilled between two steps: at most this many full pieces' worth
FIXED_STATE_MAX_PROMPT = 65536  # --max-prompt-tokens default where the state is fixed-size
DEFAULT_MAX_TOKENS = 65536  # --max-tokens default: the longest reply (a KV buffer may bound it sooner)


class QueueFull(Exception):
    """Every slot is busy and the queue is full (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine refuses new work (HTTP 503)."""


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first one
    ignore_eos: bool = False  # go on past end-of-sequence tokens (as vLLM's extension; for benchmarks)
    logit_bias: dict | tuple | None = None  # OpenAI's {token id: bias in [-100, 100]}
    cache_salt: str | None = None  # only requests with the same salt share cached states (as vLLM's)
    boundaries: list[int] = field(default_factory=list)  # prompt tokens where a chat message begins
    constraint: object = None  # a grammar's Constraint (edgeattn.serve.grammar): masks every token
    logprobs: int | None = None  # record each token's logprob and this many top ones (None: off)


_DONE = object()


class Handle:
    """One request in the engine: iterate it for text pieces; then ``finish_reason`` and ``usage``."""

    def __init__(self, engine: Engine, request: Request, rid: int):
        self.engine = engine
        self.request = request
        self.id = rid
        self.prompt = np.asarray(request.prompt_ids, dtype=np.int64)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._queue: asyncio.Queue = asyncio.Queue()
        # the engine's side
        self.sid: int | None = None  # the stream, once prefilled
        self.state = None  # the prefill's (state, logits, position) between pieces
        self.cuts: list[int] = []  # positions where a piece ends and the state is cached (message boundaries)
        self.max_new = request.max_tokens
        self.deadline: float | None = None  # loop time after which the engine ends it (--max-request-seconds)
        self.eos = frozenset() if request.ignore_eos else engine.eos
        self._decoder = engine.tokenizer.decoder()
        self._pending = ""  # decoded text not yet handed out (it may begin a stop string)
        self._seen = 0  # tokens of the stream already decoded
        self.recorder = None if request.logprobs is None else Recorder(request.logprobs)
        self.processors = [p for p in (request.constraint, self.recorder) if p is not None]

    @property
    def usage(self) -> dict:
        return {
            "prompt_tokens": int(self.prompt.size),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def cancel(self) -> None:
        """End the request (the client went away): its slot is freed at the engine's next iteration."""
        if self.finish_reason is None and not self.cancelled:
            self.cancelled = True
            self.engine._wake.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        item = await self._queue.get()
        if item is _DONE:
            self._queue.put_nowait(_DONE)  # iterating again ends again
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        return item

    async def text(self) -> str:
        """The whole reply (for a non-streamed response)."""
        return "".join([piece async for piece in self])


class Engine:
    """See the module docstring."""

    def __init__(
        self,
        artifact: str | os.PathLike,
        *,
        slots: int = 4,
        max_queue: int = 16,
        max_prompt_tokens: int | None = None,
        threads: int | None = None,
        cache_mb: float = 256,
        cache_dir: str | os.PathLike | None = None,
        cache_disk_mb: float = DEFAULT_DISK_MB,
        prefill_piece: int = DEFAULT_PREFILL_TOKENS,
        max_tokens: int | None = None,
        max_request_s: float | None = None,
        speculative: str | None = None,
    ):
        if slots < 1 or max_queue < 0:
            raise ValueError(f"slots must be >= 1 and max_queue >= 0, got {slots} and {max_queue}")
        if cache_mb < 0 or cache_disk_mb < 0:
            raise ValueError(
                f"the state cache sizes must be >= 0 MB, got {cache_mb} and {cache_disk_mb} (disk)"
            )
        if (max_tokens is not None and max_tokens < 1) or (max_request_s is not None and max_request_s <= 0):
            raise ValueError(
                f"max_tokens must be >= 1 and max_request_s > 0, got {max_tokens}, {max_request_s}"
            )
        self.max_tokens = int(max_tokens or DEFAULT_MAX_TOKENS)  # the longest reply (more asked: "length")
        self.max_request_s = max_request_s  # a request's longest life, queue included (then "length")
        self.threads = threads
        self.streams, self.serial_reason = open_streams(artifact, threads=threads, max_streams=slots)
        if speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be 'ngram' (prompt lookup) or None, got {speculative!r}")
        reason = speculative and self.streams.speculative_refusal()
        if reason:
            raise ValueError(f"--speculative {speculative}: {reason}")
        self.speculative = speculative
        if speculative:
            from edgeattn.runtimes.speculative import SpeculativeStats

            self.speculative_stats = SpeculativeStats()  # over every stream's rounds (/metrics)
        m = self.manifest = self.streams.manifest
        self.slots = 1 if self.serial_reason else int(slots)
        self.max_queue = int(max_queue)
        self.tokenizer = self.streams.tokenizer
        self.eos = frozenset(int(i) for i in self.tokenizer.eos_token_ids)
        self.max_length = m.max_length  # a KV buffer's length: prompt + reply must fit
        default = m.max_length if m.max_length is not None else FIXED_STATE_MAX_PROMPT
        self.max_prompt_tokens = int(max_prompt_tokens or default)
        if m.max_length is not None and self.max_prompt_tokens >= m.max_length:
            self.max_prompt_tokens = m.max_length - 1
        chunk = m.prefill_tokens
        self.prefill_piece = max(chunk, int(prefill_piece) // chunk * chunk)
        self.cache = PrefixCache(
            m.fingerprint,
            {e.input: tuple(e.shape) for e in m.state},
            int(cache_mb * MiB),
            cache_dir,
            int(cache_disk_mb * MiB),
            kv={e.input: e for e in m.state if _is_kv(e, m.max_length)},
            vocab_size=m.vocab_size,
        )
        self.metrics = collections.Counter()  # requests, tokens, ... (see app's /metrics)
        self._ids = itertools.count()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgeattn-engine")
        self._waiting: collections.deque[Handle] = collections.deque()
        self._prefilling: collections.deque[Handle] = collections.deque()
        self._live: dict[int, Handle] = {}  # stream id -> handle
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.stopping = False
        self._deadline: float | None = None

    # ---- what the HTTP layer reads ----

    @property
    def state_bytes(self) -> int:
        return self.streams.state_bytes_per_stream

    @property
    def active(self) -> int:
        return len(self._prefilling) + len(self._live)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    # ---- life cycle ----

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="edgeattn-engine")

    def begin_shutdown(self, drain_s: float = 5.0) -> None:
        """Refuse new requests; the queued ones end with ShuttingDown, the active ones may run ``drain_s``
        more seconds and are then ended (finish_reason "length")."""
        if self.stopping:
            return
        self.stopping = True
        self._deadline = asyncio.get_running_loop().time() + drain_s
        while self._waiting:
            self._end(self._waiting.popleft(), error=ShuttingDown("the server is shutting down"))
        if self._wake is not None:
            self._wake.set()

    def request_shutdown(self, drain_s: float = 5.0) -> None:
        """``begin_shutdown`` from any thread or a signal handler."""
        if self._task is not None:
            self._loop.call_soon_threadsafe(self.begin_shutdown, drain_s)

    async def stop(self, drain_s: float = 5.0) -> None:
        self.begin_shutdown(drain_s)
        if self._task is not None:
            await self._task
        self._worker.shutdown(wait=True)

    # ---- requests ----

    def submit(self, request: Request) -> Handle:
        """Queue a request. ValueError for a bad one, QueueFull beyond the slots and queue, ShuttingDown."""
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        self.check(request)
        if self.active + len(self._waiting) >= self.slots + self.max_queue:
            self.metrics["rejected"] += 1
            raise QueueFull(
                f"the server is full: its {self.slots} slots (--slots) and {self.max_queue} queue places "
                f"(--max-queue) hold {self.active + len(self._waiting)} requests; retry later"
            )
        h = Handle(self, request, next(self._ids))
        if self.max_length is not None:  # a KV buffer: prompt and reply must fit in it
            h.max_new = min(h.max_new, self.max_length - int(h.prompt.size))
        h.max_new = min(h.max_new, self.max_tokens)
        if self.max_request_s is not None:
            h.deadline = self._loop.time() + self.max_request_s
        self.metrics["requests"] += 1
        self.metrics["prompt_tokens"] += int(h.prompt.size)
        self._waiting.append(h)
        self._wake.set()
        return h

    def check(self, r: Request) -> None:
        """ValueError (one line) unless the request can run."""
        ids = np.asarray(r.prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or (ids.dtype.kind not in "iu"):
            raise ValueError("the prompt is empty or not a list of token ids")
        if ids.size > self.max_prompt_tokens:
            raise ValueError(
                f"the prompt has {ids.size} tokens; this server takes at most {self.max_prompt_tokens} "
                "(--max-prompt-tokens)"
            )
        V = self.manifest.vocab_size
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"token ids must lie in [0, {V}), got values in [{ids.min()}, {ids.max()}]")
        if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) or r.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {r.max_tokens!r}")
        check_sampling(r.temperature, r.top_k, r.top_p)
        check_seed(r.seed)
        r.logit_bias = logit_bias_arrays(r.logit_bias, V)
        if any(not isinstance(s, str) or not s for s in r.stop):
            raise ValueError("stop must be a non-empty string or a list of them")

    async def prompt_logprobs(self, ids: list[int], top: int) -> list:
        """Each prompt token's logprob entry (``edgeattn.serve.logprobs.prompt_logprobs``), computed in the
        worker thread between two iterations of the loop."""
        return await self._call(prompt_logprobs, self.streams._single, list(ids), top)

    # ---- the loop ----

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = loop.time()
            if self._deadline is not None and now >= self._deadline:
                for h in [*self._prefilling, *self._live.values()]:
                    h.cancelled = True
            if self.max_request_s is not None:
                for h in [*self._waiting, *self._prefilling, *self._live.values()]:
                    if not h.cancelled and h.finish_reason is None and now >= h.deadline:
                        h.cancelled = True
                        self.metrics["timed_out"] += 1
            await self._drop_cancelled()
            while self._waiting and self.active < self.slots:
                self._prefilling.append(self._waiting.popleft())
            if not self._prefilling and not self._live:
                if self.stopping:
                    return
                await self._wake.wait()
                continue
            try:
                if self._prefilling:
                    live, failed = await self._call(self._prefill_pieces, list(self._prefilling))
                    for h in live:
                        self._prefilling.remove(h)
                        self._live[h.sid] = h
                    for h, e in failed:  # this request's sampling failed: it ends alone
                        self._prefilling.remove(h)
                        self._fail(h, e)
                if self._live:
                    out, finished = await self._call(self._step)
                    for sid, toks in out.items():
                        try:
                            self._deliver(self._live[sid], toks)
                        except Exception as e:  # decoding its text failed: it ends alone
                            self._live[sid].error = e
                    for sid in finished:
                        self._finish(self._live.pop(sid))
            except Exception as e:  # a graph call failed: end everything in flight with the error
                for h in [*self._prefilling, *self._live.values()]:
                    self._end(h, error=RuntimeError(f"the engine failed: {e}"))
                self._prefilling.clear()
                self._live.clear()
                self.streams, _ = open_streams(self.manifest, threads=self.threads, max_streams=self.slots)
            await asyncio.sleep(0)  # let the HTTP side run between iterations

    async def _drop_cancelled(self) -> None:
        for q in (self._waiting, self._prefilling):
            for h in [h for h in q if h.cancelled]:
                q.remove(h)
                self._end(h, reason=h.finish_reason or "length")
        gone = [sid for sid, h in self._live.items() if h.cancelled or h.finish_reason is not None]
        if gone:
            await self._call(self._leave, gone)
            for sid in gone:
                h = self._live.pop(sid)
                self._end(h, reason=h.finish_reason or "length")

    # ---- in the worker thread: graph calls and the cache ----

    def _prefill_pieces(self, handles: list[Handle]) -> tuple[list[Handle], list]:
        """One piece of the prompt of the oldest handle and of every other whose next piece has the same
        length, in one batched call (the cache is looked up first); returns the handles that became live
        streams, and ``(handle, error)`` for those whose stream could not start (their sampling)."""
        for h in handles:
            if h.state is None:
                hit = self.cache.lookup(h.prompt, h.request.cache_salt) if self.cache.enabled else None
                if hit is not None:
                    h.cached_tokens = hit.n
                    h.state = (self.cache.state(hit), hit.logits, hit.n)
                else:
                    h.state = (None, None, 0)
                self.metrics["cache_hits" if hit is not None else "cache_misses"] += 1
                if self.cache.enabled:  # a multiple of the chunk: the pieces stay on Session.prefill's grid
                    C = self.manifest.prefill_tokens
                    cuts = {int(b) // C * C for b in h.request.boundaries}
                    h.cuts = sorted(b for b in cuts if h.cached_tokens < b < h.prompt.size)

        def piece(h):
            pos = h.state[2]
            end = min([pos + self.prefill_piece, *(b for b in h.cuts if b > pos)])
            return h.prompt[pos:end]

        todo = [h for h in handles if h.state[2] < h.prompt.size]
        if todo:
            n = piece(todo[0]).size
            group = [h for h in todo if piece(h).size == n][
                : max(1, PREFILL_ROUND_PIECES * self.prefill_piece // n)
            ]
            out = self.streams.prefill_many([(piece(h), h.state[0], h.state[2]) for h in group])
            self.metrics["prefill_calls"] += 1
            self.metrics["prefill_rows"] += len(group)
            for h, (state, logits, pos) in zip(group, out):
                h.state = (state, logits, pos)
                if pos in h.cuts:
                    self.cache.put(h.prompt[:pos], state, logits, salt=h.request.cache_salt, boundary=True)
                if pos == h.prompt.size:
                    self.cache.put(
                        h.prompt, state, logits, salt=h.request.cache_salt, demote_below=h.cached_tokens
                    )
        live, failed = [], []
        for h in handles:
            state, logits, pos = h.state
            if pos < h.prompt.size:
                continue
            r = h.request
            try:
                h.sid = self.streams.add(
                    state=state,
                    logits=logits,
                    position=pos,
                    temperature=r.temperature,
                    top_k=r.top_k,
                    top_p=r.top_p,
                    seed=r.seed,
                    stop_ids=[],  # the engine ends a stream at an end-of-sequence token itself (after consuming it)
                    max_new_tokens=h.max_new,
                    logit_bias=r.logit_bias,
                    processors=h.processors,
                    speculative=self.speculative,
                    context=h.prompt if self.speculative else None,
                )
            except Exception as e:  # its sampling parameters: the others go on
                failed.append((h, e))
            else:
                live.append(h)
            h.state = None
        return live, failed

    def _step(self) -> tuple[dict[int, list[int]], list[int]]:
        """One batched step: the new tokens of every live stream and the streams that ended (their state
        cached, their slot freed)."""
        errors: dict = {}
        if self.speculative:  # several tokens per stream from one call where drafts are kept
            self.streams.step_speculative(errors, self.speculative_stats)
        else:
            self.streams.step(errors)  # a stream whose sampling fails ends alone
        out, finished = {}, []
        for sid, e in errors.items():
            self._live[sid].error = e
        for sid, h in self._live.items():
            gen = self.streams.generated(sid)
            new = gen[h._seen :]
            h._seen = len(gen)
            c = h.request.constraint
            if c is not None and c.failed is not None:  # the token sampled where the grammar broke is dropped
                h.error = RuntimeError(f"the output grammar failed: {c.failed}")
                new = []
            if new:
                out[sid] = new
            if (
                h.error is not None
                or self.streams.done(sid)
                or any(t in h.eos for t in new)  # (a speculative round may go on past one)
                or (c is not None and c.stopped)
            ):
                finished.append(sid)
        self.metrics["steps"] += 1
        self.metrics["step_rows"] += len(self._live)
        if finished:
            self._leave(finished)
        return out, finished

    def _leave(self, sids: list[int]) -> None:
        """Cache the state of each stream after its prompt and reply, then free its row."""
        for sid in sids:
            h = self._live[sid]
            gen = self.streams.generated(sid)
            # (get_state copies the state: not for nothing)
            if gen and h.error is None and self.cache.enabled:
                tokens = np.concatenate([h.prompt, np.asarray(gen, np.int64)])
                self.cache.put(
                    tokens, self.streams.get_state(sid), self.streams.logits(sid), salt=h.request.cache_salt
                )
            self.streams.drop(sid)

    # ---- on the loop: text, stop strings, the end ----

    def _deliver(self, h: Handle, toks: list[int]) -> None:
        if h.finish_reason is not None or h.cancelled:
            return
        for tok in toks:
            if tok in h.eos:  # the text ends: what the decoder held back is final
                h._pending += h._decoder.flush()
                self._emit(h, final=True)
                h.finish_reason = "stop"
                break
            h.completion_tokens += 1
            h._pending += h._decoder.push(tok)
            if self._emit(h, final=False):
                return

    def _emit(self, h: Handle, final: bool) -> bool:
        """Hand out the pending text up to a stop string (True: found, the request is done) or up to what
        could begin one."""
        stops = h.request.stop
        text = h._pending
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            self._put(h, text[: min(found)])
            h._pending = ""
            h.finish_reason = "stop"
            return True
        keep = 0
        if not final:
            for s in stops:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        keep = max(keep, k)
                        break
        self._put(h, text[: len(text) - keep])
        h._pending = text[len(text) - keep :]
        return False

    def _put(self, h: Handle, piece: str) -> None:
        if piece:
            h._queue.put_nowait(piece)

    def _fail(self, h: Handle, e: BaseException) -> None:
        self.metrics["failed"] += 1
        self._end(h, error=RuntimeError(f"this request's sampling failed: {e}"))

    def _finish(self, h: Handle) -> None:
        """A stream that ended in the graph (max_tokens or end-of-sequence)."""
        if h.error is not None:
            return self._fail(h, h.error)
        if h.finish_reason is None and not h.cancelled:
            h._pending += h._decoder.flush()
            if not self._emit(h, final=True):
                h.finish_reason = "length" if h.completion_tokens >= h.max_new else "stop"
        self._end(h, reason=h.finish_reason or "length")

    def _end(self, h: Handle, reason: str = "length", error: BaseException | None = None) -> None:
        if h.finish_reason is None:
            h.finish_reason = reason
        h.error = error or h.error
        self.metrics["completion_tokens"] += h.completion_tokens
        self.metrics["cached_tokens"] += h.cached_tokens
        h._queue.put_nowait(_DONE)


__all__ = ["Engine", "Handle", "QueueFull", "Request", "ShuttingDown"]
