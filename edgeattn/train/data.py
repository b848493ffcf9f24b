"""Byte-level training data: text files concatenated once into a memory-mapped cache file.

    corpus = load_corpus(None)                # the running interpreter's standard library (*.py)
    corpus = load_corpus("notes/")            # a text file, or a directory of text files
    x, y = corpus.batch("train", step, batch_size=16, seq_len=256)   # [B, T] int64 inputs and targets

Tokens are bytes (vocab 256): no tokenizer to download, and bits per byte is the loss in bits.

The default corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by path,
leaving out ``site-packages``/``dist-packages`` (installed packages, not the standard library),
``test``/``tests``/``idle_test`` (large generated fixtures) and ``__pycache__``: about 12 MB on CPython 3.11.

Files are concatenated in sorted order as UTF-8 bytes; the last ``val_fraction`` of the bytes (at least
one window) is the validation split, the rest the training split. The concatenation is written once to
``<cache dir>/corpus-<key>.bin`` (atomically: a temp file, then a rename), keyed by the files' paths,
sizes and modification times, and read back through ``np.memmap``: a corpus larger than RAM works, and
each step reads only its own windows. The cache dir is ``$EDGEATTN_CACHE_DIR``, else
``$XDG_CACHE_HOME/edgeattn``, else ``~/.cache/edgeattn``.

Batches are a pure function of (seed, rank, step): window starts drawn from ``numpy.random.default_rng
([seed, rank, step])`` inside this rank's shard of the training split (the split cut into ``world_size``
contiguous pieces). The data position is the step: a resumed run reads the same batches.

With a Hugging Face ``tokenizer.json`` (``load_corpus(..., tokenizer=path)``: fine-tuning an imported
model) the tokens are that tokenizer's ids instead: each file is encoded (no special tokens) and the ids
concatenated into ``tokens-<key>.bin`` (uint32, keyed by the files and the tokenizer's bytes); the splits,
windows and batches are then counted in tokens.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeattn._atomic import make_temp_file

CACHE_ENV = "EDGEATTN_CACHE_DIR"
CACHE_VERSION = 1  # bump when the cache layout changes
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_BLOCK = 1 << 20  # files are read and checked 1 MiB at a time


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "edgeattn"


def stdlib_files() -> list[Path]:
    """The standard library's own ``*.py`` files, sorted (see the module docstring for what is left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )


def text_files(path: str | os.PathLike) -> list[Path]:
    """``path`` itself if it is a file, else every file under it (sorted, hidden entries skipped)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data path {path} does not exist")
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"data directory {path} holds no files")
    return files


def _check_text(path: Path) -> int:
    """Read ``path`` in blocks; ValueError unless it is UTF-8 text without NUL bytes. Returns its size."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            if b"\0" in block:
                raise ValueError(f"{path} is not a text file (it contains NUL bytes)")
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} is not UTF-8 text (invalid byte at offset {size + e.start})"
                ) from None
            size += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (it ends inside a character)") from None
    return size


def _cached(files: list[Path], directory: Path | None, prefix: str, extra: list, write) -> Path:
    """The cache file for ``files`` (keyed by their paths, sizes and times, plus ``extra``), made once by
    ``write(f)``. Every file is checked before anything is written: a bad file leaves no cache behind."""
    directory = cache_dir() if directory is None else Path(directory)
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = hashlib.sha256(json.dumps([CACHE_VERSION, stats, *extra]).encode()).hexdigest()[:20]
    out = directory / f"{prefix}-{key}.bin"
    if out.is_file():
        return out
    if sum(_check_text(p) for p in files) == 0:
        raise ValueError("the data is empty (0 bytes of text)")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_temp_file(out)  # with the usual mode (see edgeattn._atomic)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def build_cache(files: list[Path], directory: Path | None = None) -> Path:
    """Concatenate ``files`` into one cache file (once) and return its path."""

    def write(f):
        for p in files:
            with open(p, "rb") as src:
                while block := src.read(_BLOCK):
                    f.write(block)

    return _cached(files, directory, "corpus", [], write)


