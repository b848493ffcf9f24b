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
earlier message) finds nothing in memory (the disk, if any, holds the entries its budget allows).
Disk (``directory``): every entry is also written as a state file (``edgeattn.runtimes.state_file``:
checksummed, written atomically: a temporary file, then a rename, so never half a file) named
``{n}-{key}.state``, holding the state tensors plus one more tensor, ``next_token_logits`` ``[1, vocab]``;
the directory is indexed at start (by file name and ``stat``, nothing read), and an entry evicted from
memory or written before a restart is read back on its first hit. A file that is damaged, of another model
or of another length is skipped with one log line, removed and never used.
The disk holds at most ``disk_capacity_bytes`` (the files' real sizes): beyond it the least recently used
files are deleted, with the recency of memory (a hit, in memory or on disk, and a ``put`` of a held key
count as a use; a use also sets the file's mtime). The files found at start (a restart) count, oldest mtime
first, and are deleted oldest first while over the budget. A key deleted from the disk and not in memory is
a miss from then on. An entry larger than the whole budget is not written (one log line, the first time),
nor is one whose write fails (disk full, permission: one log line each): it stays in memory only. Every
state file in the directory counts against the budget of the cache that indexes it: caches sharing a
directory (``--ray`` replicas) each get their share of it (see ``edgeattn.serve.ray``).

Models with a KV-buffer layer (softmax layers on GroupQueryAttention) cache their buffer as it is in the
state: the whole preallocated ``[1, Hkv, max_length, D]`` key and value buffers per layer, whatever the
position, so an entry counts the full buffer bytes (``state_bytes`` of the artifact) against the capacity;
in memory the slots past its position are zeros that ``Streams`` never wrote (pages the OS does not
commit), so its RSS is about the prefix's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeattn.artifact.state_file import load_state, save_state

LOGITS = "next_token_logits"
DEFAULT_DISK_MB = 4096  # the disk budget of --state-cache-dir unless --state-cache-disk-mb says otherwise
MiB = 2**20
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


@dataclass
class _File:
    path: Path
    n: int  # tokens consumed (the name's)
    size: int  # bytes on disk


class PrefixCache:
    """See the module docstring. Not thread-safe: one owner (the engine's worker thread) calls it."""

    def __init__(
        self,
        fingerprint: str,
        shapes: dict[str, tuple],
        capacity_bytes: int,
        directory: str | os.PathLike | None = None,
        disk_capacity_bytes: int = DEFAULT_DISK_MB * MiB,
    ):
        if capacity_bytes < 0 or disk_capacity_bytes < 0:
            raise ValueError(
                f"the cache capacities must be >= 0 bytes, got {capacity_bytes} (memory) "
                f"and {disk_capacity_bytes} (disk)"
            )
        self.fingerprint = fingerprint
        self.shapes = dict(shapes)  # state input name -> shape (a str dimension matches any size)
        self.capacity = int(capacity_bytes)
        self.directory = None if directory is None else Path(directory)
        self.disk_capacity = int(disk_capacity_bytes)
        self._mem: OrderedDict[str, Entry] = OrderedDict()
        self._disk: OrderedDict[str, _File] = OrderedDict()  # least recently used first
        self.disk_bytes = 0
        self._said_too_big = False
        self._lengths: dict[int, set[str]] = {}  # n -> keys held (memory or disk)
        # prompt key -> (its n, the key of the state after its reply)
        self._replies: dict[str, tuple[int, str]] = {}
        self._prompt_of: dict[str, str] = {}  # reply key -> prompt key (the inverse of _replies)
        self.bytes = 0
        self.hits = self.misses = self.hit_tokens = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = []
            for path in self.directory.iterdir():
                m = _NAME.match(path.name)
                try:
                    st = path.stat() if m else None
                except OSError:  # gone since listed (another server sharing the directory)
                    continue
                if st is not None and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, path.name, int(m.group(1)), m.group(2), st.st_size))
            for _, name, n, key, size in sorted(found):  # oldest first
                if key in self._disk:  # the same key under another length (a renamed file): the older goes
                    self._drop_file(key)
                self._add_file(key, _File(self.directory / name, n, size))
            self._trim_disk(self.disk_capacity)

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
            self._touch(key)
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
                self._write(key, entry)
            self._remember(key, entry)
        self._touch(key)
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

    # ---- the disk ----

    def _add_file(self, key: str, file: _File) -> None:
        self._disk[key] = file
        self.disk_bytes += file.size
        self._index(file.n, key)

    def _drop_file(self, key: str) -> None:
        """Delete ``key``'s file; the key stays findable only if it is in memory."""
        file = self._disk.pop(key)
        self.disk_bytes -= file.size
        if key not in self._mem:
            self._unindex(file.n, key)
        try:
            file.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("prefix cache: cannot remove %s: %s", file.path.name, e.strerror or e)

    def _trim_disk(self, limit: int) -> None:
        """Delete the least recently used files until the disk holds at most ``limit`` bytes."""
        while self._disk and self.disk_bytes > limit:
            self._drop_file(next(iter(self._disk)))

    def _touch(self, key: str) -> None:
        """A use of ``key``: its file becomes the most recently used (in this index and by mtime)."""
        file = self._disk.get(key)
        if file is not None:
            self._disk.move_to_end(key)
            try:
                os.utime(file.path)
            except OSError:
                pass  # removed meanwhile: the next read of it says so

    def _too_big(self, size: int) -> bool:
        if size <= self.disk_capacity:
            return False
        if not self._said_too_big:
            self._said_too_big = True
            log.warning(
                "prefix cache: an entry of %.2f MiB is larger than the disk budget of %.2f MiB: "
                "entries this large are kept in memory only",
                size / MiB,
                self.disk_capacity / MiB,
            )
        return True

    def _write(self, key: str, entry: Entry) -> None:
        """Write ``entry``'s file within the budget (the least recently used files make room first); an
        entry larger than the budget, or a write that fails, leaves no file."""
        if self._too_big(entry.nbytes):  # its file is larger still (a header)
            return
        self._trim_disk(self.disk_capacity - entry.nbytes)  # room before writing: a full disk fails it
        path = self.directory / f"{entry.n}-{key}.state"
        try:
            save_state(path, {**entry.state, LOGITS: entry.logits[None]}, self.fingerprint, entry.n)
            size = path.stat().st_size
        except (OSError, ValueError) as e:
            log.warning("prefix cache: cannot write %s: %s", path.name, str(e).splitlines()[0])
            return
        if self._too_big(size):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return
        self._add_file(key, _File(path, entry.n, size))
        self._trim_disk(self.disk_capacity)  # never this one: the most recently used, and it fits

    def _read(self, n: int, key: str) -> Entry | None:
        file = self._disk.get(key)
        if file is None:
            return None
        path = file.path
        expected = {**self.shapes, LOGITS: (1, None)}
        try:
            tensors, meta = load_state(path, fingerprint=self.fingerprint, expected=expected)
            if int(meta["position"]) != n:
                raise ValueError(f"{path} holds the state after {meta['position']} tokens, its name says {n}")
        except ValueError as e:
            log.warning("prefix cache: skipping %s (removed): %s", path.name, str(e).splitlines()[0])
            self._drop_file(key)
            return None
        logits = tensors.pop(LOGITS)[0]
        return Entry(n, tensors, logits)


__all__ = ["DEFAULT_DISK_MB", "Entry", "PrefixCache"]
