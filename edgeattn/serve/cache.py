"""The prefix-state cache: the state after a sequence of token ids, found again by any longer sequence.

An entry is the batch-1 state after consuming ``tokens[:n]`` together with the next-token logits that came
with it, under the key ``sha256(fingerprint, tokens[:n])``. ``lookup(tokens)`` returns the entry of the
longest cached prefix of ``tokens`` (possibly all of them): the caller resumes from its state and logits
and prefills only ``tokens[n:]``. Only the lengths that are cached are hashed (one incremental pass over
the ids), so a lookup costs O(len(tokens)) whatever the number of entries.

Memory: least recently used entries are evicted beyond ``capacity_bytes`` (state plus logits bytes).
The engine keeps one state per conversation in memory, and the states that several requests share:
- it stores the state after a finished reply with ``reply_to`` (the prompt's ids): the prompt's entry,
  which the reply's extends, is marked shared if another request has resumed from it meanwhile
  (``Entry.uses``: a system prompt, a regenerated turn), else it leaves memory, provided the reply's text
  encodes back to its token ids (``round_trips``: the client can send it back and land on the reply's
  state; a reply that cannot, such as invalid UTF-8 from a byte-level model, keeps its prompt's entry);
- it stores a prompt's state with ``supersede``: the entries of shorter prefixes of the prompt leave
  memory (the conversation has moved on) unless shared or used by another request too, and so do the
  replies to shorter prefixes that the prompt does not extend (a reply that came back re-encoded to
  other tokens) unless a lookup has used them or the prefix is shared (they are other conversations').
A conversation whose replies come back as they were generated so holds one state, one whose replies come
back re-encoded two (its last prompt's and its last reply's). A next turn that extends neither (an edited
earlier message) finds nothing in memory (the disk, if any, holds every entry).
Disk (``directory``): every entry is also written as a state file (``edgeattn.runtimes.state_file``:
checksummed, written atomically) named ``{n}-{key}.state``, holding the state tensors plus one more tensor,
``next_token_logits`` ``[1, vocab]``; the directory is indexed at start (by file name, nothing read), and an
entry evicted from memory or written before a restart is read back on its first hit. A file that is
damaged, of another model or of another length is skipped with one log line and never used. The disk
holds every entry ever written (no eviction there).

Models with a KV-buffer layer (softmax layers on GroupQueryAttention) cache their buffer as it is in the
state: the whole preallocated ``[1, Hkv, max_length, D]`` key and value buffers per layer, whatever the
position, so an entry counts the full buffer bytes (``state_bytes`` of the artifact) against the capacity;
in memory the slots past its position are zeros that ``Streams`` never wrote (pages the OS does not
commit), so its RSS is about the prefix's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeattn.artifact.state_file import load_state, save_state

LOGITS = "next_token_logits"
_NAME = re.compile(r"^(\d+)-([0-9a-f]{64})\.state$")
log = logging.getLogger("edgeattn.serve")


@dataclass
class Entry:
    n: int  # tokens consumed
    state: dict  # batch-1 state by graph input name
    logits: np.ndarray  # [vocab] next-token logits
    uses: int = 0  # lookups that resumed from it
    shared: bool = False  # another request resumed from it while its own ran: never superseded

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state.values()) + int(self.logits.nbytes)


class PrefixCache:
    """See the module docstring. Not thread-safe: one owner (the engine's worker thread) calls it."""

    def __init__(
        self,
        fingerprint: str,
        shapes: dict[str, tuple],
        capacity_bytes: int,
        directory: str | os.PathLike | None = None,
    ):
        if capacity_bytes < 0:
            raise ValueError(f"the cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.fingerprint = fingerprint
        self.shapes = dict(shapes)  # state input name -> shape (a str dimension matches any size)
        self.capacity = int(capacity_bytes)
        self.directory = None if directory is None else Path(directory)
        self._mem: OrderedDict[str, Entry] = OrderedDict()
        self._disk: dict[str, Path] = {}
        self._lengths: dict[int, set[str]] = {}  # n -> keys held (memory or disk)
        # prompt key -> (its n, the key of the state after its reply)
        self._replies: dict[str, tuple[int, str]] = {}
        self._prompt_of: dict[str, str] = {}  # reply key -> prompt key (the inverse of _replies)
        self.bytes = 0
        self.hits = self.misses = self.hit_tokens = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(self.directory.iterdir()):
                m = _NAME.match(path.name)
                if m and path.is_file():
                    self._index(int(m.group(1)), m.group(2))
                    self._disk[m.group(2)] = path

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 or self.directory is not None

    def __len__(self) -> int:
        return len(set(self._mem) | set(self._disk))

    def _index(self, n: int, key: str) -> None:
        self._lengths.setdefault(n, set()).add(key)

    def _unindex(self, n: int, key: str) -> None:
        keys = self._lengths.get(n, set())
        keys.discard(key)
        if not keys:
            self._lengths.pop(n, None)

    def key(self, tokens) -> str:
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(np.asarray(tokens, dtype="<i4").tobytes())
        return h.hexdigest()

    def _prefix_keys(self, tokens: np.ndarray) -> list[tuple[int, str]]:
        """(n, key) for every cached length n <= len(tokens), longest first: one incremental hash pass."""
        # the lengths held, and those of prompts whose reply is held (their entry may have left)
        held = set(self._lengths) | {n for n, _ in self._replies.values()}
        lengths = sorted(n for n in held if 0 < n <= len(tokens))
        h = hashlib.sha256(self.fingerprint.encode())
        data = np.asarray(tokens, dtype="<i4")
        out, done = [], 0
        for n in lengths:
            h.update(data[done:n].tobytes())
            done = n
            out.append((n, h.copy().hexdigest()))
        return out[::-1]

    def lookup(self, tokens) -> Entry | None:
        """The entry of the longest cached prefix of ``tokens`` (None: a miss), counted in the stats."""
        tokens = np.asarray(tokens)
        for n, key in self._prefix_keys(tokens):
            if key not in self._lengths.get(n, ()):
                continue
            entry = self._mem.get(key)
            if entry is not None:
                self._mem.move_to_end(key)
            else:
                entry = self._read(n, key)
                if entry is None:
                    continue
                self._remember(key, entry)
            entry.uses += 1
            self.hits += 1
            self.hit_tokens += n
            return entry
        self.misses += 1
        return None

    def put(
        self, tokens, state: dict, logits, supersede: bool = False, reply_to=None, round_trips: bool = True
    ) -> None:
        """Store the state after ``tokens`` (a copy is not made: give arrays nobody changes). With
        ``supersede`` the entries of shorter prefixes of ``tokens`` leave memory (not the disk), and so do
        the replies recorded for them, unless shared. ``reply_to``: the ids of the prompt this state is the
        reply to (a prefix of ``tokens``); its entry is marked shared if a lookup has used it, else leaves
        memory when ``round_trips`` (the reply's text encodes back to its ids: the next turn can extend it)."""
        if not self.enabled or len(tokens) == 0:
            return
        key = self.key(tokens)
        n = len(tokens)
        if supersede:
            for m, old in self._prefix_keys(np.asarray(tokens)):
                if m >= n:
                    continue
                self._forget(old, unless_used=2)  # used by this request alone: the conversation moved on
                reply = self._replies.get(old)
                mine = old not in self._mem or not self._mem[old].shared  # not another conversation's reply
                if reply is not None and reply[1] != key and mine:  # a reply this prompt does not extend
                    self._forget(reply[1], unless_used=1)
        entry = Entry(n, state, np.asarray(logits, dtype=np.float32).reshape(-1))
        if key in self._mem:
            self._mem.move_to_end(key)
        else:
            if self.directory is not None and key not in self._disk:
                path = self.directory / f"{n}-{key}.state"
                try:
                    save_state(path, {**state, LOGITS: entry.logits[None]}, self.fingerprint, n)
                    self._disk[key] = path
                    self._index(n, key)
                except (OSError, ValueError) as e:
                    log.warning("prefix cache: cannot write %s: %s", path, e)
            self._remember(key, entry)
        if reply_to is not None and key in self._mem:
            prompt = self.key(reply_to)
            self._unlink(prompt)
            self._replies[prompt] = (len(reply_to), key)
            self._prompt_of[key] = prompt
            held = self._mem.get(prompt)
            if held is not None and held.uses > 0:
                held.shared = True
            elif held is not None and round_trips:
                self._forget(prompt)

    def _unlink(self, key: str) -> None:
        """Drop the reply records in which ``key`` is the prompt or the reply."""
        reply = self._replies.pop(key, None)
        if reply is not None:
            self._prompt_of.pop(reply[1], None)
        prompt = self._prompt_of.pop(key, None)
        if prompt is not None:
            self._replies.pop(prompt, None)

    def _forget(self, key: str, unless_used: int | None = None) -> None:
        """Take ``key`` out of memory (a copy on disk stays findable); with ``unless_used``, unless it is
        shared or that many lookups have used it."""
        entry = self._mem.get(key)
        if entry is not None and (unless_used is None or not (entry.shared or entry.uses >= unless_used)):
            del self._mem[key]
            self._left(key, entry)

    def _left(self, key: str, entry: Entry) -> None:
        """Account for ``entry`` having left memory."""
        self.bytes -= entry.nbytes
        if key not in self._disk:
            self._unindex(entry.n, key)
        if key in self._prompt_of:  # a reply that is gone: its prompt's record is useless
            self._unlink(key)

    def _remember(self, key: str, entry: Entry) -> None:
        size = entry.nbytes
        if size > self.capacity:
            return
        self._mem[key] = entry
        self._index(entry.n, key)
        self.bytes += size
        while self.bytes > self.capacity:
            self._left(*self._mem.popitem(last=False))

    def _read(self, n: int, key: str) -> Entry | None:
        path = self._disk.get(key)
        if path is None:
            return None
        expected = {**self.shapes, LOGITS: (1, None)}
        try:
            tensors, meta = load_state(path, fingerprint=self.fingerprint, expected=expected)
            if int(meta["position"]) != n:
                raise ValueError(f"{path} holds the state after {meta['position']} tokens, its name says {n}")
        except ValueError as e:
            log.warning("prefix cache: skipping %s: %s", path.name, str(e).splitlines()[0])
            del self._disk[key]
            self._unindex(n, key)
            return None
        logits = tensors.pop(LOGITS)[0]
        return Entry(n, tensors, logits)


__all__ = ["Entry", "PrefixCache"]
