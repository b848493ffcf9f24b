"""Outputs that appear whole or not at all: build in a hidden temporary beside the target, then swap.

Every temporary is a sibling of its target named ``.{target}.tmp-{host}-{pid}-{random}`` (files end
in ``.tmp``), so the next write of the same target can recognise its own leftovers. ``cleanup_stale``
removes one only when it is stale: made on this host by a process that no longer runs, or older than
``STALE_AFTER_S`` (24 h: made on another host sharing the directory, or its pid since reused). Nothing
else is ever removed. A ``.{target}.old`` left by an interrupted fallback swap is put back in place
when the target is missing, and removed when the target is there.

``replace_dir`` swaps with Linux's ``renameat2(RENAME_EXCHANGE)``, so the target holds the old or the
new directory at every instant. Where that call does not exist (other systems, some filesystems) it
falls back to two renames (target -> ``.{target}.old``, temporary -> target), with a moment between
them when the target is missing; ``cleanup_stale`` repairs an interruption there.

Outputs get the usual modes: files ``0666 & ~umask`` (``0777`` where an execute bit was set),
directories ``0777 & ~umask``, whatever ``mkdtemp``, ``mkstemp`` or a library (safetensors writes
0600) gave them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

STALE_AFTER_S = 24 * 3600
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"


def _prefix(target: Path) -> str:
    return f".{target.name}.tmp-{_host()}-{os.getpid()}-"


def _pattern(target: Path) -> re.Pattern:
    # host: [A-Za-z0-9_] (see _host); random part: tempfile's 8 characters [a-z0-9_]
    return re.compile(
        rf"\.{re.escape(target.name)}\.tmp-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[a-z0-9_]{{8}}(\.tmp)?"
    )


def umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask is set-and-return)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_modes(root: str | os.PathLike) -> None:
    """Give ``root`` (a file or a directory tree) the modes of a plain file or directory under the umask."""
    mask = umask()

    def fix(path: str) -> None:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return
        if stat.S_ISDIR(st.st_mode):
            os.chmod(path, 0o777 & ~mask)
        else:
            base = 0o777 if st.st_mode & 0o111 else 0o666
            os.chmod(path, base & ~mask)

    root = os.fspath(root)
    fix(root)
    if os.path.isdir(root) and not os.path.islink(root):
        for top, dirs, files in os.walk(root):
            for name in dirs + files:
                fix(os.path.join(top, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def cleanup_stale(target: str | os.PathLike) -> list[Path]:
    """Remove the stale temporaries of ``target`` (see the module docstring) and repair an interrupted
    fallback swap; return what was removed."""
    target = Path(target)
    parent = target.parent
    removed = []
    old = parent / f".{target.name}.old"
    if os.path.lexists(old):
        if not os.path.lexists(target):
            os.rename(old, target)  # the swap stopped between its two renames: the previous one is back
        else:
            _remove(old)
            removed.append(old)
    pattern, host, now = _pattern(target), _host(), time.time()
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        dead = m["host"] == host and not _alive(int(m["pid"]))
        if dead or age > STALE_AFTER_S:
            _remove(Path(entry.path))
            removed.append(Path(entry.path))
    return removed


def make_temp_dir(target: str | os.PathLike) -> Path:
    """A new empty temporary directory beside ``target`` (stale ones of ``target`` removed first)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    cleanup_stale(target)
    return Path(tempfile.mkdtemp(prefix=_prefix(target), dir=target.parent))


def make_temp_file(target: str | os.PathLike) -> tuple[int, Path]:
    """``(fd, path)`` of a new temporary file beside ``target`` (stale ones of ``target`` removed first).
    Its parent must exist: a missing directory is a FileNotFoundError naming it, not the temporary."""
    target = Path(target)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"directory {target.parent} does not exist (for {target})")
    cleanup_stale(target)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(target), suffix=".tmp", dir=target.parent)
    os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes it 0600
    return fd, Path(tmp)


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Atomically swap the paths ``a`` and ``b`` (both must exist); False where the system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # the kernel or the filesystem lacks RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), os.fspath(b))


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Move the finished directory ``tmp`` (from ``make_temp_dir(out)``) to ``out``, replacing what is
    there, with the usual modes. ``out`` holds the old or the new one at every instant (see above)."""
    tmp, out = Path(tmp), Path(out)
    publish_modes(tmp)
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    if exchange(tmp, out):
        _remove(tmp)  # now the old one; a kill here leaves a stale temporary that the next write removes
        return
    old = out.with_name(f".{out.name}.old")
    _remove(old)
    os.replace(out, old)
    os.replace(tmp, out)
    _remove(old)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole: a temporary file beside it (parents created), then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
