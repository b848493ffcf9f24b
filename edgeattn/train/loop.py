"""The training loop: AdamW, warm-up then cosine decay, gradient clipping, periodic validation and
checkpoints that resume to the same result as an uninterrupted run.

    result = train(EdgeConfig(mixer="gla"), TrainConfig(steps=1000), out="runs/gla")
    result = train(None, TrainConfig(steps=2000), out="runs/gla", resume="runs/gla")   # continue

A checkpoint is one directory that ``EdgeLM.load`` reads (``model.safetensors`` + ``config.json``) plus
``trainer_state.pt`` (optimizer, step, tokens seen, elapsed time, RNG state, history, training config)
and ``trainer_state.json`` (the same minus tensors, for people). It is written to a temp directory next
to ``out`` and renamed into place, so an interrupted write (or Ctrl-C) leaves the previous one whole.

The learning rate follows ``progress`` in [0, 1]: ``step / steps``, or ``elapsed / time_budget`` when
training for a time budget (the larger of the two when both are given). Only step-driven runs are
exactly reproducible; a time budget depends on the machine's speed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgeattn._atomic import cleanup_stale, make_temp_dir, replace_dir
from edgeattn._deps import require
from edgeattn.artifact.tokenizer import TOKENIZER_FILES, TOKENIZER_JSON
from edgeattn.models import EdgeConfig, EdgeLM
from edgeattn.models.lm import CONFIG, WEIGHTS
from edgeattn.train import distributed as D
from edgeattn.train.data import load_corpus

torch = require("torch")
F = torch.nn.functional

STATE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
STATE_VERSION = 1
DEFAULT_STEPS = 2000  # when neither steps nor a time budget is given


@dataclass
class TrainConfig:
    steps: int | None = None  # optimizer steps; None: DEFAULT_STEPS, or until time_budget runs out
    time_budget: float | None = None  # seconds of training (evaluations included), across resumes
    batch_size: int = 8  # sequences per step and rank (more steps beat bigger batches on a small budget)
    seq_len: int = 256  # bytes per sequence
    lr: float = 5e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 30  # linear warm-up from 0
    weight_decay: float = 0.1  # on matrices and embeddings; never on norms and biases
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    eval_every: int = 100  # steps between validations
    eval_windows: int = 64  # validation windows (of seq_len bytes) per evaluation
    save_every: int = 500  # steps between checkpoints (one is always written at the end)
    seed: int = 0
    data: str | None = None  # text file or directory; None: the Python standard library
    val_fraction: float = 0.02  # tail of the corpus held out for validation
    device: str = "auto"  # auto, cpu or cuda
    fsdp: bool = False  # shard with FSDP2 instead of DDP under torchrun

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        for name in ("batch_size", "seq_len", "eval_every", "eval_windows", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("--warmup-steps, --grad-clip and --weight-decay must be >= 0")

    @property
    def total_steps(self) -> int | None:
        """The step budget: steps, DEFAULT_STEPS without any budget, None for a pure time budget."""
        if self.steps is None and self.time_budget is None:
            return DEFAULT_STEPS
        return self.steps


@dataclass
class TrainResult:
    out: Path | None
    step: int
    tokens: int  # tokens trained on, all ranks
    elapsed: float  # seconds of training, across resumes
    tokens_per_s: float  # of this run (not counting earlier segments of a resumed run)
    val_loss: float
    val_bpb: float
    history: list[dict] = field(default_factory=list)
    model: object = None  # the trained EdgeLM, unwrapped (under FSDP its parameters are shards)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from lr to lr * min_lr_ratio over progress."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def make_optimizer(model, cfg: TrainConfig, fused: bool = False):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


# ---- checkpoints ----


def is_checkpoint(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()


def read_trainer_state(path: str | os.PathLike) -> tuple[EdgeConfig, dict]:
    """The model config and trainer state of a checkpoint (ValueError if ``path`` is none). A model
    checkpoint without a trainer state (``edgeattn import``'s) gives ``{}``: fine-tuning from step 0."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such checkpoint directory")
    if not is_checkpoint(path):
        raise ValueError(f"--resume {path}: not a checkpoint (needs {CONFIG} and {WEIGHTS})")
    try:
        cfg = EdgeConfig.from_dict(json.loads((path / CONFIG).read_text()))
        state = (
            torch.load(path / STATE, map_location="cpu", weights_only=True)
            if (path / STATE).is_file()
            else {}
        )
    except (OSError, RuntimeError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"--resume {path}: unreadable checkpoint: {e}") from e
    if state == {}:
        return cfg, state
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(f"--resume {path}: {STATE} is not a version {STATE_VERSION} trainer state")
    return cfg, state


def config_diff(have: EdgeConfig, want: EdgeConfig) -> list[str]:
    a, b = have.to_dict(), want.to_dict()
    a["mixer"], b["mixer"] = have.mixers, want.mixers
    return [f"{k}={a[k]!r} (asked {b[k]!r})" for k in a if a[k] != b[k]]


def tokenizer_of(resume: Path | None, model_cfg: EdgeConfig) -> Path | None:
    """The tokenizer.json training data is encoded with: the resumed checkpoint's (an imported model's),
    else None (bytes). ValueError for a model that byte-level data cannot feed."""
    if resume is not None and (resume / TOKENIZER_JSON).is_file():
        return resume / TOKENIZER_JSON
    where = f"--resume {resume}: " if resume is not None else ""
    if "tokenizer" in model_cfg.extra:
        raise ValueError(
            f"{where}the model was imported with a tokenizer but the checkpoint has no {TOKENIZER_JSON}: "
            "copy it there (training data must be encoded with it)"
        )
    if model_cfg.vocab_size < 256:
        raise ValueError(
            f"{where}the model's vocabulary is {model_cfg.vocab_size} tokens and the checkpoint has no "
            f"{TOKENIZER_JSON}: byte-level training data needs a vocabulary of at least 256"
        )
    return None


def write_checkpoint(
    out: Path,
    model_state: dict,
    model_cfg: EdgeConfig,
    trainer_state: dict,
    summary: dict,
    files_from: Path | None = None,
) -> None:
    """Write the checkpoint to a temp directory next to ``out``, then swap it into place. The tokenizer
    files of ``files_from`` (the resumed checkpoint) are copied along."""
    tmp = make_temp_dir(out)
    try:
        model = EdgeLM(model_cfg)
        model.load_state_dict(model_state)
        model.save_files(tmp)  # EdgeLM's own format: safetensors (tied weights once) + config.json
        for name in TOKENIZER_FILES if files_from is not None else ():
            if (files_from / name).is_file():
                shutil.copy2(files_from / name, tmp / name)
        torch.save(trainer_state, tmp / STATE)
        (tmp / STATE_JSON).write_text(json.dumps(summary, indent=2, sort_keys=True))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_out_dir(out: Path, resume: Path | None, overwrite: bool) -> None:
    """Refuse to replace anything but a checkpoint we are continuing, or one ``overwrite`` allows."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if resume is not None and out.resolve() == resume.resolve():
        return
    if not any(out.iterdir()):
        return
    if not is_checkpoint(out):
        raise ValueError(f"--out {out} exists and is not a checkpoint; choose an empty or new directory")
    if not overwrite:
        raise ValueError(f"--out {out} already holds a checkpoint; pass --resume {out} or --force")


# ---- the loop ----


def _model_state(model, info: D.DistInfo, fsdp: bool) -> dict:
    """Full CPU tensors of the model (a collective under FSDP: every rank calls it)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _optim_state(model, opt, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return opt.state_dict()


def _load_optim_state(model, opt, state: dict, fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
        )
    else:
        opt.load_state_dict(state)


@torch.no_grad()
def evaluate(model, windows, cfg: TrainConfig, info: D.DistInfo, autocast) -> float:
    """Mean validation loss in nats per byte over ``windows`` ([N, T + 1]), shared across ranks."""
    was_training = model.training
    model.eval()
    # The same number of windows on every rank (FSDP all-gathers in every forward, so the calls must
    # match); with fewer windows than ranks each rank takes them all, which leaves the mean unchanged.
    n = len(windows) // info.world_size * info.world_size
    mine = windows[info.rank : n : info.world_size] if n else windows
    total = torch.zeros(2, dtype=torch.float64, device=info.device)
    for i in range(0, len(mine), cfg.batch_size):
        w = torch.from_numpy(mine[i : i + cfg.batch_size]).to(info.device)
        with autocast():
            logits, _ = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += torch.stack(
            [loss.double(), torch.tensor(w[:, 1:].numel(), dtype=torch.float64, device=info.device)]
        )
    D.all_reduce_sum(total, info)
    model.train(was_training)
    return (total[0] / total[1]).item()


def _console(enabled: bool):
    from rich.console import Console

    return Console(stderr=True, quiet=not enabled, highlight=False)


def _progress(console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def train(
    model_cfg: EdgeConfig | None,
    cfg: TrainConfig,
    *,
    out: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    overwrite: bool = False,
    callback: Callable[[int, dict], None] | None = None,
    verbose: bool = True,
) -> TrainResult:
    """Train (or continue training) an EdgeLM; see the module docstring. Under torchrun this runs on
    every rank. ``callback(step, metrics)`` runs after each step (and its checkpoint, if any)."""
    info = D.init_distributed(cfg.device)
    try:
        result = _train(info, model_cfg, cfg, out, resume, overwrite, callback, verbose)
    except BaseException:
        D.shutdown(info, clean=False)  # peers may never reach a barrier now
        raise
    D.shutdown(info)
    return result


def _train(info, model_cfg, cfg, out, resume, overwrite, callback, verbose) -> TrainResult:
    out = None if out is None else Path(out)
    resume = None if resume is None else Path(resume)
    if resume is not None and out is None:
        out = resume  # continue in place
    # Everything that can be wrong with the input is checked before anything is written.
    state = None
    if resume is not None:
        ckpt_cfg, state = read_trainer_state(resume)
        if model_cfg is not None and (diff := config_diff(ckpt_cfg, model_cfg)):
            raise ValueError(f"--resume {resume}: the checkpoint has another config: {', '.join(diff[:4])}")
        model_cfg = ckpt_cfg
    model_cfg = EdgeConfig() if model_cfg is None else model_cfg
    if out is not None:
        if info.is_main:
            cleanup_stale(out)  # what a killed earlier run left beside it (see edgeattn._atomic)
        check_out_dir(out, resume, overwrite)
    tokenizer = tokenizer_of(resume, model_cfg)
    torch.manual_seed(cfg.seed)
    model = EdgeLM.load(resume) if resume is not None else EdgeLM(model_cfg)  # unknown mixers fail here
    corpus = load_corpus(cfg.data, seq_len=cfg.seq_len, val_fraction=cfg.val_fraction, tokenizer=tokenizer)
    val = corpus.val_windows(cfg.seq_len, cfg.eval_windows)
    corpus.batch(
        0, batch_size=1, seq_len=cfg.seq_len, seed=cfg.seed, rank=info.rank, world_size=info.world_size
    )

    model.to(info.device)
    model.train()
    wrapped = D.wrap_model(model, info, fsdp=cfg.fsdp)
    is_cuda = info.device.startswith("cuda")
    opt = make_optimizer(model, cfg, fused=is_cuda and not cfg.fsdp)
    step, tokens, elapsed, history = 0, 0, 0.0, []
    if state:  # {}: a model checkpoint without a trainer state (imported): fine-tuning from step 0
        _load_optim_state(model, opt, state["optimizer"], cfg.fsdp)
        step, tokens, elapsed, history = (
            state["step"],
            state["tokens"],
            state["elapsed"],
            list(state["history"]),
        )
        torch.set_rng_state(state["rng"]["torch"])
        if is_cuda and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"])

    def autocast():
        if is_cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    total = cfg.total_steps
    main = info.is_main and verbose
    console = _console(main)
    console.print(
        f"edgeattn train: {'+'.join(sorted(set(model_cfg.mixers)))}, "
        f"{model.num_parameters() / 1e6:.2f}M params, "
        f"d_model {model_cfg.d_model}, {model_cfg.n_layers} layers, {model_cfg.n_heads} heads, "
        f"batch {cfg.batch_size}x{info.world_size} of {cfg.seq_len} {corpus.unit}, {info.device}"
        + (f", {'FSDP2' if cfg.fsdp else 'DDP'} x{info.world_size}" if info.enabled else "")
    )
    console.print(
        f"data: {corpus.source}; train {len(corpus.train):,} {corpus.unit}, validation {len(corpus.val):,}"
    )
    if state:
        console.print(f"resumed from {resume} at step {step}")
    elif resume is not None:
        console.print(f"fine-tuning {resume} (no trainer state: step 0, a fresh optimizer)")
        if state.get("world_size", 1) != info.world_size:
            console.print(
                f"note: trained on {state.get('world_size', 1)} processes, now {info.world_size}: "
                "other data shards"
            )

    def progress_of(step: int, elapsed: float) -> float:
        p = 0.0 if total is None else step / total
        if cfg.time_budget is not None:
            p = max(p, elapsed / cfg.time_budget)
        return p

    def done(step: int, elapsed: float) -> bool:
        return (total is not None and step >= total) or (
            cfg.time_budget is not None and elapsed >= cfg.time_budget
        )

    last_saved = (
        step if resume is not None and out is not None and out.resolve() == resume.resolve() else None
    )
    val_loss = history[-1]["val_loss"] if history else float("nan")

    def save(step: int) -> None:
        nonlocal last_saved
        model_state = _model_state(model, info, cfg.fsdp)
        optim_state = _optim_state(model, opt, cfg.fsdp)
        if info.is_main and out is not None:
            rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if is_cuda else None}
            summary = {
                "step": step,
                "tokens": tokens,
                "elapsed": elapsed,
                "val_loss": val_loss,
                "val_bpb": val_loss / math.log(2),
                "world_size": info.world_size,
                "train_config": asdict(cfg),
                "history": history,
            }
            trainer_state = {"version": STATE_VERSION, "optimizer": optim_state, "rng": rng, **summary}
            write_checkpoint(out, model_state, model_cfg, trainer_state, summary, files_from=resume)
        D.barrier(info)
        last_saved = step

    tokens_per_step = cfg.batch_size * cfg.seq_len * info.world_size
    start_tokens, run_start = tokens, time.perf_counter()
    t0 = run_start - elapsed  # elapsed counts earlier segments of a resumed run
    tps, loss_ema = 0.0, None
    try:
        with _progress(console) as bar:
            task = bar.add_task(f"step {step}", total=100, loss="-", tps="-")
            while not done(step, elapsed):
                progress = progress_of(step, elapsed)
                lr = lr_at(cfg, step, progress)
                for group in opt.param_groups:
                    group["lr"] = lr
                x, y = corpus.batch(
                    step,
                    batch_size=cfg.batch_size,
                    seq_len=cfg.seq_len,
                    seed=cfg.seed,
                    rank=info.rank,
                    world_size=info.world_size,
                )
                x, y = torch.from_numpy(x).to(info.device), torch.from_numpy(y).to(info.device)
                with autocast():
                    logits, _ = wrapped(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss.backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                tokens += tokens_per_step
                # Every rank must agree on the time (it drives the schedule and the stop): rank 0's wins.
                now = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=info.device)
                elapsed = D.broadcast(now, info).item()
                loss_value = loss.item()
                loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
                tps = (tokens - start_tokens) / max(time.perf_counter() - run_start, 1e-9)
                metrics = {"step": step, "loss": loss_value, "lr": lr, "tokens": tokens, "elapsed": elapsed}
                finished = done(step, elapsed)
                if step % cfg.eval_every == 0 or finished:
                    val_loss = evaluate(model, val, cfg, info, autocast)
                    metrics.update(val_loss=val_loss, val_bpb=val_loss / math.log(2))
                    history.append(
                        {k: metrics[k] for k in ("step", "tokens", "elapsed", "val_loss", "val_bpb")}
                    )
                    bar.console.print(
                        f"step {step:>6} | loss {loss_ema:.4f} | val loss {val_loss:.4f} | "
                        f"val bpb {val_loss / math.log(2):.4f} | lr {lr:.2e} | {tps:,.0f} tok/s | "
                        f"{elapsed:.0f}s"
                    )
                if out is not None and (step % cfg.save_every == 0 or finished):
                    save(step)
                bar.update(
                    task,
                    completed=100 * min(progress_of(step, elapsed), 1.0),
                    description=f"step {step}" + (f"/{total}" if total else ""),
                    loss=f"{loss_ema:.4f}",
                    tps=f"{tps:,.0f}",
                )
                if callback is not None:
                    callback(step, metrics)
    except KeyboardInterrupt:
        where = f"; the checkpoint of step {last_saved} in {out} is intact" if last_saved is not None else ""
        console.print(f"interrupted at step {step}{where}")
        raise
    bpb = val_loss / math.log(2)
    return TrainResult(
        out=out,
        step=step,
        tokens=tokens,
        elapsed=elapsed,
        tokens_per_s=tps,
        val_loss=val_loss,
        val_bpb=bpb,
        history=history,
        model=model,
    )
