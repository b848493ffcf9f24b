"""edgeattn._atomic.replace_dir: a finished temp directory takes the place of the target whole."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from edgeattn._atomic import cleanup_stale, make_temp_dir, replace_dir


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


# ---- the swap never leaves the target missing; stale temporaries of killed writers are removed ----


def test_replace_dir_keeps_the_target_at_every_instant(tmp_path, monkeypatch):
    """After every rename or removal inside replace_dir, ``out`` holds the old or the new file."""
    import shutil

    out = tmp_path / "out"
    replace_dir(_tmp_with(tmp_path, "one"), out)
    seen = []

    def watch(fn):
        def wrapped(*args, **kwargs):
            r = fn(*args, **kwargs)
            seen.append((out / "f.txt").read_text() if (out / "f.txt").exists() else None)
            return r

        return wrapped

    for mod, name in ((os, "replace"), (os, "rename"), (shutil, "rmtree")):
        monkeypatch.setattr(mod, name, watch(getattr(mod, name)))
    tmp = make_temp_dir(out)
    (tmp / "f.txt").write_text("two")
    replace_dir(tmp, out)
    monkeypatch.undo()
    assert seen and None not in seen, seen
    assert (out / "f.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_fallback_swap_and_a_left_over_old_directory(tmp_path, monkeypatch):
    from edgeattn import _atomic

    monkeypatch.setattr(_atomic, "exchange", lambda a, b: False)  # a system without RENAME_EXCHANGE
    out = tmp_path / "out"
    replace_dir(_tmp_with(tmp_path, "one"), out)
    replace_dir(_tmp_with(tmp_path, "two"), out)
    assert (out / "f.txt").read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["out"]
    # killed between the fallback's two renames: only .out.old is there; the next write puts it back
    os.rename(out, tmp_path / ".out.old")
    tmp = make_temp_dir(out)
    assert (out / "f.txt").read_text() == "two" and not (tmp_path / ".out.old").exists()
    # killed after them: both are there; the old one goes
    (tmp_path / ".out.old").mkdir()
    cleanup_stale(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", tmp.name])


def test_only_our_own_stale_temporaries_are_removed(tmp_path):
    import subprocess
    import sys
    import time

    from edgeattn._atomic import STALE_AFTER_S, _host

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, me = _host(), os.getpid()
    names = {
        f".out.tmp-{host}-{dead.pid}-abcd_123": True,  # its process is gone
        f".out.tmp-{host}-{dead.pid}-abcd_124.tmp": True,  # a state file's temporary
        f".out.tmp-{host}-{me}-abcd_125": False,  # a live writer's
        f".out.tmp-elsewhere-{dead.pid}-abcd_126": False,  # another host's, recent
        f".out.tmp-elsewhere-{dead.pid}-abcd_127": True,  # another host's, older than a day
        f".other.tmp-{host}-{dead.pid}-abcd_128": False,  # another target's
        ".out.abcd_129": False,  # not our naming
        "out.tmp-x-1-abcd_130": False,  # not hidden
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    old = time.time() - STALE_AFTER_S - 60
    os.utime(tmp_path / f".out.tmp-elsewhere-{dead.pid}-abcd_127", (old, old))
    removed = {p.name for p in cleanup_stale(tmp_path / "out")}
    assert removed == {n for n, stale in names.items() if stale}
    assert {p.name for p in tmp_path.iterdir()} == {n for n, stale in names.items() if not stale}


_WRITERS = {
    "dir": """
from edgeattn._atomic import make_temp_dir, replace_dir
def write(i):
    tmp = make_temp_dir(out)
    for j in range(20):
        (tmp / f"f{j}.txt").write_text(str(i) * 1000)
    replace_dir(tmp, out)
""",
    "state": """
import numpy as np
from edgeattn.runtimes.state_file import save_state
def write(i):
    save_state(out, {"s": np.full((64, 256), i, np.float32)}, fingerprint="f", position=i)
""",
    "model": """
from edgeattn.models import EdgeConfig, EdgeLM
model = EdgeLM(EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer="gla"))
def write(i):
    model.save(out)
""",
}


def _check_written(kind, out):
    if kind == "dir":
        texts = {(out / f"f{j}.txt").read_text() for j in range(20)}
        assert len(texts) == 1  # one whole version, never a mix
    elif kind == "state":
        from edgeattn.runtimes.state_file import load_state

        tensors, meta = load_state(out)
        assert (tensors["s"] == int(meta["position"])).all()
    else:
        from edgeattn.models import EdgeLM

        EdgeLM.load(out)


@pytest.mark.parametrize("kind", sorted(_WRITERS))
def test_sigkill_mid_write_leaves_a_whole_output_and_the_next_write_cleans_up(kind, tmp_path):
    """A writer killed with SIGKILL at random moments of its loop of writes: the target is always whole,
    and the temporaries it left are gone after the next write."""
    import random
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / ("x.state" if kind == "state" else "out")
    code = f"from pathlib import Path\nout = Path({str(out)!r})\n{_WRITERS[kind]}\n"
    code += "write(0)\nprint('ready', flush=True)\ni = 1\nwhile True:\n    write(i)\n    i += 1\n"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rng = random.Random(0)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.05, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        _check_written(kind, out)
        exec(compile(_WRITERS[kind], "writer", "exec"), ns := {"out": out})
        ns["write"](99)
        assert [p.name for p in tmp_path.iterdir()] == [out.name]
        _check_written(kind, out)


def test_write_bytes(tmp_path):
    """The one atomic-write helper (the TensorRT engine cache, bench results and plots use it)."""
    from edgeattn._atomic import write_bytes

    path = tmp_path / "sub" / "x.engine"
    write_bytes(path, b"one")
    write_bytes(path, b"two")
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["x.engine"]

    with pytest.raises(TypeError):
        write_bytes(path, object())  # a failed write leaves the old file and no temporary one
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["x.engine"]
