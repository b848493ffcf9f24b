"""Training: byte data and its cache, the schedule, sampling, exact resume, and torchrun data-parallel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeattn.models import EdgeConfig, EdgeLM
from edgeattn.train import TrainConfig, generate, load_corpus, sample_next, train
from edgeattn.train.data import SKIP_DIRS, stdlib_files
from edgeattn.train.loop import lr_at

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8}
REPO = Path(__file__).resolve().parents[1]


def tiny_cfg(mixer: str = "gla") -> EdgeConfig:
    return EdgeConfig(mixer=mixer, **TINY)


@pytest.fixture
def corpus_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEATTN_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "data"
    (d / "pkg").mkdir(parents=True)
    text = "def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n"
    (d / "a.py").write_text(text * 60)
    (d / "pkg" / "b.py").write_text("import os\n\nprint(os.sep)  # é ü\n" * 60)
    (d / ".hidden").write_bytes(b"\0\1\2")  # hidden entries are skipped
    return d


# ---- data ----


def test_stdlib_default_corpus_is_sorted_python_sources():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    assert not any(SKIP_DIRS.intersection(f.parts[-3:-1]) for f in files)


def test_corpus_split_cache_and_batches(corpus_dir, tmp_path):
    c = load_corpus(corpus_dir, seq_len=16, val_fraction=0.1)
    files = [corpus_dir / "a.py", corpus_dir / "pkg" / "b.py"]
    raw = b"".join(f.read_bytes() for f in files)  # sorted order, the hidden file left out
    assert bytes(c.train) + bytes(c.val) == raw
    assert len(c.val) == int(len(raw) * 0.1)
    assert isinstance(c.train.base, np.memmap) or isinstance(c.train, np.memmap)
    cached = list((tmp_path / "cache").glob("corpus-*.bin"))
    assert len(cached) == 1 and cached[0].read_bytes() == raw
    assert load_corpus(corpus_dir, seq_len=16).train.filename == c.train.filename  # built once

    x, y = c.batch(3, batch_size=4, seq_len=16, seed=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int64
    assert (x[:, 1:] == y[:, :-1]).all()
    x2, _ = c.batch(3, batch_size=4, seq_len=16, seed=0)
    assert (x == x2).all()  # a pure function of (seed, rank, step)
    assert not (c.batch(4, batch_size=4, seq_len=16, seed=0)[0] == x).all()
    s0, s1 = c.shard(0, 2), c.shard(1, 2)
    assert bytes(s0) + bytes(s1) == bytes(c.train)[: 2 * len(s0)]
    w = c.val_windows(16, 4)
    assert w.shape == (4, 17)


@pytest.mark.parametrize(
    "content, message",
    [(b"", "empty"), (b"abc\0def", "NUL"), (b"ok \xff\xfe bad", "not UTF-8"), (b"caf\xc3", "ends inside")],
)
def test_corpus_rejects_non_text(tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("EDGEATTN_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "x.txt"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_corpus(f, seq_len=8)
    assert not list((tmp_path / "cache").glob("*")) if (tmp_path / "cache").exists() else True


def test_corpus_rejects_missing_small_and_empty_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEATTN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "small.txt").write_text("x" * 40)
    with pytest.raises(ValueError, match="too small"):
        load_corpus(tmp_path / "small.txt", seq_len=32)


# ---- schedule and sampling ----


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(0.1)
    assert lr_at(cfg, 9, 0.09) == pytest.approx(1.0)
    assert lr_at(cfg, 10, 0.0) == pytest.approx(1.0)
    assert lr_at(cfg, 55, 0.5) == pytest.approx(0.55)
    assert lr_at(cfg, 100, 1.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="--steps must be >= 1"):
        TrainConfig(steps=0)


def test_sample_next_filters():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(500, 1)
    assert (sample_next(logits, temperature=0) == 1).all()
    assert (sample_next(logits, top_k=1, generator=gen) == 1).all()
    assert (sample_next(logits, top_p=1e-3, generator=gen) == 1).all()
    assert set(sample_next(logits, top_k=2, generator=gen).tolist()) == {1, 3}
    # p = softmax([0, 3, 1, 2]) = [.03, .64, .09, .24]: top_p 0.8 keeps {1, 3} (0.64 < 0.8 <= 0.88)
    assert set(sample_next(logits, top_p=0.8, generator=gen).tolist()) == {1, 3}
    assert set(sample_next(logits, generator=gen).tolist()) == {0, 1, 2, 3}
    a = sample_next(logits, generator=torch.Generator().manual_seed(5))
    b = sample_next(logits, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=0.0)


def test_generate_with_state_matches_full_forward():
    model = EdgeLM(tiny_cfg("gla")).eval()
    prompt = list(b"def f(x):")
    out = list(generate(model, prompt, 12, temperature=0))
    ids = prompt + out
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    greedy = logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert out == greedy


# ---- the loop ----


def _train_cfg(data, **kw) -> TrainConfig:
    base = dict(steps=8, batch_size=2, seq_len=16, warmup_steps=2, eval_every=4, eval_windows=4, save_every=4)
    return TrainConfig(data=str(data), device="cpu", **{**base, **kw})


def test_resume_after_interrupt_matches_uninterrupted(corpus_dir, tmp_path):
    full = train(tiny_cfg(), _train_cfg(corpus_dir), out=tmp_path / "full", verbose=False)
    assert full.step == 8 and len(full.history) == 2 and full.val_bpb < 8

    def interrupt(step, metrics):
        if step == 6:  # after the checkpoint of step 4, before the one of step 8
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(), _train_cfg(corpus_dir), out=tmp_path / "half", callback=interrupt, verbose=False)
    half = tmp_path / "half"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".half")) == []  # no temp left
    assert EdgeLM.load(half) is not None
    resumed = train(None, _train_cfg(corpus_dir), resume=half, verbose=False)
    assert resumed.step == 8 and resumed.out == half
    a, b = EdgeLM.load(tmp_path / "full").state_dict(), EdgeLM.load(half).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [h["val_loss"] for h in resumed.history] == [h["val_loss"] for h in full.history]


def test_time_budget_stops_and_checkpoints(corpus_dir, tmp_path):
    r = train(
        tiny_cfg("retnet"),
        _train_cfg(corpus_dir, steps=None, time_budget=1.0),
        out=tmp_path / "o",
        verbose=False,
    )
    assert r.step >= 1 and r.elapsed >= 1.0
    assert EdgeLM.load(tmp_path / "o").cfg.mixers == ["retnet", "retnet"]


# ---- scale-out ----

_WORKER = textwrap.dedent(
    """
    import hashlib, os, sys
    import torch
    from edgeattn.models import EdgeConfig
    from edgeattn.train import TrainConfig, train

    data, out, fsdp = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    torch.distributed.init_process_group("gloo")  # ours: train() leaves it open for the hashes below
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=16, warmup_steps=1, eval_every=2, eval_windows=4,
                      data=data, device="cpu", fsdp=fsdp)
    r = train(EdgeConfig(mixer="gla", d_model=32, n_layers=2, n_heads=2, chunk_size=8), cfg,
              out=out + "/ckpt", verbose=False)
    h = hashlib.sha256()
    for k, v in sorted(r.model.state_dict().items()):
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        h.update(k.encode()); h.update(v.detach().cpu().contiguous().numpy().tobytes())
    with open(f"{out}/rank{os.environ['RANK']}.txt", "w") as f:
        f.write(h.hexdigest())
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


