"""Many independent streams decoded together: one step-graph call per token for every live stream.

    streams = Streams(artifact_dir, threads=2)          # an artifact exported with --dynamic-batch
    a = streams.add(prompt_ids, temperature=0.8, top_k=40, seed=1)   # prefilled alone, at batch 1
    b = streams.add(other_ids, temperature=0, max_new_tokens=64)     # greedy
    new = streams.step()            # {stream id: new token} for every live stream, ONE graph call at batch N
    pieces = streams.prefill_many([(ids_a, None, 0), (ids_b, state_b, pos_b)])  # prompts at batch 2 (equal lengths)
    streams.drop(a)                 # frees its row
    streams.get_state(b); streams.save_state(b, path)   # batch-1 state, as Session.get_state / save_state
    c = streams.add(state=path, logits=last_logits)     # resume from a saved state (or give prompt_ids)

Each stream has its own sampling parameters and its own ``numpy`` generator (``seed``), and samples
exactly as ``Session.generate_ids`` does: the first new token from the prompt's last logits, then one
token per ``step()``. A stream stops when it samples one of ``stop_ids`` (default: the tokenizer's
end-of-sequence ids; the stop token is consumed into its state but not returned) or after
``max_new_tokens``; a stopped stream leaves the batch but keeps its state until ``drop``.

The live streams' state sits in rows 0..N-1 of ``[capacity, ...]`` buffers (two per state tensor,
the step graph reads one and writes the other; capacity ``max_streams``, or doubled as needed); ``add``
writes one row, ``drop`` moves the last row into the freed one, and both rebind views; ``step`` only
writes N token ids and runs. Each buffer has its graph input's dtype: float32, or a KV buffer exported with
``--kv-dtype float16`` or ``int8`` (ONNX Runtime's quantized cache: a row a quarter of float32's bytes) in
that dtype. States go in and out in float32 as ``Session.get_state`` / ``set_state`` take them (an int8
slot times its scales, ``kv_to_float``; written back with ``kv_from_float``); a prompt that ``add``
prefills is copied from the batch-1 session's buffer as it is, and a stopped stream keeps its state in the
graph's dtypes. Only the ONNX Runtime backend and fixed-size states: a growing softmax KV cache
(different lengths per stream) is refused. A preallocated KV buffer (softmax layers on the onnxruntime
target, manifest ``"shared": true``) batches: GroupQueryAttention takes each row's position, and the
buffer is bound as both past and present (written in place); a stream stops when its buffer is full
(the manifest's ``max_length``). Thread safety: every public call holds ``streams.lock``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from edgeattn.artifact.manifest import Manifest
from edgeattn.runtimes.base import kv_from_float, kv_to_float, kv_zeros
from edgeattn.runtimes.decode import Decoder
from edgeattn.runtimes.sampling import finite_logits


@dataclass
class _Stream:
    decoder: Decoder  # sampling, stop ids, the tokens produced, done (as Session.generate_ids)
    logits: np.ndarray  # [V], the logits of the next token
    position: int
    parked: dict | None = None  # the state of a stopped stream, batch 1 (None while live)
    max_length: int | None = None  # the tokens its state can hold (a KV buffer's length)
    # speculative decoding (``step_speculative``): the drafter, its draft-length schedule, the text so far
    # (prompt and chosen tokens), and the chosen tokens not yet in the state (while any, ``logits`` is stale)
    drafter: object = None
    schedule: object = None
    context: list | None = None
    todo: list = field(default_factory=list)
    idle: int = 0  # its rounds in a row that kept no draft
    skip: int = 0  # rounds it still steps without drafting (speculative.PLAIN_STRETCH)


def _sample(st: _Stream, sid: int, out: dict, stopped: list) -> int:
    """Sample stream ``st``'s next token with its decoder; record it in ``out`` (unless a stop token) and
    ``sid`` in ``stopped`` when the stream ends with it. Returns the token, which the step consumes either way
    (a stop token too, so the state holds it)."""
    tok = st.decoder.next(st.logits)
    if tok is not None:
        out[sid] = tok
        if st.max_length is not None and st.position + 1 >= st.max_length:
            st.decoder.done = True  # the KV buffer's last slot
    if st.decoder.done:
        stopped.append(sid)
    return st.decoder.last


def _layer_mixers(model: dict) -> list[str]:
    """The manifest's model config's mixer per layer (``EdgeConfig.mixers``, without importing the model)."""
    mixer, n = model.get("mixer", ""), int(model.get("n_layers", 0) or 0)
    if isinstance(mixer, list):
        return [str(x) for x in mixer]
    return [x.strip() for x in mixer.split(",")] if "," in mixer else [mixer] * n


def _is_kv(e, max_length: int | None) -> bool:
    """Whether state entry ``e`` is a KV buffer ``[B, Hkv, max_length, D]`` (its slots at or past a stream's
    position are never read: GroupQueryAttention reads and writes below it)."""
    return e.shared and len(e.shape) == 4 and e.shape[2] == max_length


class Streams:
    """N independent streams over one artifact, stepped together at batch N (see the module docstring)."""

    # The states that ``add`` writes into the batch rows and parks hold each KV buffer in its own dtype, as
    # the graph does (int8, float16); SerialStreams hands them to ``Session.set_state``, which takes float32.
    _native = True

    def __init__(
        self,
        artifact: str | os.PathLike | Manifest,
        *,
        threads: int | None = None,
        device: str | None = None,
        max_streams: int | None = None,
    ):
        import onnxruntime as ort

        from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession
        from edgeattn.runtimes.speculative import DraftGuard, Schedule

        self._ort = ort
        m = artifact if isinstance(artifact, Manifest) else Manifest.load(artifact)
        if not m.dynamic_batch or m.batch_size != 1:
            raise ValueError(
                f"{m.root} was exported with a fixed batch of {m.batch_size}: streams need graphs that take "
                "any batch; export again with --dynamic-batch (and --batch 1)"
            )
        cache = [e for e in m.state if any(isinstance(d, str) for d in e.shape[1:])]
        if cache:
            layers = sorted({e.layer for e in cache})
            mixers = _layer_mixers(m.data.get("model", {}))
            kinds = sorted({mixers[i] for i in layers if i < len(mixers)}) or ["softmax"]
            which = (
                "every layer holds"
                if len(layers) == len(mixers)
                else f"{len(layers)} of its {len(mixers)} layers hold"
            )
            raise ValueError(
                f"{m.root}: {which} a KV cache ({', '.join(kinds)}; layers {', '.join(map(str, layers))}), whose "
                f"state ({cache[0].input!r}) grows with every token, to a different length per stream: streams take "
                "fixed-size states only; use a model whose layers are all linear attention (or mixer 'swa'), or "
                "export with --target onnxruntime (a preallocated KV buffer)"
            )
        # a KV buffer's rows are held in its own dtype (float16, int8) and converted where a state is read or
        # written; other tensors of a reduced dtype (no export makes them) have no such conversion
        reduced = next((e for e in m.state if e.dtype != "float32" and not _is_kv(e, m.max_length)), None)
        if reduced is not None:
            raise ValueError(
                f"{m.root}: its state {reduced.input!r} is {reduced.dtype} but not a KV buffer [batch, kv heads, "
                "max_length, head dim]; streams hold float16 and int8 KV buffers only: export with --kv-dtype float32"
            )
        if max_streams is not None and (isinstance(max_streams, bool) or int(max_streams) < 1):
            raise ValueError(f"max_streams must be None or an integer >= 1, got {max_streams!r}")
        self.manifest = m
        self.max_streams = None if max_streams is None else int(max_streams)
        self.lock = threading.RLock()
        # A batch-1 session prefills new streams alone; its step graph also runs the batch-N steps.
        self._single = OnnxRuntimeSession(m, threads=threads, device=device)
        self._step_graph = self._single.sessions["step"]
        self._entries = list(m.state)
        self._streams: dict[int, _Stream] = {}
        self._rows: list[int] = []  # stream id of each batch row, in row order
        self._next_id = 0
        # two sets of [capacity, ...] state buffers; rows 0..N-1 hold the live streams, in self._rows order
        self._bufs: list[list[np.ndarray]] = [[], []]
        self._cur = 0
        self._grow(self.max_streams or 1)
        # speculative batches (step_speculative): the measured cost of a batch's calls, keyed by the tokens all
        # rows feed (``_batch_k`` reads it, ``_end_round`` feeds it), and whether drafting pays (DraftGuard)
        self._timing = Schedule()
        self._guard = DraftGuard()

    # ---- the batch buffers ----

    def _row_shape(self, e) -> tuple:
        return tuple(e.shape[1:])

    def _zeros(self, e, rows: int) -> np.ndarray:
        """Zero state ``[rows, ...]`` of entry ``e`` in its dtype (a KV buffer's without huge pages: ``kv_zeros``)."""
        shape = (rows, *self._row_shape(e))
        return kv_zeros(shape, e.dtype) if self._kv(e) else np.zeros(shape, e.dtype)

    def _grow(self, capacity: int) -> None:
        """Buffers for ``capacity`` rows (zeros: the OS commits pages as rows are used), the live rows
        copied over; a shared entry (a KV buffer that GroupQueryAttention writes in place) is one array in
        both sets."""
        n = len(self._rows)
        first = [self._zeros(e, capacity) for e in self._entries]
        for new, old in zip(first, self._bufs[self._cur]):
            new[:n] = old[:n]
        # np.zeros, not zeros_like (which writes its zeros, committing every page of every row at once)
        self._bufs = [
            first,
            [a if e.shared else np.zeros(a.shape, a.dtype) for a, e in zip(first, self._entries)],
        ]
        self._cur = 0
        self._capacity = capacity
        self._bind()

    def _bind(self) -> None:
        """Bind the step graph to rows 0..N-1 of both sets (A -> B and B -> A): views, no copies."""
        n = len(self._rows)
        V = self.manifest.vocab_size
        self._ids_np = np.zeros((n, 1), np.int64)
        self._logits_np = np.zeros((n, 1, V), np.float32)
        self._bindings = []
        if n == 0:
            return
        ort = self._ort
        ids = ort.OrtValue.ortvalue_from_numpy(self._ids_np)  # CPU OrtValues over the arrays' own memory
        logits = ort.OrtValue.ortvalue_from_numpy(self._logits_np)
        vals = [[ort.OrtValue.ortvalue_from_numpy(a[:n]) for a in bufs] for bufs in self._bufs]
        self._vals = (ids, logits, vals)  # the OrtValues must outlive the bindings
        for p in (0, 1):
            io = self._step_graph.io_binding()
            io.bind_ortvalue_input(self.manifest.input_ids_name, ids)
            io.bind_ortvalue_output(self.manifest.logits_name, logits)
            for i, e in enumerate(self._entries):
                io.bind_ortvalue_input(e.input, vals[p][i])
                io.bind_ortvalue_output(e.output, vals[1 - p][i])
            self._bindings.append(io)

    def _kv(self, e) -> bool:
        return _is_kv(e, self.manifest.max_length)

    def _put(self, e, dst: np.ndarray, src, filled: int) -> None:
        """Write ``src`` ([B, ...] values of entry ``e``, float32 or in ``e``'s dtype) into ``dst`` ([B, ...]):
        of a KV buffer the ``filled`` slots only (those past them are never read), converted as the batch-1
        session converts (``kv_from_float``, ``kv_to_float``) where the dtypes differ, copied where they agree."""
        src, held = np.asarray(src), np.dtype(e.dtype)
        if self._kv(e):
            dst, src = dst[:, :, :filled], src[:, :, :filled]
        if src.dtype == held and dst.dtype != held:  # the graph's values (int8: times the scales)
            src = kv_to_float(e, src)
        if dst.dtype == held and src.dtype != held:  # float values as the graph holds them
            src = kv_from_float(e, src)
        dst[...] = src

    def _row(
        self, arrays: list[np.ndarray], i: int, filled: int, native: bool = False
    ) -> dict[str, np.ndarray]:
        """Row ``i`` of [N, ...] state arrays, copied as a batch-1 state dict, float32 as ``Session.get_state``
        returns it (``native``: each tensor in its entry's dtype): of a KV buffer only the ``filled`` slots below
        the position, the rest zeros (pages the OS commits only when written)."""
        out = {}
        for a, e in zip(arrays, self._entries):
            dtype = np.dtype(e.dtype) if native else np.float32
            shape = (1, *a.shape[1:])
            row = kv_zeros(shape, dtype) if self._kv(e) else np.empty(shape, dtype)
            self._put(e, row, a[i : i + 1], filled)
            out[e.input] = row
        return out

    def _current(self) -> list[np.ndarray]:
        """The live rows of the current set, [N, ...] views."""
        n = len(self._rows)
        return [a[:n] for a in self._bufs[self._cur]]

    # ---- the API ----

    def __len__(self) -> int:
        """The number of streams held (live or stopped, not yet dropped)."""
        return len(self._streams)

    @property
    def live(self) -> list[int]:
        """Ids of the streams that the next ``step`` advances, in batch-row order (a stream that leaves
        the batch hands its row to the last one)."""
        return list(self._rows)

    @property
    def tokenizer(self):
        """The artifact's tokenizer (as ``Session.tokenizer``)."""
        return self._single.tokenizer

    @property
    def state_bytes_per_stream(self) -> int:
        """Bytes of recurrent state one stream holds (all layers, each tensor in its dtype: an int8 KV
        buffer's a quarter of float32's)."""
        return sum(
            np.dtype(e.dtype).itemsize * int(np.prod(self._row_shape(e), dtype=np.int64))
            for e in self._entries
        )

    def add(
        self,
        prompt_ids=None,
        *,
        state: dict | str | os.PathLike | None = None,
        position: int = 0,
        logits=None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_ids=None,
        max_new_tokens: int | None = None,
        logit_bias=None,
        processors=(),
        speculative: str | None = None,
        context=None,
    ) -> int:
        """Start a stream and return its id. ``prompt_ids`` (a 1-D list of token ids) is prefilled alone
        at batch 1, from zeros or from ``state`` (a batch-1 state dict as ``Session.get_state`` returns, or
        the path of a state file of this model). Without a prompt, ``state`` and ``logits`` (the next-token
        logits ``[vocab]`` that came with it) resume a stream as it was. Sampling: as ``sample_next``
        (``logit_bias``: OpenAI's ``{token id: bias}``, the ids checked against the vocabulary here). A
        state or logits holding NaN or infinity is a ValueError naming the argument (of a KV buffer only the
        slots below the state's position count: those past it are never read). ``processors``: the
        ``Decoder``'s logits processors (a grammar's mask, a logprobs recorder). ``speculative``: "ngram" (or a
        drafter object, as ``speculative.make_drafter`` returns, for this stream alone) drafts this stream by prompt lookup in ``step_speculative`` over ``context`` (the token ids before the state's
        end, when no ``prompt_ids`` give them) and the tokens it produces."""
        with self.lock:
            if speculative is not None:
                if not (speculative == "ngram" or hasattr(speculative, "propose")):
                    raise ValueError(
                        f"streams draft by prompt lookup: speculative must be 'ngram' (or a drafter object of "
                        f"this stream's own), got {speculative!r}"
                    )
                reason = self.speculative_refusal()
                if reason:
                    raise ValueError(reason)
            decoder = Decoder(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop_ids=self._single.tokenizer.eos_token_ids if stop_ids is None else stop_ids,
                max_new_tokens=max_new_tokens,
                logit_bias=logit_bias,
                vocab_size=self.manifest.vocab_size,
                processors=list(processors),
            )
            if self.max_streams is not None and len(self._rows) >= self.max_streams:
                raise ValueError(f"{len(self._rows)} streams are live, max_streams is {self.max_streams}")
            ids = None
            if prompt_ids is not None:
                ids = np.asarray(prompt_ids)
                if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                    raise ValueError(
                        f"prompt_ids must be a 1-D sequence of token ids, got shape {list(ids.shape)}"
                    )
                if ids.size == 0:
                    raise ValueError("prompt_ids is empty: give at least one token (or state and logits)")
            if ids is None and (state is None or logits is None):
                raise ValueError("add needs prompt_ids, or a state together with its next-token logits")
            if ids is not None and logits is not None:
                raise ValueError(
                    "give logits only without prompt_ids (the prompt's last logits come from prefill)"
                )
            if ids is not None:
                row, last, pos = self._prefill(ids, state, position, native=self._native)
            else:
                finite_logits(logits, "logits")
                last = np.asarray(logits, dtype=np.float32).reshape(-1)
                if last.shape != (self.manifest.vocab_size,):
                    raise ValueError(
                        f"logits must have shape [{self.manifest.vocab_size}], got {list(np.shape(logits))}"
                    )
                row, pos = self._load(state, position)
            if self.manifest.max_length is not None and pos >= self.manifest.max_length:
                raise ValueError(
                    f"the state holds {pos} tokens, this artifact's maximum ({self.manifest.max_length}): "
                    "no room for a new token"
                )
            sid = self._next_id
            self._next_id += 1
            self._streams[sid] = _Stream(
                decoder,
                logits=np.array(last, dtype=np.float32),
                position=pos,
                max_length=self.manifest.max_length,
            )
            if speculative is not None:
                from edgeattn.runtimes.speculative import NgramDrafter, Schedule

                st = self._streams[sid]
                st.drafter = NgramDrafter() if speculative == "ngram" else speculative
                st.schedule = getattr(st.drafter, "schedule", None) or Schedule()
                st.context = [
                    int(t)
                    for t in (prompt_ids if prompt_ids is not None else () if context is None else context)
                ]
            if decoder.done:  # max_new_tokens 0
                held = [row[e.input] for e in self._entries]
                self._streams[sid].parked = self._row(held, 0, pos, native=self._native)
                return sid
            self._enter(sid, row)
            return sid

    def _enter(self, sid: int, row: dict) -> None:
        """Append stream ``sid`` with batch-1 state ``row`` to the batch: one row written."""
        n = len(self._rows)
        if n == self._capacity:
            self._grow(2 * self._capacity)
        filled = self._streams[sid].position
        for a, e in zip(self._bufs[self._cur], self._entries):  # a KV buffer's slots past the position are
            self._put(e, a[n : n + 1], row[e.input], filled)  # never read: the row's old ones stay
        self._rows.append(sid)
        self._bind()

    def _load(self, state, position: int) -> tuple[dict, int]:
        """A batch-1 state (dict or state-file path) checked against the model, and its position. A dict is
        checked here, no copy through the session: of a KV buffer only the slots that are read (below the
        state's position entries, or ``position``) must be finite, the whole ``max_length`` row need not be
        read. A file comes back from the session, its KV buffers in their own dtype (``_native``)."""
        if not isinstance(state, (str, os.PathLike)):
            from edgeattn.artifact.state_file import check_state

            try:
                n = max(self._single._filled(state), int(position))
            except (KeyError, ValueError, OverflowError):
                n = None  # missing or non-finite positions: every slot checked, check_state names the tensor
            filled = None if n is None else {e.input: n for e in self._entries if self._kv(e)}
            check_state(
                state, {e.input: tuple(e.shape) for e in self._entries}, source="state", filled=filled
            )
            return {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}, int(position)
        sess = self._single
        with sess.lock:
            sess.reset()
            sess.load_state(state)
            return sess._get_state(native=self._native), sess.position

    def prefill(self, prompt_ids, *, state=None, position: int = 0) -> tuple[dict, np.ndarray, int]:
        """Consume ``prompt_ids`` (1-D) at batch 1, from zeros or from ``state`` (a batch-1 state dict
        at ``position``, or a state-file path), without starting a stream: ``(state, next-token logits
        [vocab], position)``, which ``add(state=..., logits=..., position=...)`` takes. A caller can so
        prefill a long prompt in pieces between ``step`` calls; pieces that are multiples of the
        manifest's prefill tokens give the same numbers as one call. The state is float32, as
        ``Session.get_state`` returns it."""
        return self._prefill(prompt_ids, state, position, native=False)

    def _prefill(self, prompt_ids, state, position: int, native: bool) -> tuple[dict, np.ndarray, int]:
        """``prefill``; with ``native`` the state's KV buffers in their own dtype, copied from the batch-1
        session's (what ``add`` writes into a batch row: no float32 round trip)."""
        with self.lock:
            ids = np.asarray(prompt_ids)
            if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
                raise ValueError(
                    f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {list(ids.shape)}"
                )
            sess = self._single
            with sess.lock:
                sess.reset()
                if isinstance(state, (str, os.PathLike)):
                    sess.load_state(state)
                elif state is not None:
                    sess.set_state(state, position=int(position))
                last = sess.prefill(ids[None].astype(np.int64))[0]
                return sess._get_state(native=native), np.array(last, dtype=np.float32), sess.position

    def prefill_many(self, pieces: list[tuple]) -> list[tuple[dict, np.ndarray, int]]:
        """``prefill`` of several prompts at once: ``pieces`` is a list of ``(prompt_ids, state, position)``
        whose ids all have the same length, consumed together at batch B in the chunks ``prefill`` uses
        (full chunks through the prefill graph, the rest as ``Session.prefill`` does), each row from its
        own state (a batch-1 dict, or None: zeros) and position. Returns ``prefill``'s triple per piece.
        With a KV buffer only new prompts whose pieces fit one call (``prefill_tokens``) are prefilled
        together (GroupQueryAttention takes a batch of one where a call has several tokens and a past),
        others one after another."""
        with self.lock:
            alone = len(pieces) == 1
            if any(self._kv(e) for e in self._entries):
                first = all(state is None and pos == 0 for _, state, pos in pieces)
                alone = alone or not first or len(pieces[0][0]) > self.manifest.prefill_tokens
            if alone:
                return [self.prefill(ids, state=state, position=pos) for ids, state, pos in pieces]
            rows = [np.asarray(p[0]) for p in pieces]
            if any(
                r.ndim != 1 or r.size == 0 or r.dtype.kind not in "iu" or r.size != rows[0].size for r in rows
            ):
                raise ValueError("prefill_many takes non-empty 1-D pieces of token ids, all of one length")
            ids = np.stack(rows).astype(np.int64)  # [B, T]
            B, T = ids.shape
            cur = []  # [B, ...] per state entry, a row per piece
            for e in self._entries:
                a = self._zeros(e, B)
                for r, (_, state, position) in enumerate(pieces):
                    if state is not None:
                        self._put(e, a[r : r + 1], state[e.input], position)
                cur.append(a)
            C = self.manifest.prefill_tokens
            spans = [(c, min(c + C, T)) for c in range(0, T, C)]
            if spans[-1][1] - spans[-1][0] < C and not self._single.any_tokens:  # the rest one step at a time
                last = spans.pop()
                spans += [(t, t + 1) for t in range(*last)]
            for a, b in spans:
                graph = "prefill" if b - a == C or self._single.any_tokens else "step"
                cur, logits = self._run_batch(graph, ids[:, a:b], cur)
            out = []
            for r, (_, _, position) in enumerate(pieces):
                state = self._row(cur, r, int(position) + T)
                out.append((state, np.array(logits[r, -1], dtype=np.float32), int(position) + T))
            return out

    def _run_batch(self, graph: str, ids: np.ndarray, state: list[np.ndarray]):
        """One call of ``graph`` on ids [B, n] from ``state`` ([B, ...] per entry): the new state (a shared
        entry, a KV buffer, written in place) and the logits."""
        ort = self._ort
        sess = self._single.sessions[graph]
        io = sess.io_binding()
        keep = [np.ascontiguousarray(ids)]  # the arrays under the OrtValues must outlive the run
        io.bind_ortvalue_input(self.manifest.input_ids_name, ort.OrtValue.ortvalue_from_numpy(keep[0]))
        io.bind_output(self.manifest.logits_name, "cpu")
        new = []
        for a, e in zip(state, self._entries):
            b = a if e.shared else np.empty_like(a)
            keep += [a, b]
            io.bind_ortvalue_input(e.input, ort.OrtValue.ortvalue_from_numpy(a))
            io.bind_ortvalue_output(e.output, ort.OrtValue.ortvalue_from_numpy(b))
            new.append(b)
        sess.run_with_iobinding(io)
        return new, io.get_outputs()[0].numpy()

    def _stream(self, sid) -> _Stream:
        if sid not in self._streams:
            raise ValueError(f"no stream with id {sid!r} (held: {sorted(self._streams)})")
        return self._streams[sid]

    def _held(self, sid: int) -> None:
        if sid not in self._rows:
            raise ValueError(f"stream {sid} ended without its state (its sampling failed)")

    def _park(self, sids: list[int], keep: bool = True) -> None:
        """Take the rows of ``sids`` out of the batch, keeping each one's state in its stream (``keep``)."""
        if keep:
            self._settle(sids)
        live = self._current()
        for i, s in enumerate(self._rows):
            if keep and s in sids and self._streams.get(s) is not None:
                self._streams[s].parked = self._row(live, i, self._streams[s].position, native=True)
        rows, cur = self._rows, self._bufs[self._cur]
        for i in sorted((i for i, s in enumerate(rows) if s in sids), reverse=True):
            last = len(rows) - 1
            if i != last:  # the last row moves into the freed one: one row copied, whatever N
                for a in cur:
                    a[i] = a[last]
                rows[i] = rows[last]
            rows.pop()
        self._bind()

    def _fail_row(self, sid: int, e: Exception, errors: dict | None, failed: list) -> None:
        """Stream ``sid``'s error ``e``: raised without ``errors``; with it, recorded in ``errors[sid]``, the
        stream done and listed in ``failed`` (the caller parks those without their state)."""
        if errors is None:
            raise e
        errors[sid] = e
        self._streams[sid].decoder.done = True
        failed.append(sid)

    def _sample_all(self, out: dict, stopped: list, errors: dict | None) -> dict[int, int]:
        """Every live stream's next token (``_sample``); with ``errors``, a stream whose sampling fails is
        taken out of the batch (state discarded) and its error recorded, without a step."""
        if errors is None:
            for sid in self._rows:  # non-finite logits stop the step before any stream changes
                finite_logits(self._streams[sid].logits, f"stream {sid}'s logits")
        toks, failed = {}, []
        for sid in self._rows:
            st = self._streams[sid]
            try:
                toks[sid] = _sample(st, sid, out, stopped)
            except Exception as e:
                self._fail_row(sid, e, errors, failed)
        if failed:
            self._park(failed, keep=False)
        return toks

    def drop(self, sid: int) -> None:
        """Forget a stream (live or stopped) and free its row."""
        with self.lock:
            self._stream(sid)
            if sid in self._rows:
                self._park([sid], keep=False)
            del self._streams[sid]

    def done(self, sid: int) -> bool:
        """Whether the stream stopped (a stop token or ``max_new_tokens``)."""
        with self.lock:
            return self._stream(sid).decoder.done

    def generated(self, sid: int) -> list[int]:
        """The token ids the stream has produced (stop tokens excluded)."""
        with self.lock:
            return list(self._stream(sid).decoder.generated)

    def logits(self, sid: int) -> np.ndarray:
        """The stream's next-token logits ``[vocab]`` (a copy)."""
        with self.lock:
            self._settle([sid])
            return self._stream(sid).logits.copy()

    def position(self, sid: int) -> int:
        """Tokens the stream's state has consumed."""
        with self.lock:
            return self._stream(sid).position

    def get_state(self, sid: int) -> dict[str, np.ndarray]:
        """A copy of the stream's state, batch 1, keyed by the graph input names (``Session.set_state`` takes it)."""
        with self.lock:
            st = self._stream(sid)
            if st.parked is not None:  # of a KV buffer the filled slots only, float32, as from the batch rows
                return self._row([st.parked[e.input] for e in self._entries], 0, st.position)
            self._held(sid)
            self._settle([sid])
            return self._row(self._current(), self._rows.index(sid), st.position)

    def save_state(self, sid: int, path: str | os.PathLike) -> None:
        """Write the stream's state as a state file (``Session.load_state`` and ``add(state=path)`` read it)."""
        from edgeattn.artifact.state_file import save_state

        with self.lock:
            save_state(
                path, self.get_state(sid), fingerprint=self.manifest.fingerprint, position=self.position(sid)
            )

    def step(self, errors: dict | None = None) -> dict[int, int]:
        """Sample each live stream's next token from its logits (its own parameters and generator) and run
        the step graph ONCE on all of them at batch N. Returns {stream id: new token} for the streams that
        produced one; a stream that sampled a stop token (consumed, not returned) or reached
        ``max_new_tokens`` is done and leaves the batch.

        A stream whose sampling fails (non-finite logits, say) is a ValueError before any stream changes;
        with ``errors`` (a dict) it ends that stream alone instead: the error goes in ``errors[sid]``, the
        stream is done and leaves the batch without its state (``get_state`` refuses it; ``drop`` it), and
        the others step (a server's requests are independent)."""
        with self.lock:
            if not self._rows:
                return {}
            self._settle(self._rows)  # tokens a speculative round chose but the state lacks
            out, stopped = {}, []
            toks = self._sample_all(out, stopped, errors)
            if not self._rows:
                return out
            for i, sid in enumerate(self._rows):
                self._ids_np[i, 0] = toks[sid]
            self._step_graph.run_with_iobinding(self._bindings[self._cur])
            self._cur = 1 - self._cur
            logits = self._logits_np[:, 0].copy()  # [N, V]
            for i, sid in enumerate(self._rows):
                st = self._streams[sid]
                st.logits = logits[i]
                st.position += 1
            if stopped:
                self._park(stopped)
            return out

    # ---- speculative decoding: drafts per stream, the batch verified in one call ----

    def speculative_refusal(self) -> str | None:
        """Why ``step_speculative`` cannot run on this artifact (None: it can): the batch-1 session's reasons
        (one graph for any number of tokens on the CPU, its logits at every position)."""
        return self._single.speculative_refusal()

    def _settle(self, sids) -> None:
        """Feed each listed live stream's chosen tokens that its state lacks (``todo``, left by a rolled-back
        speculative round), alone at batch 1 in its own row: then its state, position and ``logits`` are plain
        decoding's."""
        for sid in list(sids):
            st = self._streams.get(sid)
            if st is None or not st.todo or sid not in self._rows:
                continue
            i = self._rows.index(sid)
            rows = [a[i : i + 1] for a in self._bufs[self._cur]]
            new, logits = self._run_batch("prefill", np.asarray([st.todo], np.int64), rows)
            for a, b in zip(rows, new):
                if b is not a:  # (a KV buffer was written in place)
                    a[...] = b
            st.logits = np.array(logits[0, -1], dtype=np.float32)
            st.position += len(st.todo)
            st.todo = []

    def _run_rows(self, ids: np.ndarray) -> np.ndarray:
        """The one graph on ids [N, T] of the live rows, reading the current set of buffers and writing the
        other (a KV buffer in place); logits [N, T, V]. One token per row: the step's own bindings."""
        n, T = ids.shape
        if T == 1:
            self._ids_np[:, 0] = ids[:, 0]
            self._step_graph.run_with_iobinding(self._bindings[self._cur])
            self._cur = 1 - self._cur
            return self._logits_np.copy()
        ort = self._ort
        ids = np.ascontiguousarray(ids, np.int64)
        logits = np.empty((n, T, self.manifest.vocab_size), np.float32)
        io = self._step_graph.io_binding()
        keep = [ort.OrtValue.ortvalue_from_numpy(ids), ort.OrtValue.ortvalue_from_numpy(logits)]
        io.bind_ortvalue_input(self.manifest.input_ids_name, keep[0])
        io.bind_ortvalue_output(self.manifest.logits_name, keep[1])
        if self.manifest.prefill_logits == "last":  # every position's logits (speculative_refusal checked)
            keep.append(ort.OrtValue.ortvalue_from_numpy(np.array([T], np.int64)))
            io.bind_ortvalue_input(self.manifest.logits_count, keep[-1])
        for e, a, b in zip(self._entries, self._bufs[self._cur], self._bufs[1 - self._cur]):
            va, vb = ort.OrtValue.ortvalue_from_numpy(a[:n]), ort.OrtValue.ortvalue_from_numpy(b[:n])
            keep += [va, vb]
            io.bind_ortvalue_input(e.input, va)
            io.bind_ortvalue_output(e.output, vb)
        self._step_graph.run_with_iobinding(io)
        self._cur = 1 - self._cur
        return logits

    def _full(self, st: _Stream, held: int) -> None:
        """A stream whose KV buffer holds ``held`` tokens once its chosen ones are fed stops at its last slot."""
        if st.max_length is not None and held >= st.max_length:
            st.decoder.done = True

    def _batch_k(self, drafts: dict) -> int:
        """The draft length for every row of a batch: the k that maximizes the tokens all rows expect (``1 + a +
        ... + a^k`` per row, ``a`` its schedule's chance for its drafts, k cut to the drafts it has) over the
        measured cost of the call (every row pays for the longest: it is padded to it, and a padded row feeds
        its tokens again), which must beat the call without drafts by the schedule's margin. The calls' costs
        are measured for the batch as a whole (``self._timing``), by the tokens a call feeds in all (rows times
        its length): a server's batch changes size as clients come and go, so its plain rounds alone measure
        how the cost grows with the tokens fed (on 2 cores the linearized SmolLM2's call costs about rows times
        length: there, drafting in a batch cannot pay unless nearly every row keeps its drafts)."""
        timing = self._timing
        rows = []
        for sid, d in drafts.items():
            st = self._streams[sid]
            a = st.schedule.alphas.get(getattr(st.drafter, "match", None), st.schedule.PRIOR) if d else 0.0
            rows.append((len(st.todo), len(d), a))
        N = len(rows)
        base = max(m for m, _, _ in rows)
        best_k, best = 0, timing.MARGIN * N / timing.cost(N * base)
        # (incrementally over k: this runs every drafting round, beside a call of a millisecond for a small model)
        expected, powers = float(N), [1.0] * N
        for k in range(1, max(n for _, n, _ in rows) + 1):
            longest = base
            for i, (m, n, a) in enumerate(rows):
                if n >= k:
                    powers[i] *= a
                    expected += powers[i]
                longest = max(longest, m + min(k, n))
            rate = expected / timing.cost(N * longest)
            if rate > best:
                best_k, best = k, rate
            elif k >= best_k + 2:  # two longer drafts in a row worse: the gain is geometric, the cost linear
                break
        return best_k

    def step_speculative(self, errors: dict | None = None, stats=None) -> dict[int, list[int]]:
        """``step`` with drafts: each live stream added with ``speculative="ngram"`` drafts its next tokens by
        prompt lookup (its own schedule sets how many), and ONE call of the one graph at batch N feeds every
        row its chosen tokens that the state lacks plus its drafts (rows padded to the longest); each row keeps
        the drafts its own choices reproduce (``edgeattn.runtimes.speculative``: greedy, or sampled with its
        generator, the tokens plain decoding would give). A row whose drafts were not all kept, or that was
        padded, goes back to the state before the call (its row of the other buffer set) and feeds the tokens
        it chose again at the start of the next call. A call in which no row drafts pads nothing: each row feeds
        the first T of its pending tokens, T the fewest any row has, and the rest wait for the next call (else
        the padded rows would feed again next call, padding the others in turn: every call two tokens long for
        one token a row). Returns {stream id: [new tokens]}; ``errors`` as ``step``;
        the rounds are counted in ``stats`` (a ``SpeculativeStats``; default ``self.speculative_stats``, one
        round per row and call).

        A KV buffer (GroupQueryAttention) takes several tokens with a past at batch 1 only: on such an artifact
        the streams draft while one stream is live, and feed one token each a call while several are."""
        from edgeattn.runtimes.speculative import (
            MAX_DRAFT,
            MAX_TODO,
            PLAIN_STRETCH,
            SpeculativeStats,
        )

        with self.lock:
            if not self._rows:
                return {}
            if stats is None:
                stats = self.speculative_stats = (
                    getattr(self, "speculative_stats", None) or SpeculativeStats()
                )
            t0 = time.perf_counter()
            # (pending tokens of a row that drafted alone are fed one a call, with the others' steps)
            one_token = len(self._rows) > 1 and any(self._kv(e) for e in self._entries)
            out: dict[int, list[int]] = {}
            failed: list[int] = []

            def choose(sid, st, logits) -> int | None:
                if errors is None:
                    finite_logits(logits, f"stream {sid}'s logits")
                tok = st.decoder.next(logits)
                if tok is not None:
                    out.setdefault(sid, []).append(tok)
                    if st.context is not None:
                        st.context.append(tok)
                return tok

            for sid in list(self._rows):  # streams with nothing chosen: their next token, as ``step``
                st = self._streams[sid]
                if st.todo:
                    continue
                try:
                    choose(sid, st, st.logits)
                except Exception as e:
                    self._fail_row(sid, e, errors, failed)
                    continue
                st.todo = [st.decoder.last]
                self._full(st, st.position + 1)
            if failed:
                self._park(failed, keep=False)
                failed = []
            if not self._rows:
                return out
            drafts, skipped = {}, set()
            n = len(self._rows)
            # a batch drafts in the epochs its realized throughput says pay (DraftGuard)
            guard = self._guard if n > 1 else None
            before = {sid: self._streams[sid].position for sid in self._rows} if guard is not None else {}
            plain = guard is not None and guard.mode == "plain"  # (then no row drafts, nor counts its skips)
            for sid in self._rows:
                st, dec, d = self._streams[sid], self._streams[sid].decoder, []
                if plain:
                    drafts[sid] = d
                    continue
                if st.skip:
                    st.skip -= 1
                    skipped.add(sid)
                elif st.drafter is not None and not dec.done and not one_token and len(st.todo) <= MAX_TODO:
                    remaining = (
                        None if dec.max_new_tokens is None else dec.max_new_tokens - len(dec.generated)
                    )
                    top = MAX_DRAFT if remaining is None else min(MAX_DRAFT, remaining - 1)
                    if st.max_length is not None:  # the drafts must fit in the KV buffer
                        top = min(top, st.max_length - st.position - len(st.todo))
                    if top > 0:
                        d, qs = st.drafter.propose(st.context, top, dec)
                        if qs is not None:
                            raise ValueError("streams take drafts of fixed tokens (no draft distributions)")
                        if d and (len(self._rows) == 1 or not st.schedule.stretch):  # alone: its own schedule
                            d = d[
                                : st.schedule.next_k(
                                    len(st.todo), remaining, getattr(st.drafter, "match", None)
                                )
                            ]
                drafts[sid] = [int(x) for x in d]
            if (
                n > 1
                and any(drafts.values())
                and all(st.schedule.stretch for st in self._streams.values() if st.schedule)
            ):
                k = self._batch_k(drafts)  # one draft length for the batch
                drafts = {sid: d[:k] for sid, d in drafts.items()}
            if (
                n > 1
                and not any(drafts.values())
                and all(len(self._streams[s].todo) == 1 for s in self._rows)
            ):
                return self._plain_round(out, choose, errors, stats, guard, before, t0)
            if any(drafts.values()):  # rows padded to the longest (a padded row goes back and feeds again)
                T = max(len(self._streams[s].todo) + len(drafts[s]) for s in self._rows)
            else:  # no drafts: each row feeds the first T of its tokens, T the fewest any row has: nothing is
                # padded, so nothing goes back (padding here would make the rows that fed fewer tokens feed them
                # again next call, in turn padding the others: every call two tokens long for one token a row)
                T = 1 if one_token else min(len(self._streams[s].todo) for s in self._rows)
            ids = np.empty((n, T), np.int64)
            for i, sid in enumerate(self._rows):
                fed = (self._streams[sid].todo + drafts[sid])[:T]
                ids[i, : len(fed)], ids[i, len(fed) :] = fed, fed[-1]  # padding: never kept
            logits = self._run_rows(ids)
            old = self._bufs[1 - self._cur]
            stopped, rounds = [], []
            for i, sid in enumerate(self._rows):
                st, d = self._streams[sid], drafts[sid]
                m, chosen = len(st.todo), []
                if (
                    m > T
                ):  # fed the first T of its tokens (no drafts this call): the rest wait, nothing chosen
                    st.position += T
                    st.todo = st.todo[T:]
                    stats.rounds += 1
                    if st.decoder.done:  # (parking feeds the rest)
                        stopped.append(sid)
                    continue
                try:
                    for j in range(len(d) + 1 if not st.decoder.done else 0):
                        tok = choose(sid, st, logits[i, m - 1 + j])
                        chosen.append(st.decoder.last)
                        self._full(st, st.position + m + len(chosen))
                        if st.decoder.done or j == len(d) or tok != d[j]:
                            break
                except Exception as e:
                    self._fail_row(sid, e, errors, failed)
                    continue
                kept = next(
                    (j for j, (a, b) in enumerate(zip(chosen, d)) if a != b), min(len(chosen), len(d))
                )
                if (
                    chosen[: len(d)] == d and m + len(d) == T
                ):  # every draft kept, nothing padded: the state is right
                    st.position += T
                    st.logits = logits[i, T - 1].copy()
                    st.todo = chosen[len(d) :]
                else:  # back to the state before the call; what it held that was kept is fed again next call
                    for e, a, b in zip(self._entries, self._bufs[self._cur], old):
                        if not e.shared:  # (a KV buffer comes back by its position)
                            a[i] = b[i]
                    stats.readvanced += m + kept
                    st.todo = st.todo + chosen
                stats.rounds += 1
                stats.drafting_rounds += bool(d)
                stats.drafted += len(d)
                stats.accepted += kept
                stats.tokens += len(chosen)
                if st.schedule is not None and sid not in skipped:
                    rounds.append((st, len(d), kept))
                if (
                    d
                ):  # a stream whose drafts are not kept steps plainly for a stretch (as a lone session does;
                    # not one whose drafts the batch left out: the rows would fall out of step)
                    st.idle = 0 if kept else st.idle + 1
                    st.skip = min(st.idle, PLAIN_STRETCH) if st.schedule.stretch else 0
                if st.decoder.done:
                    stopped.append(sid)
            seconds = time.perf_counter() - t0
            for st, drafted, kept in rounds:
                if n == 1:  # a row's schedule prices its calls alone (a batch's are ``self._timing``'s)
                    st.schedule.observe(T, seconds)
                st.schedule.update(drafted, kept, getattr(st.drafter, "match", None))
            self._end_round(T, seconds, failed, stopped, guard, before)
            return out

    def _end_round(self, T: int, seconds: float, failed, stopped, guard, before: dict) -> None:
        """A speculative round's end: the batch's call of T tokens a row timed (``_batch_k``), the failed and stopped
        rows parked, and the round's progress (the tokens that entered the rows' states, not those to feed
        again) counted by the ``DraftGuard``."""
        if len(before) > 1:
            self._timing.observe(len(before) * T, seconds)
        if failed:
            self._park(failed, keep=False)
        if stopped:
            self._park(stopped)
        if guard is not None:
            fed = sum(self._streams[sid].position - p for sid, p in before.items() if sid in self._streams)
            if guard.record(fed, seconds, len(before)):
                guard.close()

    def _plain_round(self, out, choose, errors, stats, guard, before, t0) -> dict[int, list[int]]:
        """``step_speculative``'s round when no row drafts and each has one token to feed (most rounds of a
        batch that does not draft): the step's call on those tokens, then each row's next token, without a
        drafting round's bookkeeping (a small model's call costs less than that: a GLA of 0.2 ms lost 17% at
        16 streams)."""
        n = len(self._rows)  # (> 1: a lone stream's schedule times its own plain rounds)
        ids = np.fromiter((self._streams[s].todo[0] for s in self._rows), np.int64, n)[:, None]
        logits = self._run_rows(ids)
        stopped, failed = [], []
        for i, sid in enumerate(self._rows):
            st = self._streams[sid]
            st.position += 1
            st.logits = logits[i, 0]  # (a fresh copy: _run_rows returns one)
            stats.rounds += 1
            if st.decoder.done:  # (its stop token was the one fed)
                st.todo = []
                stopped.append(sid)
                continue
            try:
                choose(sid, st, st.logits)
            except Exception as e:
                st.todo = []
                self._fail_row(sid, e, errors, failed)
                continue
            st.todo = [st.decoder.last]
            self._full(st, st.position + 1)
            stats.tokens += 1
            if st.decoder.done:
                stopped.append(sid)
        self._end_round(1, time.perf_counter() - t0, failed, stopped, guard, before)
        return out


class SerialStreams(Streams):
    """The ``Streams`` API, one live stream at a time, for the artifacts ``Streams`` refuses (a fixed
    batch, a growing KV cache): the live stream's state stays in one batch-1
    session and ``step`` runs the step graph at batch 1. ``add`` (and ``prefill``) refuse while a stream
    is live; a stopped stream keeps a copy of its state until ``drop`` as in ``Streams``."""

    def __init__(self, artifact, *, threads: int | None = None, device: str | None = None):
        from edgeattn.runtimes.onnxruntime import OnnxRuntimeSession

        m = artifact if isinstance(artifact, Manifest) else Manifest.load(artifact)
        if m.batch_size != 1:
            raise ValueError(f"{m.root} was exported for batch {m.batch_size}; export again with --batch 1")
        self.manifest = m
        self.max_streams = 1
        self.lock = threading.RLock()
        self._single = OnnxRuntimeSession(m, threads=threads, device=device)
        self._entries = list(m.state)
        self._streams = {}
        self._rows = []
        self._next_id = 0

    _native = False  # the live stream's state goes through Session.set_state / get_state: float32

    def speculative_refusal(self) -> str | None:
        return (
            f"{self.manifest.root}: speculative serving verifies the streams' drafts in one batched call; this "
            "artifact serves one stream at a time (export with --dynamic-batch and --batch 1)"
        )

    @property
    def state_bytes_per_stream(self) -> int:
        """Bytes of state one stream holds at the start (a growing cache counted empty)."""
        return sum(
            np.dtype(e.dtype).itemsize * int(np.prod([d for d in e.shape[1:] if not isinstance(d, str)]))
            for e in self._entries
        )

    def _busy(self) -> None:
        if self._rows:
            raise ValueError(
                f"this artifact serves one stream at a time and stream {self._rows[0]} is live; drop it first"
            )

    def _prefill(self, prompt_ids, state, position: int, native: bool):
        with self.lock:
            self._busy()
            return super()._prefill(prompt_ids, state, position, native)

    def prefill_many(self, pieces: list[tuple]) -> list[tuple[dict, np.ndarray, int]]:
        return [self.prefill(ids, state=state, position=pos) for ids, state, pos in pieces]

    def _load(self, state, position: int):
        self._busy()
        return super()._load(state, position)

    def _enter(self, sid: int, row: dict) -> None:
        self._single.set_state(row, position=self._streams[sid].position)
        self._rows.append(sid)

    def _park(self, sids: list[int], keep: bool = True) -> None:
        for sid in sids:
            if keep and sid in self._rows and sid in self._streams:
                self._streams[sid].parked = self._single.get_state()
        self._rows = [s for s in self._rows if s not in sids]

    def get_state(self, sid: int) -> dict[str, np.ndarray]:
        with self.lock:
            st = self._stream(sid)
            if st.parked is not None:
                return {k: v.copy() for k, v in st.parked.items()}
            self._held(sid)
            return self._single.get_state()

    def step(self, errors: dict | None = None) -> dict[int, int]:
        with self.lock:
            if not self._rows:
                return {}
            sid = self._rows[0]
            st = self._streams[sid]
            out, stopped = {}, []
            tok = self._sample_all(out, stopped, errors).get(sid)
            if not self._rows:
                return out
            st.logits = np.array(self._single.step(np.array([[tok]], np.int64))[0], dtype=np.float32)
            st.position += 1
            if stopped:
                self._park(stopped)
            return out


def open_streams(artifact, *, threads: int | None = None, device: str | None = None, max_streams=None):
    """``Streams`` where the artifact batches, else ``SerialStreams``: ``(streams, reason)``, ``reason``
    None or one line saying why the artifact runs one stream at a time."""
    try:
        return Streams(artifact, threads=threads, device=device, max_streams=max_streams), None
    except ValueError as e:
        m = artifact if isinstance(artifact, Manifest) else Manifest.load(artifact)
        if m.batch_size != 1:
            raise
        return SerialStreams(m, threads=threads, device=device), str(e)


__all__ = ["SerialStreams", "Streams", "open_streams"]
