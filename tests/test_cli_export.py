"""`edgeattn export`, `run` and `check` through CliRunner: the happy path and every bad input (exit 2)."""

import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import check, export, run
from tests.export_helpers import PREFILL, make_checkpoint

runner = CliRunner()
app = typer.Typer()
for _mod in (export, run, check):
    _mod.register(app)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("c") / "gla", "gla")


@pytest.fixture(scope="module")
def artifact(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("a") / "art"
    res = invoke("export", ckpt, "--out", out, "--prefill-chunk", PREFILL)
    assert res.exit_code == 0, res.output
    return out


def assert_bad_input(res, message):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in lines[0], res.output
    assert "Traceback" not in res.output


def test_export_run_check_happy_path(artifact, tmp_path):
    files = json.loads((artifact / "edgeattn.json").read_text())["files"]
    assert {"step.onnx", "weights.bin"} <= set(files)  # gla: one graph serves step and prefill
    res = invoke("run", artifact, "--prompt", "def ", "-n", 20, "--seed", 0, "--state-out", tmp_path / "s.st")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("def ")  # the prompt, then its continuation
    assert "tokens/s" in res.output.splitlines()[-1] and "peak RSS" in res.output.splitlines()[-1]
    res2 = invoke("run", artifact, "--prompt", "x", "-n", 5, "--state-in", tmp_path / "s.st")
    assert res2.exit_code == 0, res2.output
    res = invoke("check", artifact, "--tokens", 100)
    assert res.exit_code == 0, res.output
    assert "prefill" in res.output and "step" in res.output and "OK" in res.output
    assert "perplexity: torch" in res.output  # and the change the artifact makes to it


@pytest.mark.parametrize("window", [0, 8])
def test_run_repetition_penalty_is_transformers_greedy_with_its_processor(artifact, window):
    """`run --temperature 0 --repetition-penalty 1.5` prints what a greedy loop over the PyTorch model with
    transformers' RepetitionPenaltyLogitsProcessor (over the whole text, or its last 8 tokens) produces."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from edgeattn.models import EdgeLM

    model = EdgeLM.load(artifact / "checkpoint").eval()
    processor = RepetitionPenaltyLogitsProcessor(1.5)
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(24):
            scores = model(torch.tensor([ids]))[0][:, -1].double()
            recent = ids[-window:] if window else ids
            ids.append(int(processor(torch.tensor([recent]), scores).argmax()))
    plain = invoke("run", artifact, "--prompt", "def ", "-n", 24, "--temperature", 0)
    res = invoke(
        "run",
        artifact,
        "--prompt",
        "def ",
        "-n",
        24,
        "--temperature",
        0,
        "--repetition-penalty",
        1.5,
        "--repetition-window",
        window,
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(bytes(ids).decode("utf-8", errors="replace"))
    assert res.stdout != plain.stdout  # the penalty changed the greedy text
    for bad in ("0", "-1", "nan"):
        assert_bad_input(invoke("run", artifact, "--repetition-penalty", bad, "-n", 2), "repetition")


def test_check_says_what_its_bits_per_byte_measured(artifact, tmp_path):
    """The line names the text and the number of tokens, and the figure is that text's cross entropy under the
    PyTorch model (computed here with torch's own cross_entropy)."""
    import math
    import os
    import re

    import torch

    from edgeattn.models import EdgeLM

    res = invoke("check", artifact, "--tokens", 40)
    assert res.exit_code == 0, res.output
    assert (
        f"40 tokens (40 bytes) predicted from the start of {os.__file__}, not the training text" in res.output
    )
    text = tmp_path / "t.txt"
    text.write_bytes(b"import sys\n\ndef main(argv):\n    return len(argv)\n" * 3)
    res = invoke("check", artifact, "--tokens", 30, "--text", text)
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("bits per byte"))
    assert line.startswith(f"bits per byte on 30 tokens (30 bytes) predicted from the start of {text}:"), line
    model = EdgeLM.load(artifact / "checkpoint").eval()
    ids = torch.tensor([list(text.read_bytes()[:31])])
    with torch.no_grad():
        logits = model(ids[:, :-1])[0]
    want = torch.nn.functional.cross_entropy(logits[0].double(), ids[0, 1:]).item() / math.log(2)
    assert float(re.search(r"torch (\d+\.\d+)", line).group(1)) == pytest.approx(want, abs=1e-4)


def test_readme_shows_the_commands_that_export_cpp_example_prints(ckpt, tmp_path):
    """The README says how to build the C++ example, with the commands `export --cpp-example` prints."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    res = invoke("export", ckpt, "--out", tmp_path / "art", "--prefill-chunk", PREFILL, "--cpp-example")
    assert res.exit_code == 0, res.output
    build = next(ln for ln in res.output.splitlines() if "cmake" in ln).strip()
    commands = build.split(" && ")[1:]  # after `cd REPO`
    assert len(commands) == 3 and "--cpp-example" in readme
    assert "bash scripts/fetch_onnxruntime_headers.sh" in readme
    assert " && ".join(commands[1:]) in readme
    run_line = next(ln for ln in res.output.splitlines() if "build/cpp/generate" in ln).strip()
    flags = run_line.split(" ", 2)[2]  # after the binary and the artifact
    assert f"build/cpp/generate runs/gla.onnx {flags}" in readme


def test_check_portable_reports_tensorrt_compatibility(ckpt, tmp_path):
    out = tmp_path / "p"
    assert (
        invoke("export", ckpt, "--out", out, "--target", "portable", "--prefill-chunk", PREFILL).exit_code
        == 0
    )
    res = invoke("check", out, "--tokens", 50)
    assert res.exit_code == 0 and "TensorRT 10 compatibility" in res.output


def test_check_exits_non_zero_on_a_mismatch(ckpt, tmp_path):
    out = tmp_path / "p"
    assert invoke("export", ckpt, "--out", out, "--prefill-chunk", PREFILL).exit_code == 0
    other = make_checkpoint(tmp_path / "other", "gla", seed=7)  # swap the reference weights for others
    for name in ("model.safetensors",):
        (out / "checkpoint" / name).write_bytes((other / name).read_bytes())
    data = json.loads((out / "edgeattn.json").read_text())
    from edgeattn.export.manifest import sha256_file

    data["files"]["checkpoint/model.safetensors"]["sha256"] = sha256_file(
        out / "checkpoint" / "model.safetensors"
    )
    (out / "edgeattn.json").write_text(json.dumps(data))
    res = invoke("check", out, "--tokens", 40)
    assert res.exit_code == 1 and "MISMATCH" in res.output


def test_export_bad_inputs(ckpt, tmp_path):
    assert_bad_input(invoke("export", tmp_path / "missing", "--out", tmp_path / "o"), "does not exist")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    (corrupt / "model.safetensors").write_bytes(b"junk")
    assert_bad_input(invoke("export", corrupt, "--out", tmp_path / "o"), "config")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert_bad_input(invoke("export", ckpt, "--out", busy), "--force")
    assert (busy / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists()
    assert invoke("export", ckpt, "--out", busy, "--force", "--prefill-chunk", PREFILL).exit_code == 0
    assert (busy / "edgeattn.json").exists() and not (busy / "keep.txt").exists()


def test_run_bad_inputs(artifact, ckpt, tmp_path):
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(artifact, edited)
    with open(edited / "step.onnx", "ab") as f:
        f.write(b"\0")
    assert_bad_input(invoke("run", edited, "-n", 1), "sha256")

    future = tmp_path / "future"
    shutil.copytree(artifact, future)
    data = json.loads((future / "edgeattn.json").read_text())
    data["format_version"] = 2
    (future / "edgeattn.json").write_text(json.dumps(data))
    assert_bad_input(invoke("run", future, "-n", 1), "format_version 2")

    old_ort = tmp_path / "old_ort"
    shutil.copytree(artifact, old_ort)
    data = json.loads((old_ort / "edgeattn.json").read_text())
    data["requires"]["onnxruntime"] = "99.0.0"
    (old_ort / "edgeattn.json").write_text(json.dumps(data))
    assert_bad_input(invoke("run", old_ort, "-n", 1), "--target portable")

    assert_bad_input(invoke("run", tmp_path / "nothing", "-n", 1), "does not exist")
    assert_bad_input(invoke("run", artifact, "-n", 1, "--state-in", tmp_path / "none.st"), "does not exist")
    (tmp_path / "junk.st").write_bytes(b"\x01\x02")
    res = invoke("run", artifact, "-n", 1, "--state-in", tmp_path / "junk.st")
    assert res.exit_code == 2 and "Traceback" not in res.output

    other = make_checkpoint(tmp_path / "other", "gla", seed=3)
    other_art = tmp_path / "other_art"
    assert invoke("export", other, "--out", other_art, "--prefill-chunk", PREFILL).exit_code == 0
    assert invoke("run", other_art, "-n", 2, "--state-out", tmp_path / "other.st").exit_code == 0
    assert_bad_input(invoke("run", artifact, "-n", 1, "--state-in", tmp_path / "other.st"), "another model")


def test_run_refuses_out_of_vocabulary_prompts_and_too_long_softmax_prompts(tmp_path):
    small = make_checkpoint(tmp_path / "small_vocab", "gla", vocab_size=128)
    art = tmp_path / "a"
    assert invoke("export", small, "--out", art, "--prefill-chunk", PREFILL).exit_code == 0
    assert_bad_input(invoke("run", art, "--prompt", "caf\u00e9", "-n", 1), "[0, 128)")
    soft = make_checkpoint(tmp_path / "soft", "softmax", max_seq_len=32)
    art = tmp_path / "s"
    assert invoke("export", soft, "--out", art, "--prefill-chunk", PREFILL).exit_code == 0
    assert_bad_input(invoke("run", art, "--prompt", "x" * 40, "-n", 1), "maximum of 32")


def test_run_and_state_files_work_without_torch(artifact, tmp_path):
    """On a device only the base install exists: importing torch must not be needed."""
    code = f"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from typer.testing import CliRunner
from edgeattn.cli.main import app
r = CliRunner().invoke(app, ["run", {str(artifact)!r}, "-n", "8", "--seed", "1", "--state-out", {str(tmp_path / "a.st")!r}])
assert r.exit_code == 0, r.output
r = CliRunner().invoke(app, ["run", {str(artifact)!r}, "-n", "4", "--state-in", {str(tmp_path / "a.st")!r}])
assert r.exit_code == 0, r.output
assert "torch" not in sys.modules or sys.modules["torch"] is None
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_export_refuses_an_output_that_is_contains_or_lies_inside_the_checkpoint(ckpt, tmp_path):
    import shutil

    own = tmp_path / "runs" / "gla"
    shutil.copytree(ckpt, own)
    (own / "trainer_state.pt").write_bytes(b"optimizer")  # what --resume needs
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out, where in ((own / "onnx", "lies inside"), (own, "is"), (tmp_path / "runs", "contains")):
        for force in ([], ["--force"]):
            res = invoke("export", own, "--out", out, "--prefill-chunk", PREFILL, *force)
            assert_bad_input(res, f"{where} the checkpoint")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (own / "trainer_state.pt").read_bytes() == b"optimizer"


def test_checkpoints_and_artifacts_get_the_usual_file_modes(tmp_path):
    import stat

    umask = os.umask(0o022)
    try:
        ckpt = make_checkpoint(tmp_path / "c", "gla")
        (ckpt / "model.safetensors").chmod(0o600)  # as checkpoints written before this fix are
        out = tmp_path / "art"
        assert invoke("export", ckpt, "--out", out, "--prefill-chunk", PREFILL).exit_code == 0
        fresh = make_checkpoint(tmp_path / "fresh", "gla")
    finally:
        os.umask(umask)
    for root in (out, fresh):
        for p in [root, *root.rglob("*")]:
            want = 0o755 if p.is_dir() else 0o644
            assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


# ---- outputs checked before any work; lengths checked before generating; one line per usage error ----


def main_app():
    from edgeattn.cli.main import app as main

    return main


def invoke_main(*args):
    return runner.invoke(main_app(), [str(a) for a in args])


def test_run_checks_state_out_before_generating(artifact, tmp_path):
    (tmp_path / "adir").mkdir()
    for state_out, message in (
        (tmp_path / "adir", "is a directory"),
        (tmp_path / "missing_dir" / "x.state", "does not exist"),
    ):
        res = invoke("run", artifact, "-n", 5, "--state-out", state_out)
        assert_bad_input(res, "--state-out")  # nothing generated: the error is the whole output
        assert message in res.stderr and ".tmp" not in res.stderr
    assert not (tmp_path / "missing_dir").exists() and not any((tmp_path / "adir").iterdir())


def test_an_error_after_generating_starts_its_own_line(artifact, tmp_path, monkeypatch):
    from edgeattn.runtimes.base import Session

    def broken(self, path):
        raise ValueError("disk full")

    monkeypatch.setattr(Session, "save_state", broken)
    res = invoke("run", artifact, "-n", 5, "--seed", 0, "--state-out", tmp_path / "s.st")
    assert res.exit_code == 2
    assert res.stdout.endswith("\n") and res.stderr == "error: disk full\n", (res.stdout, res.stderr)


def test_run_and_sample_check_lengths_against_max_length_before_generating(tmp_path):
    from edgeattn.runtimes import open_session

    soft = make_checkpoint(tmp_path / "soft", "softmax", max_seq_len=32)
    art = tmp_path / "s"
    assert invoke("export", soft, "--out", art, "--prefill-chunk", PREFILL).exit_code == 0
    assert_bad_input(invoke("run", art, "--prompt", "x" * 10, "-n", 23), "maximum of 32")
    res = invoke("run", art, "--prompt", "x" * 10, "-n", 22, "--seed", 0)  # exactly 32: fine
    assert res.exit_code == 0, res.output
    sess = open_session(art)
    with pytest.raises(ValueError, match="generate at most 22"):
        next(sess.generate_text("x" * 10, 23))
    assert sess.position == 0  # refused before anything ran
    sample_app = typer.Typer()
    from edgeattn.cli import sample

    sample.register(sample_app)
    res = runner.invoke(sample_app, [str(soft), "--prompt", "x" * 10, "-n", "23"])
    assert_bad_input(res, "maximum of 32")
    assert runner.invoke(sample_app, [str(soft), "--prompt", "x" * 10, "-n", "22"]).exit_code == 0


def test_run_prints_its_figures_to_stderr(artifact):
    res = invoke("run", artifact, "--prompt", "def ", "-n", 8, "--seed", 0)
    assert res.exit_code == 0, res.output
    assert "tokens/s" not in res.stdout and res.stdout.startswith("def ") and res.stdout.endswith("\n")
    assert "tokens/s" in res.stderr and "peak RSS" in res.stderr


def test_numeric_options_out_of_range_are_one_line_errors(artifact):
    for args, name in (
        (["run", artifact, "--threads", "-3"], "--threads"),
        (["run", artifact, "--threads", "0"], "--threads"),
        (["run", artifact, "-n", "-1"], "--max-new-tokens"),
        (["run", artifact, "--top-p", "1.5"], "--top-p"),
        (["run", artifact, "--temperature", "inf"], "--temperature"),
        (["check", artifact, "--tolerance", "-1"], "--tolerance"),
        (["check", artifact, "--tolerance", "nan"], "--tolerance"),
        (["check", artifact, "--threads", "-1"], "--threads"),
        (["export", artifact, "--out", "x", "--batch", "0"], "--batch"),
        (["export", artifact, "--out", "x", "--precision", "int2"], "--precision"),
    ):
        assert_bad_input(invoke_main(*args), name)


def test_help_version_and_consistent_options():
    import edgeattn

    res = invoke_main("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"edgeattn {edgeattn.__version__}"
    command = typer.main.get_command(main_app())
    for name in command.commands:
        res = invoke_main(name, "--help")
        assert res.exit_code == 0 and "<bool>" not in res.output, (name, res.output)
    assert "<bool>" not in invoke_main("--help").output
    params = {c: {p.name: p for p in command.commands[c].params} for c in ("run", "sample")}
    for option in ("top_p", "temperature", "top_k"):
        assert params["run"][option].default == params["sample"][option].default, option
    assert "-n" in params["sample"]["max_new_tokens"].opts
    assert all(p.help for p in command.commands["run"].params), "every run option has a help text"


def test_check_on_the_base_install_names_the_extra(artifact):
    code = f"""
import sys
sys.modules["torch"] = None
sys.modules["onnx"] = None
from edgeattn.cli.main import app
app(["check", {str(artifact)!r}])
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "pip install 'edgeattn[train]'" in res.stderr


@pytest.mark.parametrize("writer", ["graph", "weights"])
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(ckpt, tmp_path, monkeypatch, writer):
    """ENOSPC from the packager half-way through a file (issue 31): one `error:` line naming --out, exit 2,
    no artifact and no temporary left beside it."""
    import errno

    from edgeattn.export import package, weights

    def full(f, data):
        f.write(data[: len(data) // 2])  # part of it fits, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)

    if writer == "graph":

        def write(self, name, data):
            with open(self.root / name, "wb") as f:
                full(f, data)

        monkeypatch.setattr(package.Package, "write", write)
    else:
        monkeypatch.setattr(weights.WeightsWriter, "_write", lambda self, data: full(self.file, data))
    out = tmp_path / "out" / "art"
    (tmp_path / "out").mkdir()
    res = invoke("export", ckpt, "--out", out, "--prefill-chunk", PREFILL)
    assert_bad_input(res, f"--out {out}: no space left on device, nothing written")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_full_disk_is_recognised_in_a_chain_and_in_a_library_message():
    import errno

    from edgeattn.cli._common import disk_full

    inner = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("the writer failed") from e
    except RuntimeError as outer:
        assert disk_full(outer) is inner
    torch_style = RuntimeError(
        "[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file "
        "data/0: file write failed, No space left on device"
    )
    assert disk_full(torch_style) is torch_style
    from safetensors import SafetensorError

    rust_style = SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    )
    assert disk_full(rust_style) is rust_style
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full(RuntimeError("shape mismatch")) is None


def test_any_command_reports_a_full_disk_in_one_line(capsys):
    import errno

    from edgeattn.cli._common import cli_errors

    @cli_errors
    def command():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run.state")

    with pytest.raises(typer.Exit) as info:
        command()
    assert info.value.exit_code == 2
    assert capsys.readouterr().err == (
        "error: no space left on device writing /data/run.state: free some space or write elsewhere\n"
    )
