"""Directories that appear whole or not at all: build one in a temp directory beside the target, then swap."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory ``tmp`` to ``out``, replacing what is there. ``tmp`` must sit in
    ``out``'s parent (same filesystem), so each rename is atomic; an old ``out`` is moved aside first
    and removed only once the new one is in place."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700: give it a plain directory's mode
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
