"""`edgeattn train` and `edgeattn sample` through Typer's CliRunner: results, resume, and bad input."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import sample, train
from edgeattn.models import EdgeLM

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--chunk-size", "8"]
FAST = ["--seq-len", "16", "--batch-size", "2", "--eval-every", "2", "--eval-windows", "4", "--device", "cpu"]


@pytest.fixture
def app():
    app = typer.Typer()
    train.register(app)
    sample.register(app)
    return app


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEATTN_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.py").write_text("def f(x):\n    return x * 2\n\n" * 80)
    (d / "b.txt").write_text("for i in range(10):\n    print(i)\n" * 80)
    return d


def run(app, *args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_train_then_sample(app, data, tmp_path):
    out = tmp_path / "ckpt"
    r = run(app, "train", "--data", data, "--out", out, "--steps", "4", "--mixer", "retnet", *TINY, *FAST)
    assert r.exit_code == 0, r.output
    assert "done: step 4" in r.stdout and "val bpb" in r.stdout
    model = EdgeLM.load(out)
    assert model.cfg.mixers == ["retnet", "retnet"] and model.cfg.d_model == 32
    assert (out / "trainer_state.pt").is_file() and (out / "trainer_state.json").is_file()

    args = ["sample", out, "--prompt", "def ", "--max-new-tokens", "20", "--seed", "3"]
    s1, s2 = run(app, *args), run(app, *args)
    assert s1.exit_code == 0, s1.output
    assert s1.stdout.startswith("def ") and s1.stdout == s2.stdout
    assert run(app, "sample", out, "--temperature", "0", "--max-new-tokens", "5").exit_code == 0

    # --resume continues from the checkpoint's step with its own config and options (--data, --seq-len
    # ...) unless given again; --out defaults to it.
    r = run(app, "train", "--resume", out, "--steps", "6")
    assert r.exit_code == 0, r.output
    assert "resumed from" in r.output and "done: step 6" in r.stdout and "of 16 bytes" in r.output
    assert EdgeLM.load(out).cfg.mixers == ["retnet", "retnet"]


def test_per_layer_mixers_and_config_file(app, data, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"d_model": 32, "n_heads": 2, "chunk_size": 8}')
    out = tmp_path / "ckpt"
    r = run(
        app,
        "train",
        "--data",
        data,
        "--out",
        out,
        "--steps",
        "2",
        "--mixer",
        "gla,linear",
        "--config",
        cfg,
        *FAST,
    )
    assert r.exit_code == 0, r.output
    assert EdgeLM.load(out).cfg.mixers == ["gla", "linear"]


def _no_checkpoint(out):
    return not out.exists() or not any(
        p.name.endswith((".safetensors", ".pt", ".json")) for p in out.rglob("*")
    )


def _bad(app, out, *args, message):
    r = run(app, "train", "--out", out, "--steps", "2", *TINY, *FAST, *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _no_checkpoint(out)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]  # no temp dirs


def test_bad_data(app, data, tmp_path):
    out = tmp_path / "out"
    _bad(app, out, "--data", tmp_path / "missing", message="does not exist")
    (tmp_path / "empty_dir").mkdir()
    _bad(app, out, "--data", tmp_path / "empty_dir", message="holds no files")
    (tmp_path / "empty.txt").write_text("")
    _bad(app, out, "--data", tmp_path / "empty.txt", message="empty")
    (tmp_path / "blob.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50)
    _bad(app, out, "--data", tmp_path / "blob.bin", message="NUL bytes")
    (tmp_path / "latin1.txt").write_bytes("café crème\n".encode("latin-1") * 50)
    _bad(app, out, "--data", tmp_path / "latin1.txt", message="not UTF-8")
    (tmp_path / "tiny.txt").write_text("x = 1\n")
    _bad(app, out, "--data", tmp_path / "tiny.txt", message="too small")


def test_bad_options(app, data, tmp_path):
    out = tmp_path / "out"
    _bad(app, out, "--data", data, "--mixer", "nope", message="unknown mixer 'nope'")
    _bad(app, out, "--data", data, "--mixer", "gla,nope", message="unknown mixer 'nope'")
    _bad(app, out, "--data", data, "--steps", "0", message="--steps must be >= 1")
    _bad(app, out, "--data", data, "--d-model", "33", message="multiple of n_heads")
    _bad(app, out, "--data", data, "--n-heads", "0", message="n_heads must be >= 1")
    _bad(app, out, "--data", data, "--max-seq-len", "0", message="max_seq_len must be >= 1")
    _bad(app, out, "--data", data, "--lr", "nan", message="--lr must be a finite number")
    _bad(app, out, "--data", data, "--time-budget", "inf", message="--time-budget must be a finite number")
    (tmp_path / "bad.json").write_text('{"d_model": 32, "colour": "red"}')
    _bad(
        app,
        out,
        "--data",
        data,
        "--config",
        tmp_path / "bad.json",
        message="unknown EdgeConfig fields: colour",
    )
    _bad(app, out, "--data", data, "--resume", tmp_path / "nothing", message="no such checkpoint")


def test_resume_of_another_config_and_existing_out(app, data, tmp_path):
    first = tmp_path / "first"
    assert run(app, "train", "--data", data, "--out", first, "--steps", "2", *TINY, *FAST).exit_code == 0
    out = tmp_path / "second"
    for flags, field in ((["--d-model", "64"], "d_model=32"), (["--mixer", "retnet"], "mixer=")):
        r = run(app, "train", "--data", data, "--resume", first, "--out", out, "--steps", "4", *FAST, *flags)
        assert r.exit_code == 2, r.output
        assert "another config" in r.stderr and field in r.stderr
        assert _no_checkpoint(out)
    # A checkpoint in --out is replaced only with --force (or its old name --overwrite, hidden in --help);
    # a plain directory with files never.
    r = run(app, "train", "--data", data, "--out", first, "--steps", "2", *TINY, *FAST)
    assert r.exit_code == 2 and "--force" in r.stderr
    for flag in ("--force", "--overwrite"):
        r = run(app, "train", "--data", data, "--out", first, "--steps", "2", flag, *TINY, *FAST)
        assert r.exit_code == 0, r.output
    assert "--overwrite" not in run(app, "train", "--help").output
    r = run(app, "train", "--data", data, "--out", data, "--steps", "2", *TINY, *FAST)
    assert r.exit_code == 2 and "not a checkpoint" in r.stderr
    assert _no_checkpoint(data)


def test_sample_bad_input(app, tmp_path):
    r = run(app, "sample", tmp_path / "missing")
    assert r.exit_code == 2 and "does not exist" in r.stderr
    ckpt = tmp_path / "ckpt"
    from edgeattn.models import EdgeConfig

    EdgeLM(EdgeConfig(d_model=32, n_layers=1, n_heads=2)).save(ckpt)
    r = run(app, "sample", ckpt, "--top-p", "0")
    assert r.exit_code == 2 and "top_p" in r.stderr
    r = run(app, "sample", ckpt, "--prompt", "")
    assert r.exit_code == 2 and "prompt" in r.stderr


def test_help_defaults_match_the_code(app):
    """The defaults shown in --help are written out by hand (torch is not imported for --help)."""
    from edgeattn.cli.train import DEFAULT_MODEL
    from edgeattn.models import EdgeConfig
    from edgeattn.train import TrainConfig

    command = typer.main.get_command(app).commands["train"]
    cfg, model_cfg = TrainConfig(), EdgeConfig()
    checked = 0
    for p in command.params:
        shown = p.show_default
        if not isinstance(shown, str) or not shown.replace(".", "").replace("e-", "").isdigit():
            continue
        if p.name in DEFAULT_MODEL:
            want = DEFAULT_MODEL[p.name]
        else:
            want = getattr(cfg, p.name) if hasattr(cfg, p.name) else getattr(model_cfg, p.name)
        assert float(shown) == float(want), p.name
        checked += 1
    assert checked >= 13


def test_mixer_list_sets_the_layers_and_says_so(app, data, tmp_path):
    out = tmp_path / "ckpt"
    r = run(
        app,
        "train",
        "--data",
        data,
        "--out",
        out,
        "--steps",
        "1",
        "--mixer",
        "gla,softmax",
        *TINY[:2],
        *TINY[4:],
        *FAST,
    )
    assert r.exit_code == 0, r.output
    assert "note: --mixer names 2 layers" in r.stderr
    assert EdgeLM.load(out).cfg.n_layers == 2
    # --n-layers given and disagreeing: refused, not overridden
    _bad(
        app,
        tmp_path / "o2",
        "--data",
        data,
        "--mixer",
        "gla,softmax,gla",
        message="--mixer names 3 layers but --n-layers is 2",
    )


def test_max_seq_len_option_sets_the_softmax_limit(app, data, tmp_path):
    out = tmp_path / "soft"
    args = ["--data", data, "--out", out, "--steps", "1", "--mixer", "softmax", "--max-seq-len", "16384"]
    r = run(app, "train", *args, *TINY, *FAST)
    assert r.exit_code == 0, r.output
    assert EdgeLM.load(out).cfg.max_seq_len == 16384


def test_sample_takes_n_and_refuses_more_tokens_than_max_seq_len(app, tmp_path):
    from edgeattn.models import EdgeConfig

    ckpt = tmp_path / "soft"
    EdgeLM(EdgeConfig(d_model=32, n_layers=1, n_heads=2, mixer="softmax", max_seq_len=24)).save(ckpt)
    r = run(app, "sample", ckpt, "--prompt", "abcd", "-n", "20", "--seed", "1")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.encode()) >= len("abcd") + 1
    r = run(app, "sample", ckpt, "--prompt", "abcd", "-n", "21")
    assert r.exit_code == 2 and r.stdout == "" and "maximum of 24" in r.stderr, r.output


def test_train_removes_what_a_killed_run_left_beside_its_checkpoint(app, data, tmp_path):
    import subprocess
    import sys

    from edgeattn._atomic import _host

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "ckpt"
    stale = tmp_path / f".ckpt.tmp-{_host()}-{dead.pid}-abcd1234"  # a checkpoint save killed mid-write
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    mine = tmp_path / ".ckpt.keep"  # not our naming: never touched
    mine.write_text("x")
    r = run(app, "train", "--data", data, "--out", out, "--steps", "1", *TINY, *FAST)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", ".ckpt.keep", "data", "cache"])
