"""The prefix-state cache: the state after a sequence of token ids, found again by any longer sequence.

An entry is the batch-1 state after consuming ``tokens[:n]`` together with the next-token logits that came
with it, under the key ``sha256(fingerprint, tokens[:n])``. ``lookup(tokens)`` returns the entry of the
longest cached prefix of ``tokens`` (possibly all of them): the caller resumes from its state and logits
and prefills only ``tokens[n:]``. Only the lengths that are cached are hashed (one incremental pass over
the ids), so a lookup costs O(len(tokens)) whatever the number of entries.

Memory: least recently used entries are evicted beyond ``capacity_bytes`` (state plus logits bytes).
The engine stores a prompt's state with ``supersede``: the entries of shorter prefixes of that prompt
leave memory, since the conversation they belong to has moved on, and with them the state after the reply
to each of those prompts (which the new prompt may not extend: a reply whose text re-encodes to other
tokens). A conversation so holds at most two states in memory whatever its length (its last prompt's and
its last reply's); the price is that a branch from an older turn (an edited earlier message), or another
client's prompt that extends this conversation's, moves it out of memory (to the disk, if any).
Disk (``directory``): every entry is also written as a state file (``edgeattn.runtimes.state_file``:
checksummed, written atomically) named ``{n}-{key}.state``, holding the state tensors plus one more tensor,
``next_token_logits`` ``[1, vocab]``; the directory is indexed at start (by file name, nothing read), and an
entry evicted from memory or written before a restart is read back on its first hit. A file that is
damaged, of another model or of another length is skipped with one log line and never used. The disk
holds every entry ever written (no eviction there).

Models with a KV-buffer layer (softmax layers on GroupQueryAttention) cache their buffer as it is in the
state: the whole preallocated ``[1, Hkv, max_length, D]`` key and value buffers per layer, whatever the
position, so an entry costs the full buffer bytes (``state_bytes`` of the artifact), not only the prefix.
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
        self._replies: dict[str, str] = {}  # prompt key -> key of the state after its reply
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
        lengths = sorted(n for n in self._lengths if 0 < n <= len(tokens))
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
            self.hits += 1
            self.hit_tokens += n
            return entry
        self.misses += 1
        return None

    def put(self, tokens, state: dict, logits, supersede: bool = False, reply_to: str | None = None) -> None:
        """Store the state after ``tokens`` (a copy is not made: give arrays nobody changes). With
        ``supersede`` the entries of shorter prefixes of ``tokens`` leave memory (not the disk), and so do
        the replies recorded for them: ``reply_to`` is the key of the prompt this state is the reply to."""
        if not self.enabled or len(tokens) == 0:
            return
        key = self.key(tokens)
        n = len(tokens)
        if reply_to is not None:
            self._replies[reply_to] = key
        if supersede:
            for m, old in self._prefix_keys(np.asarray(tokens)):
                if m < n:
                    self._forget(old)
                    reply = self._replies.pop(old, None)
                    if reply is not None and reply != key:
                        self._forget(reply)
        entry = Entry(n, state, np.asarray(logits, dtype=np.float32).reshape(-1))
        if key in self._mem:
            self._mem.move_to_end(key)
            return
        if self.directory is not None and key not in self._disk:
            path = self.directory / f"{n}-{key}.state"
            try:
                save_state(path, {**state, LOGITS: entry.logits[None]}, self.fingerprint, n)
                self._disk[key] = path
                self._index(n, key)
            except (OSError, ValueError) as e:
                log.warning("prefix cache: cannot write %s: %s", path, e)
        self._remember(key, entry)

    def _forget(self, key: str) -> None:
        """Take ``key`` out of memory (a copy on disk stays findable)."""
        entry = self._mem.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
            if key not in self._disk:
                self._unindex(entry.n, key)

    def _remember(self, key: str, entry: Entry) -> None:
        size = entry.nbytes
        if size > self.capacity:
            return
        self._mem[key] = entry
        self._index(entry.n, key)
        self.bytes += size
        while self.bytes > self.capacity:
            old_key, old = self._mem.popitem(last=False)
            self.bytes -= old.nbytes
            self._replies.pop(old_key, None)
            if old_key not in self._disk:
                self._unindex(old.n, old_key)

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
