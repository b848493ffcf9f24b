"""edgeattn._atomic.replace_dir: a finished temp directory takes the place of the target whole."""

from __future__ import annotations

import os
import stat
import tempfile

from edgeattn._atomic import replace_dir


def _tmp_with(parent, text):
    tmp = tempfile.mkdtemp(prefix=".out.tmp.", dir=parent)
    with open(os.path.join(tmp, "f.txt"), "w") as f:
        f.write(text)
    return tmp


def test_replace_dir_creates_then_replaces_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    replace_dir(_tmp_with(tmp_path, "one"), out)
    assert (out / "f.txt").read_text() == "one"
    (out / "stale.txt").write_text("from the old directory")
    replace_dir(_tmp_with(tmp_path, "two"), out)
    assert sorted(p.name for p in out.iterdir()) == ["f.txt"] and (out / "f.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or .old directory left


def test_replace_dir_gives_a_plain_directory_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        replace_dir(_tmp_with(tmp_path, "x"), tmp_path / "out")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755  # mkdtemp alone gives 0700
