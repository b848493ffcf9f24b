"""The prefix-state cache: the state after a sequence of token ids, found again by any longer sequence.

An entry is the batch-1 state after consuming ``tokens[:n]`` together with the next-token logits that came
with it, under the key ``sha256(fingerprint, sha256(salt), tokens[:n])``. ``lookup(tokens)`` returns the
entry of the longest cached prefix of ``tokens`` (possibly all of them): the caller resumes from its state
(``state(entry)``: the layout ``Streams`` takes) and logits and prefills only ``tokens[n:]``. Only the lengths
that are cached are hashed (one incremental pass over the ids), so a lookup costs O(len(tokens)) whatever
the number of entries.

Isolation: a ``salt`` (the request's ``cache_salt``, as vLLM's) is part of every key, so requests with
different salts never resume from each other's states, and ``cached_tokens`` tells a client nothing about
the prompts of clients with another salt; requests without one share their states.

What an entry holds: every state tensor as the graph holds it, except that a KV buffer (``kv``: the
``[1, Hkv, max_length, D]`` buffers of softmax layers on GroupQueryAttention) keeps only its ``n`` filled
slots (``[1, Hkv, n, D]``), in the buffer's own dtype (int8 with the artifact's scales, float16), in memory
and on disk: an entry after ``n`` tokens costs ``entry_bytes(n)``, the fixed-size tensors plus ``n`` slots.

Memory: least recently used entries are evicted beyond ``capacity_bytes`` (state plus logits bytes). The
engine stores the state after a prompt, after the reply to it (prompt, reply and end-of-sequence token) and
at the chat-message boundaries inside a prompt (``boundary``: where the first message after the system
prompt and where the last message begin), so that a regenerated reply, an edited last message, a prompt that continues an
earlier one differently or a second user with the same system prompt resumes from the longest prefix they
share. When a prompt is stored, the entries of the same conversation that it leaves behind (prefixes of it
shorter than the state it resumed from: earlier turns' prompts and replies, not message boundaries) become
the least recently used, the first to go when room is needed, but stay while there is room.

Disk (``directory``): the entries of one model live in the subdirectory ``model-{sha256(fingerprint)[:16]}``
of the directory (``directory`` is that subdirectory; servers of other models sharing the directory keep
their own, each within its own budget). Every entry is also written there as a state file
(``edgeattn.artifact.state_file``: checksummed, written atomically: a temporary file, then a rename, so
never half a file) named ``{n}-{key}.state``, holding the state tensors (a KV buffer as ``F16`` or ``I8``
where it is one) plus ``next_token_logits`` ``[1, vocab]``, and its key in the metadata: a file renamed or
swapped with another's is refused. The subdirectory is indexed at start by file name and ``lstat``, nothing
read: a file larger than an entry of its length can be (``max_file_bytes``) is removed, and a symbolic
link that leaves the directory is skipped (neither counted nor read nor removed), each with one log line.
An entry evicted from memory or written before a restart is read back on its first hit, its size checked
before it is read. A file that is damaged, of another model, of another length or of other tokens is
skipped with one log line, removed and never used.
The disk holds at most ``disk_capacity_bytes`` (the files' real sizes): beyond it the least recently used
files are deleted, with the recency of memory (a hit, in memory or on disk, and a ``put`` of a held key
count as a use; a use also sets the file's mtime). The files found at start (a restart) count, oldest mtime
first, and are deleted oldest first while over the budget. A key deleted from the disk and not in memory is
a miss from then on. An entry larger than the whole budget is not written (one log line, the first time),
nor is one whose write fails (disk full, permission: one log line each): it stays in memory only. Every
state file in the subdirectory counts against the budget of the cache that indexes it: caches of one model
sharing a directory (``--ray`` replicas) each get their share of it (see ``edgeattn.serve.ray``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeattn.artifact.state_file import load_state, save_state
from edgeattn.runtimes.base import kv_from_float, kv_to_float, kv_zeros

LOGITS = "next_token_logits"
DEFAULT_DISK_MB = 4096  # the disk budget of --state-cache-dir unless --state-cache-disk-mb says otherwise
MiB = 2**20
_NAME = re.compile(r"^(\d+)-([0-9a-f]{64})\.state$")
log = logging.getLogger("edgeattn.serve")


@dataclass
class Entry:
    n: int  # tokens consumed
    state: dict  # batch-1 state by graph input name; a KV buffer's n filled slots only, in its dtype
    logits: np.ndarray  # [vocab] next-token logits
    boundary: bool = False  # a chat-message boundary (a system prompt): never demoted

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state.values()) + int(self.logits.nbytes)


@dataclass
class _File:
    path: Path
    n: int  # tokens consumed (the name's)
    size: int  # bytes on disk


def model_directory(root: str | os.PathLike, fingerprint: str) -> Path:
    """The subdirectory of ``root`` that holds the state files of the model with ``fingerprint``."""
    return Path(root) / f"model-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


class PrefixCache:
    """See the module docstring. Not thread-safe: one owner (the engine's worker thread) calls it.

    ``shapes``: state input name -> its graph input's shape (a str dimension matches any size); ``kv``: the
    KV buffers among them, name -> manifest state entry (``dtype``, ``scale``); ``vocab_size`` bounds the
    logits of a file found on disk (None: any)."""

    def __init__(
        self,
        fingerprint: str,
        shapes: dict[str, tuple],
        capacity_bytes: int,
        directory: str | os.PathLike | None = None,
        disk_capacity_bytes: int = DEFAULT_DISK_MB * MiB,
        *,
        kv: Mapping | None = None,
        vocab_size: int | None = None,
    ):
        if capacity_bytes < 0 or disk_capacity_bytes < 0:
            raise ValueError(
                f"the cache capacities must be >= 0 bytes, got {capacity_bytes} (memory) "
                f"and {disk_capacity_bytes} (disk)"
            )
        self.fingerprint = fingerprint
        self.shapes = dict(shapes)  # state input name -> shape (a str dimension matches any size)
        self.kv = dict(kv or {})
        self.vocab_size = vocab_size
        self.capacity = int(capacity_bytes)
        self.root = None if directory is None else Path(directory)
        self.directory = None if directory is None else model_directory(directory, fingerprint)
        self.disk_capacity = int(disk_capacity_bytes)
        self._mem: OrderedDict[str, Entry] = OrderedDict()
        self._disk: OrderedDict[str, _File] = OrderedDict()  # least recently used first
        self.disk_bytes = 0
        self._said_too_big = False
        self._lengths: dict[int, set[str]] = {}  # n -> keys held (memory or disk)
        self.bytes = 0
        self.hits = self.misses = self.hit_tokens = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for _, name, n, key, size in sorted(self._scan()):  # oldest first
                if key in self._disk:  # the same key under another length (a renamed file): the older goes
                    self._drop_file(key)
                self._add_file(key, _File(self.directory / name, n, size))
            self._trim_disk(self.disk_capacity)

    def _scan(self) -> list[tuple]:
        """(mtime, name, n, key, size) of the state files in the directory that may be entries."""
        found = []
        for path in self.directory.iterdir():
            m = _NAME.match(path.name)
            if m is None:
                continue
            try:
                if path.is_symlink() and self._outside(path):
                    log.warning("prefix cache: skipping %s: a link that leaves %s", path.name, self.directory)
                    continue
                st = path.stat()
            except OSError:  # gone since listed (another server sharing the directory), a dangling link
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            n, bound = int(m.group(1)), self.max_file_bytes(int(m.group(1)))
            if bound is None or st.st_size > bound:
                why = f"{st.st_size} bytes, more than an entry of {n} tokens can be ({bound})"
                if bound is None:
                    why = f"{n} tokens, more than this model's state holds"
                log.warning("prefix cache: skipping %s (removed): %s", path.name, why)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            found.append((st.st_mtime, path.name, n, m.group(2), st.st_size))
        return found

    def _outside(self, path: Path) -> bool:
        """Whether ``path`` resolves (its links followed) to a place outside the directory."""
        return not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(self.directory))

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 or self.directory is not None

    def __len__(self) -> int:
        return len(set(self._mem) | set(self._disk))

    # ---- sizes and layouts ----

    def _shape(self, name: str, n: int) -> tuple:
        """The shape of tensor ``name`` in an entry after ``n`` tokens (a KV buffer's ``n`` slots)."""
        shape = [n if isinstance(d, str) or d is None else int(d) for d in self.shapes[name]]
        if name in self.kv:
            shape[2] = n
        return tuple(shape)

    def entry_bytes(self, n: int) -> int:
        """Bytes of an entry after ``n`` tokens (memory; a file adds its header)."""
        total = 4 * (self.vocab_size or 0)
        for name in self.shapes:
            itemsize = np.dtype(self.kv[name].dtype).itemsize if name in self.kv else 4
            total += itemsize * int(np.prod(self._shape(name, n), dtype=np.int64))
        return total

    def max_file_bytes(self, n: int) -> int | None:
        """The largest state file an entry after ``n`` tokens can have (None: no entry has ``n`` tokens)."""
        if any(n > int(self.shapes[name][2]) for name in self.kv):
            return None
        logits = 0 if self.vocab_size is not None else 4 * 2**24  # any vocabulary: a generous bound
        return self.entry_bytes(n) + logits + 8 + 4096 + 256 * (len(self.shapes) + 1)  # + the JSON header

    def _compact(self, state: dict, n: int) -> dict:
        """``state`` as an entry holds it: a KV buffer's first ``n`` slots, in the buffer's dtype (a copy)."""
        out = {}
        for name, a in state.items():
            e = self.kv.get(name)
            if e is not None:
                a = np.asarray(a)[:, :, :n]
                a = kv_from_float(e, a) if a.dtype != np.dtype(e.dtype) else a
                a = np.array(a, dtype=e.dtype, copy=True, order="C")
            out[name] = a
        return out

    def state(self, entry: Entry) -> dict:
        """``entry``'s state in the layout ``Streams`` takes: a KV buffer whole (``max_length`` slots, the
        ones past ``n`` zeros that are never written: pages the OS does not commit), float32."""
        out = {}
        for name, a in entry.state.items():
            e = self.kv.get(name)
            if e is not None:
                full = kv_zeros(tuple(int(d) for d in self.shapes[name]), np.float32)
                full[:, :, : entry.n] = kv_to_float(e, a)
                a = full
            out[name] = a
        return out

    # ---- keys ----

    def _hasher(self, salt: str | None):
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(hashlib.sha256((salt or "").encode()).digest())  # fixed length: no ambiguity with the ids
        return h

    def key(self, tokens, salt: str | None = None) -> str:
        h = self._hasher(salt)
        h.update(np.asarray(tokens, dtype="<i4").tobytes())
        return h.hexdigest()

    def _index(self, n: int, key: str) -> None:
        self._lengths.setdefault(n, set()).add(key)

    def _unindex(self, n: int, key: str) -> None:
        keys = self._lengths.get(n, set())
        keys.discard(key)
        if not keys:
            self._lengths.pop(n, None)

    def _prefix_keys(self, tokens: np.ndarray, salt: str | None) -> list[tuple[int, str]]:
        """(n, key) for every cached length n <= len(tokens), longest first: one incremental hash pass."""
        lengths = sorted(n for n in self._lengths if 0 < n <= len(tokens))
        h = self._hasher(salt)
        data = np.asarray(tokens, dtype="<i4")
        out, done = [], 0
        for n in lengths:
            h.update(data[done:n].tobytes())
            done = n
            out.append((n, h.copy().hexdigest()))
        return out[::-1]

    # ---- the API ----

    def lookup(self, tokens, salt: str | None = None) -> Entry | None:
        """The entry of the longest cached prefix of ``tokens`` (None: a miss), counted in the stats."""
        tokens = np.asarray(tokens)
        for n, key in self._prefix_keys(tokens, salt):
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
            self.hits += 1
            self.hit_tokens += n
            return entry
        self.misses += 1
        return None

    def put(
        self,
        tokens,
        state: dict,
        logits,
        *,
        salt: str | None = None,
        boundary: bool = False,
        demote_below: int = 0,
    ) -> None:
        """Store the state after ``tokens`` (its KV buffers' filled slots are copied; other tensors are kept
        as given: give arrays nobody changes). ``boundary``: a chat-message boundary, never demoted.
        ``demote_below``: the cached prefixes of ``tokens`` shorter than that (the state this prompt resumed
        from), other than boundaries, become the least recently used (the conversation moved on)."""
        if not self.enabled or len(tokens) == 0:
            return
        tokens = np.asarray(tokens)
        key = self.key(tokens, salt)
        n = len(tokens)
        if demote_below > 0:
            for m, old in self._prefix_keys(tokens[:demote_below], salt):
                entry = self._mem.get(old)
                if m < demote_below and entry is not None and not entry.boundary:
                    self._mem.move_to_end(old, last=False)
        held = self._mem.get(key)
        if held is not None:
            held.boundary = held.boundary or boundary
            self._mem.move_to_end(key)
        else:
            entry = Entry(
                n, self._compact(state, n), np.asarray(logits, dtype=np.float32).reshape(-1), boundary
            )
            if self.directory is not None and key not in self._disk:
                self._write(key, entry)
            self._remember(key, entry)
        self._touch(key)

    def _left(self, key: str, entry: Entry) -> None:
        """Account for ``entry`` having left memory."""
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
                os.utime(file.path, follow_symlinks=False)
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
        tensors = {**entry.state, LOGITS: entry.logits[None]}
        try:
            save_state(path, tensors, self.fingerprint, entry.n, meta={"key": key}, reduced=True)
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
        expected = {name: self._shape(name, n) for name in self.shapes}
        expected[LOGITS] = (1, self.vocab_size)
        try:
            if path.is_symlink() and self._outside(path):
                raise ValueError(f"{path} is a link that leaves {self.directory}")
            tensors, meta = load_state(
                path,
                fingerprint=self.fingerprint,
                expected=expected,
                max_bytes=self.max_file_bytes(n),
                reduced=True,
            )
            if meta.get("key") != key:  # a valid file of other tokens under this name
                raise ValueError(f"{path} holds the state after other tokens (renamed or swapped)")
            if int(meta["position"]) != n:
                raise ValueError(f"{path} holds the state after {meta['position']} tokens, its name says {n}")
            for name, a in tensors.items():
                want = np.dtype(self.kv[name].dtype) if name in self.kv else np.dtype(np.float32)
                if a.dtype != want:
                    raise ValueError(f"{path}: {name} is {a.dtype}, this model's is {want}")
        except ValueError as e:
            log.warning("prefix cache: skipping %s (removed): %s", path.name, str(e).splitlines()[0])
            self._drop_file(key)
            return None
        logits = tensors.pop(LOGITS)[0]
        return Entry(n, tensors, logits)


__all__ = ["DEFAULT_DISK_MB", "Entry", "PrefixCache", "model_directory"]
