"""The benchmark scripts' bad options: one line on stderr (``error: ...``), exit status 2, no usage block
(``edgeattn.bench.args.ArgumentParser``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_parses_with_the_one_line_parser():
    plain = [p.name for p in SCRIPTS if re.search(r"argparse\.ArgumentParser\(", p.read_text())]
    assert SCRIPTS and not plain, f"argparse's own parser (a usage block on a bad option): {plain}"


@pytest.mark.parametrize(
    "args, message",
    [
        # argparse's own error (an unknown option), a script's check (ap.error), a model_parser script's
        (["speculative.py", ".", "--nope"], "error: unrecognized arguments: --nope"),
        (
            ["speculative.py", ".", "--kinds", "poems"],
            "error: --kinds: comma-separated grounded, free; got 'poems'",
        ),
        (["streams.py", "--quick", "--n", "x"], "error: argument --n"),
        # a folder that is not an artifact: the session's own error, on one line
        (["speculative.py", str(ROOT / "docs")], f"error: {ROOT / 'docs'}: "),
        (["prefill_chunks.py", str(ROOT / "docs")], f"error: {ROOT / 'docs'}: "),
        (["demo_decode.py", str(ROOT / "docs")], f"error: {ROOT / 'docs'} has no edgeattn.json"),
        (["sampling_quality.py", str(ROOT / "docs")], f"error: {ROOT / 'docs'} has no edgeattn.json"),
        (["cpp_vs_python.py", "--artifact", str(ROOT / "docs")], "error: --artifact: "),
        (["attention_kernel.py", "--artifact", str(ROOT / "docs")], "error: --artifact "),
        (
            ["attention_kernel.py", "--artifact", str(ROOT), "--contexts", "a,b"],
            "error: --contexts and --depths",
        ),
        (["attention_kernel.py", "--op", "softmax"], "error: argument --op: invalid choice: 'softmax'"),
        (["matmul_op.py", "--shapes", "1024x7x2"], "error: --shapes takes KxN,..."),
        (
            ["matmul_op.py", "--shapes", "96x64", "--blocks", "64"],
            "error: 96x64 with blocks of 64: the kernel",
        ),
        (["matmul_op.py", "--rows", "0"], "error: --repeats, --threads and --rows must be >= 1"),
        # a checkpoint option given something else: named, and the kind it is
        (
            ["weights.py", "--trained", str(ROOT / "docs")],
            f"error: --trained: {ROOT / 'docs'} is not an edgeattn",
        ),
        (["export.py", "--trained", str(ROOT / "docs")], "error: --trained: "),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(args, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(message) and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "usage:" not in res.stderr and "Traceback" not in res.stderr