def build_token_cache(files: list[Path], tokenizer: Path, directory: Path | None = None) -> Path:
    """Encode ``files`` with the Hugging Face tokenizer ``tokenizer`` (a tokenizer.json) into one cache
    file of uint32 ids (once) and return its path."""
    from edgeattn.artifact.tokenizer import load_hf_tokenizer

    def write(f):
        tok = load_hf_tokenizer(tokenizer)
        for p in files:
            ids = tok.encode(p.read_text(encoding="utf-8"), add_special_tokens=False).ids
            f.write(np.asarray(ids, dtype=np.uint32).tobytes())

    tok_hash = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    return _cached(files, directory, "tokens", [tok_hash], write)


@dataclass
class Corpus:
    """A token corpus split into a training and a validation part (both views of one memmap): bytes
    (uint8), or a tokenizer's ids (uint32)."""

    train: np.ndarray  # uint8 or uint32
    val: np.ndarray  # uint8 or uint32
    source: str  # what was read, for logs
    unit: str = "bytes"  # what a token is, for messages: "bytes" or "tokens"

    def shard(self, rank: int, world_size: int) -> np.ndarray:
        """This rank's contiguous piece of the training split."""
        n = len(self.train) // world_size
        return self.train[rank * n : (rank + 1) * n]

    def batch(
        self, step: int, *, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        """Random windows of this rank's shard for ``step``: (inputs, targets) as [B, T] int64 arrays."""
        data = self.shard(rank, world_size)
        if len(data) < seq_len + 1:
            raise ValueError(
                f"the training split ({len(data)} {self.unit} per rank) is shorter than one window "
                f"({seq_len + 1} {self.unit})"
            )
        rng = np.random.default_rng([seed, rank, step])
        starts = rng.integers(0, len(data) - seq_len, size=batch_size)
        windows = np.stack([np.asarray(data[s : s + seq_len + 1], dtype=np.int64) for s in starts])
        return windows[:, :-1], windows[:, 1:]

    def val_windows(self, seq_len: int, max_windows: int) -> np.ndarray:
        """Up to ``max_windows`` evenly spaced, non-overlapping windows of seq_len + 1 bytes: [N, T + 1]."""
        n = (len(self.val) - 1) // seq_len
        if n < 1:
            raise ValueError(f"the validation split ({len(self.val)} {self.unit}) is shorter than one window")
        idx = np.linspace(0, n - 1, num=min(n, max_windows)).round().astype(np.int64)
        return np.stack(
            [np.asarray(self.val[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in idx]
        )


def load_corpus(
    data: str | os.PathLike | None = None,
    *,
    seq_len: int = 256,
    val_fraction: float = 0.02,
    cache: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> Corpus:
    """The corpus of ``data`` (None: the standard library), split into train and validation tokens:
    bytes, or the ids of ``tokenizer`` (a Hugging Face tokenizer.json)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if data is None:
        files, source = stdlib_files(), f"python stdlib ({sysconfig.get_paths()['stdlib']})"
        if not files:
            raise ValueError("found no standard library sources to train on; pass --data PATH")
    else:
        files, source = text_files(data), str(data)
    directory = None if cache is None else Path(cache)
    if tokenizer is None:
        path, dtype, unit = build_cache(files, directory), np.uint8, "bytes"
    else:
        path, dtype, unit = build_token_cache(files, Path(tokenizer), directory), np.uint32, "tokens"
        source = f"{source} (encoded with {tokenizer})"
    size = path.stat().st_size // np.dtype(dtype).itemsize
    n_val = max(int(size * val_fraction), seq_len + 1)
    if size - n_val < seq_len + 1:
        raise ValueError(
            f"the data is too small: {size} {unit}, need at least {2 * (seq_len + 1)} for a training and "
            f"a validation window of --seq-len {seq_len}"
        )
    mm = np.memmap(path, dtype=dtype, mode="r")
    return Corpus(
        train=mm[: size - n_val],
        val=mm[size - n_val :],
        source=f"{source}: {len(files)} files, {size:,} {unit}",
        unit=unit,
    )
