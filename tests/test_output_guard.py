"""One guard for output paths against every input path, and no temporary checkpoint (issue 20 items 7
and 8; issue 21 item 3): `edgeattn import DIR --out X` and `edgeattn export DIR --out X` refuse, even with
--force, an X that is, contains or lies inside the Hugging Face source, and touch nothing; a killed
`export HF_DIR` leaves no fp32 copy of the model in $TMPDIR, only a temporary beside the target that the
next export removes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hf_helpers import import_export_cli, qwen3_5_text, train_tokenizer

invoke = import_export_cli()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    qwen3_5_text().save_pretrained(root / "m")
    train_tokenizer(root / "m")
    return root / "m"


def snapshot(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["import", "export"])
def test_out_is_contains_or_lies_inside_the_hf_source_is_refused_even_with_force(hf_dir, tmp_path, command):
    import shutil

    src = tmp_path / "models" / "qwen"
    shutil.copytree(hf_dir, src)
    before = snapshot(tmp_path)
    for out, where in ((src, "is"), (src / "onnx", "lies inside"), (tmp_path / "models", "contains")):
        for force in ([], ["--force"]):
            res = invoke(command, src, "--out", out, *force)
            assert res.exit_code == 2, res.output
            lines = [ln for ln in res.output.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), res.output
            assert f"{where} the Hugging Face model" in lines[0], res.output
    assert snapshot(tmp_path) == before  # the user's weights untouched, nothing written


def test_a_directory_that_is_no_model_is_named_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for command in ("import", "export"):
        res = invoke(command, tmp_path / "empty", "--out", tmp_path / "o")
        assert res.exit_code == 2 and res.output.startswith("error: "), res.output
        assert len(res.output.strip().splitlines()) == 1
    res = invoke("export", tmp_path / "empty", "--out", tmp_path / "o")
    assert "not an edgeattn checkpoint" in res.output and "Hugging Face" in res.output


def test_a_killed_export_of_a_hf_directory_leaves_no_temporary_checkpoint(hf_dir, tmp_path):
    """SIGKILL while the graphs are being written (a temporary directory beside --out exists): $TMPDIR holds
    nothing of the export, and the next export of the same --out removes the killed one's temporary."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = tmp_path / "art"
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "edgeattn.cli.main", "export", str(hf_dir), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        # the export is under way once its temporary beside --out holds the model's weights or a graph
        while time.time() < deadline and proc.poll() is None:
            tmps = [p for p in tmp_path.glob(".art.tmp-*") if p.is_dir()]
            if tmps and any(p.suffix in (".onnx", ".safetensors") for p in tmps[0].rglob("*")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the export ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # no copy of the model outside the target's directory (other libraries may leave their own small files)
    assert [
        p for p in tmpdir.rglob("*") if p.name.startswith(".edgeattn") or p.suffix == ".safetensors"
    ] == []
    assert not out.exists()
    assert [p.name for p in tmp_path.glob(".art.tmp-*")]  # the killed export's temporary, beside --out
    res = invoke("export", hf_dir, "--out", out, "--prefill-chunk", 16)
    assert res.exit_code == 0, res.output
    assert list(tmp_path.glob(".art.tmp-*")) == []