def _torchrun(tmp_path, corpus_dir, fsdp: bool):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(corpus_dir), str(tmp_path), "1" if fsdp else "0"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    done = [(tmp_path / f"rank{r}.txt").is_file() for r in (0, 1)]
    # The one failure tolerated: gloo's known abort in interpreter teardown (pytorch/pytorch#179291),
    # seen about once in a dozen runs on a busy machine, after both ranks finished and wrote their
    # results; everything below is still checked.
    teardown_abort = all(done) and "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or teardown_abort, proc.stderr[-3000:]
    h0, h1 = (tmp_path / "rank0.txt").read_text(), (tmp_path / "rank1.txt").read_text()
    assert h0 == h1  # both ranks end with the same weights
    model = EdgeLM.load(tmp_path / "ckpt")  # written by rank 0 only, an ordinary checkpoint
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    assert h.hexdigest() == h0


@pytest.mark.slow  # 5 s: test_the_train_command_under_torchrun runs DDP x2 through the CLI, FSDP2 below the worker
def test_torchrun_ddp_two_cpu_processes(tmp_path, corpus_dir):
    _torchrun(tmp_path, corpus_dir, fsdp=False)


def test_torchrun_fsdp2_two_cpu_processes(tmp_path, corpus_dir):
    _torchrun(tmp_path, corpus_dir, fsdp=True)


def test_the_train_command_under_torchrun(tmp_path, corpus_dir):
    """The CLI itself under torchrun: it joins and leaves the process group, rank 0 writes the checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "edgeattn.cli.main", "train", "--data", str(corpus_dir), "--out", str(out),
           "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-every", "3",
           "--eval-windows", "4", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--device", "cpu"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: step 3") == 1  # the summary from rank 0 only
    assert "DDP x2" in proc.stderr  # two ranks, data-parallel
    assert EdgeLM.load(out).cfg.d_model == 32
