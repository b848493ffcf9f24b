"""State files: a session's recurrent state as a safetensors file (docs/artifact-format.md), numpy only.

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded with spaces to a multiple of 8),
then the raw little-endian float32 bytes of every tensor, back to back in header order (a state file of
the server's prefix cache, written with ``reduced=True``, may also hold a KV buffer as ``F16`` or ``I8``,
as the graph holds it: ``load_state`` refuses those unless given ``reduced=True`` too). The header maps each
state input name to ``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` and ``__metadata__`` to
``{"format": "edgeattn-state", "format_version": "2", "fingerprint": ..., "position": ...,
"data_sha256": ...}`` (all strings); ``data_sha256`` is the sha256 of all the tensor bytes, so a flipped
byte is refused. Non-finite values (NaN, inf) are refused on save and on load. Version 1 files (no
checksum) are refused with a message saying so.

The C++ runtime (edgeattn/runtimes/cpp) reads and writes the same files, so a state saved by one resumes in
the other. Any safetensors reader opens them too.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from edgeattn._atomic import make_temp_file

FORMAT = "edgeattn-state"
FORMAT_VERSION = 2  # 2: __metadata__ carries data_sha256; version 1 files had no checksum and are refused
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors limit; a larger "header" is a corrupt or foreign file
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I8": np.dtype("i1")}  # safetensors' names
_REDUCED = {np.dtype(np.float16): "F16", np.dtype(np.int8): "I8"}


def save_state(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    fingerprint: str,
    position: int,
    *,
    meta: Mapping[str, str] | None = None,
    reduced: bool = False,
) -> None:
    """Write ``tensors`` (state input name -> float32 array, in manifest order) to ``path`` atomically.
    ``meta``: more ``__metadata__`` strings (the prefix cache's ``key``); ``reduced``: float16 and int8
    tensors are written as they are (F16, I8) instead of refused."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError("save_state needs the artifact's fingerprint (a non-empty string)")
    if int(position) < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    fixed = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "fingerprint": fingerprint,
        "position": str(int(position)),
    }
    extra = dict(meta or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise ValueError("a state file's metadata values are strings")
    meta = {**extra, **fixed}
    header: dict = {"__metadata__": meta}
    blobs = []
    offset = 0
    digest = hashlib.sha256()
    for name, t in tensors.items():
        if name == "__metadata__":
            raise ValueError("a state tensor cannot be named __metadata__")
        a = np.asarray(t)
        code = "F32" if a.dtype == np.float32 else _REDUCED.get(a.dtype) if reduced else None
        if code is None:
            raise ValueError(f"state tensor {name!r} is {a.dtype}; state files hold float32 only")
        if not np.isfinite(a).all():
            raise ValueError(f"state tensor {name!r} holds NaN or inf; a state file holds finite values only")
        blob = np.ascontiguousarray(a, dtype=_DTYPES[code]).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        digest.update(blob)
        offset += len(blob)
    meta["data_sha256"] = digest.hexdigest()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a file name for the state")
    fd, tmp = make_temp_file(path)  # a missing directory: FileNotFoundError naming it
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_state(
    path: str | os.PathLike,
    *,
    fingerprint: str | None = None,
    expected: Mapping[str, tuple] | None = None,
    max_bytes: int | None = None,
    reduced: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a state file: ``(tensors, metadata)``.

    ``tensors`` maps state input names to float32 arrays (in file order); ``metadata`` is the file's
    ``__metadata__`` as written (strings: ``int(metadata["position"])`` is the number of tokens consumed).
    With ``fingerprint``, refuses a state of another model; with ``expected`` (name -> shape, where a str or
    None dimension matches any size), refuses tensors whose names or shapes differ. Every refusal, and any
    file that is not a well-formed state file, raises ValueError with a one-line message. ``max_bytes``: a
    file larger than that is refused from its size, before any of it is read. ``reduced``: F16 and I8 tensors
    (``save_state(reduced=True)``) are returned in their dtype instead of refused.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise ValueError(
                    f"{path} is {size} bytes, more than a state of this size can take ({max_bytes})"
                )
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read state file {path}: {e.strerror or e}") from e
    tensors, meta = _parse(path, raw, reduced)
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise ValueError(
            f"{path} holds the state of another model: fingerprint {meta['fingerprint'][:16]}... "
            f"!= this artifact's {fingerprint[:16]}..."
        )
    if expected is not None:
        check_state(tensors, expected, source=str(path))
    return tensors, meta


def check_state(
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple],
    source: str = "state",
    filled: Mapping[str, int] | None = None,
) -> None:
    """Raise ValueError unless ``tensors`` has exactly the names of ``expected`` with matching shapes and finite
    values. ``filled`` maps the names of KV buffers (``[1, Hkv, max_length, D]``) to the slots (axis 2) that
    must be finite: GroupQueryAttention never reads those past them, which may hold anything."""
    missing = [n for n in expected if n not in tensors]
    extra = [n for n in tensors if n not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(missing)}")
        if extra:
            parts.append(f"has unknown {', '.join(extra)}")
        raise ValueError(f"{source} does not match the artifact's state: it {' and '.join(parts)}")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        ok = len(got) == len(shape) and all(
            d is None or isinstance(d, str) or int(d) == g for d, g in zip(shape, got)
        )
        if not ok:
            raise ValueError(
                f"{source}: state tensor {name} has shape {list(got)}, the artifact's is {list(shape)}"
            )
        values = tensors[name]
        if filled is not None and name in filled:
            values = np.asarray(values)[:, :, : filled[name]]
        if not np.isfinite(values).all():  # the model would compute NaN logits from it
            raise ValueError(f"state {name!r} holds NaN or infinity ({source})")


def _parse(path: Path, raw: bytes, reduced: bool = False) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    def bad(why: str) -> ValueError:
        return ValueError(f"{path} is not an edgeattn state file: {why}")

    if len(raw) < 8:
        raise bad("shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER or 8 + n > len(raw):
        raise bad(f"header length {n} does not fit the file's {len(raw)} bytes")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f'no __metadata__ with "format": "{FORMAT}"')
    if not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ values must be strings")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise bad(f"format_version {meta.get('format_version')!r} is not an integer") from None
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has state format_version {version}; this edgeattn reads up to {FORMAT_VERSION}"
        )
    if version < FORMAT_VERSION:
        raise ValueError(
            f"{path} is a state file of format_version {version}, written before state files carried a "
            f"checksum; this edgeattn reads version {FORMAT_VERSION}: save the state again"
        )
    checksum = meta.get("data_sha256", "")
    if len(checksum) != 64 or not set(checksum) <= set("0123456789abcdef"):
        raise bad("no data_sha256 (a sha256 hex digest) in __metadata__")
    if not meta.get("fingerprint"):
        raise bad("no fingerprint in __metadata__")
    position = meta.get("position", "")
    if not (position.isascii() and position.isdigit()):
        raise bad(f"position {position!r} is not a non-negative integer")

    data = memoryview(raw)[8 + n :]
    spans = []
    tensors = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"entry {name!r} is not an object")
        code = info.get("dtype")
        if code != "F32" and not (reduced and code in _DTYPES):
            raise bad(f"tensor {name} has dtype {code!r}; state tensors are F32")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"tensor {name} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise bad(f"tensor {name} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        dtype = _DTYPES[code]
        if not 0 <= begin <= end <= len(data) or end - begin != dtype.itemsize * int(
            np.prod(shape, dtype=np.int64)
        ):
            raise bad(
                f"tensor {name}: data_offsets {offsets} do not match shape {shape} in {len(data)} data bytes"
            )
        spans.append((begin, end))
        tensors[name] = (
            np.frombuffer(data[begin:end], dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)
        )
    # safetensors packs tensors back to back with no holes; anything else is a truncated or damaged file
    cursor = 0
    for begin, end in sorted(spans):
        if begin != cursor:
            raise bad("tensor data has holes or overlaps")
        cursor = end
    if cursor != len(data):
        raise bad(f"{len(data) - cursor} bytes after the last tensor")
    if hashlib.sha256(data).hexdigest() != checksum:
        raise ValueError(f"{path} is corrupt: its tensor data does not match the data_sha256 in its header")
    for name, t in tensors.items():
        if not np.isfinite(t).all():
            raise ValueError(f"{path}: state tensor {name} holds NaN or inf; a state must be finite")
    return tensors, meta
