"""Linearization: a pretrained softmax transformer into a fixed-state model (``edgeattn linearize``).

    result = linearize("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/lin", LinearizeConfig(form="linear+window", steps=400))
    result = linearize(teacher, "runs/lin", cfg, resume=True)        # continue from the last save

Two stages (LoLCATs, Zhang et al. 2024; Hedgehog; T2R):

1. **Attention transfer.** Every linearized layer is the teacher's layer with its softmax attention replaced
   (``FORMS``), q/k/v/o copied from the teacher (grouped k/v heads repeated where the new mixer has none).
   The teacher runs on a batch; each linearized mixer gets the teacher's own input of that layer and is
   trained to reproduce the teacher's attention output there (``attention_io``: the output of the layer's
   attention after o_proj, what transformers' ``LlamaAttention`` returns). The loss is the mean over layers
   of ``|y - y_teacher|^2 / mean(y_teacher^2)`` (the share of the target's energy left unexplained), so every
   layer counts alike. Trained: the new parts only for the Hedgehog forms (feature maps, window factors:
   LoLCATs), the whole mixer for GLA and Gated DeltaNet (their gates and norms have no teacher counterpart).
2. **Distillation.** The whole student against the teacher's logits: KL(teacher || student) per token,
   through low-rank adapters on q/k/v/o of the linearized layers (``lora`` rank; LoLCATs), or every weight
   (``lora=0``: full fine-tuning). Adapters are merged into the weights when a checkpoint is written.

The budget is ``steps`` and/or ``minutes`` (whichever ends first); ``transfer_share`` of it goes to stage 1
when both stages run. Every ``save_every`` steps (and at the end) ``out`` is rewritten whole (a temporary,
then a swap): an ordinary edgeattn checkpoint (merged weights, config, the teacher's tokenizer files) plus
``linearize_state.pt`` (the unmerged student, optimizer, step, elapsed time, RNG, loss history, options),
from which ``resume=True`` continues. Batches are a pure function of (seed, step), so a resumed run reads
the batches an uninterrupted one would have.

Corpus (``Corpus``): the running interpreter's standard library sources (``edgeattn.train.data.stdlib_files``,
code and docstrings), tokenized with the teacher's tokenizer; a file is held out when the first byte of the
SHA-1 of its path relative to the standard library root is below 13 (about 5% of files): the held-out
split is whole files, never windows of training files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from edgeattn._atomic import make_temp_dir, replace_dir
from edgeattn._deps import require
from edgeattn.artifact.tokenizer import TOKENIZER_FILES, TOKENIZER_JSON, load_hf_tokenizer
from edgeattn.models import EdgeConfig, EdgeLM
from edgeattn.train.data import stdlib_files

torch = require("torch")
nn = torch.nn
F = torch.nn.functional

STATE = "linearize_state.pt"
STATE_VERSION = 1
# --form -> the mixer of every linearized layer
FORMS = {
    "hedgehog": "hedgehog",
    "linear+window": "hedgehog_window",
    "gla": "gla",
    "gated_deltanet": "gated_deltanet",
}
STAGES = ("transfer", "distill", "both")
DEVICES = ("cpu", "cuda")
COPIED = ("q_proj", "k_proj", "v_proj", "o_proj")  # the teacher's projections each new mixer starts from
HELD_OUT_BELOW = 13  # a file is held out when sha1(relative path)[0] < this: 13/256, about 5% of files


@dataclass
class LinearizeConfig:
    form: str = "linear+window"  # a FORMS key
    window: int = 64  # linear+window: softmax over the last W tokens (LoLCATs: 64)
    feature_dim: int = 64  # hedgehog forms: F columns per map, 2F features per head
    keep_softmax: tuple[int, ...] = ()  # layers that stay full softmax (growing KV cache)
    stage: str = "both"  # "transfer", "distill" or "both"
    lora: int = 8  # stage 2 adapters' rank; 0: full fine-tuning
    steps: int | None = None  # total steps (both stages)
    minutes: float | None = None  # total time budget (both stages), across resumes
    transfer_share: float = 0.5  # share of the budget for stage 1 when both stages run
    seq_len: int = 256
    batch_size: int = 1
    lr_transfer: float = 1e-2  # LoLCATs' attention-transfer rate
    lr_distill: float = 1e-3  # adapters; full fine-tuning takes lr_distill / 10
    save_every: int = 25
    seed: int = 0
    device: str = "cpu"
    max_train_tokens: int = 4_000_000  # tokens of the training split read (files in a fixed random order)
    held_out_tokens: int = 65_536

    def __post_init__(self) -> None:
        self.keep_softmax = tuple(int(i) for i in self.keep_softmax)
        if self.form not in FORMS:
            raise ValueError(f"--form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if self.stage not in STAGES:
            raise ValueError(f"--stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.steps is None and self.minutes is None:
            raise ValueError("give --steps or --minutes (or both): the linearization budget")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.minutes is not None and not (self.minutes > 0 and math.isfinite(self.minutes)):
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        for name in ("window", "feature_dim", "seq_len", "batch_size", "save_every", "max_train_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lora < 0:
            raise ValueError(f"--lora must be >= 0 (0: full fine-tuning), got {self.lora}")
        if not 0.0 < self.transfer_share < 1.0:
            raise ValueError(f"--transfer-share must lie in (0, 1), got {self.transfer_share}")

    def fingerprint(self) -> dict:
        """The options a resumed run must share (the budget may grow)."""
        d = asdict(self)
        for k in ("steps", "minutes", "save_every", "device"):
            d.pop(k)
        d["keep_softmax"] = list(self.keep_softmax)
        return d


def parse_layers(text: str, n_layers: int | None = None) -> tuple[int, ...]:
    """``"0,8,16"`` -> (0, 8, 16); ValueError naming --keep-softmax for anything else."""
    if not text.strip():
        return ()
    try:
        layers = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ValueError(f"--keep-softmax must be layer numbers separated by commas, got {text!r}") from None
    if n_layers is not None:
        check_layers(layers, n_layers)
    return layers


def check_layers(layers, n_layers: int) -> None:
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"--keep-softmax {bad[0]}: the teacher has layers 0..{n_layers - 1}")


# ---- the student ----


def student_config(teacher_cfg: EdgeConfig, cfg: LinearizeConfig) -> EdgeConfig:
    """The teacher's config with every softmax layer not kept replaced by the form's mixer."""
    if teacher_cfg.qk_norm or teacher_cfg.attn_output_gate:
        raise ValueError("linearize: teachers with q/k norms or attention output gates are not supported yet")
    check_layers(cfg.keep_softmax, teacher_cfg.n_layers)
    mixers = teacher_cfg.mixers
    if any(m != "softmax" for m in mixers):
        raise ValueError(
            f"linearize: the teacher must be softmax attention in every layer, got {sorted(set(mixers))}"
        )
    new = FORMS[cfg.form]
    mixers = ["softmax" if i in cfg.keep_softmax else new for i in range(teacher_cfg.n_layers)]
    extra = dict(teacher_cfg.extra)
    extra["linearize"] = {"form": cfg.form, "keep_softmax": list(cfg.keep_softmax)}
    return replace(
        teacher_cfg, mixer=mixers, window=cfg.window, feature_dim=cfg.feature_dim, n_sinks=0, extra=extra
    )


def linearized_layers(cfg: EdgeConfig) -> list[int]:
    return [i for i, m in enumerate(cfg.mixers) if m != "softmax"]


def _copy_projection(dst, w, head_dim: int) -> None:
    """dst.weight <- w, the rows of grouped k/v heads repeated when dst has one head per query head."""
    w = w.detach()
    if w.shape != dst.weight.shape:
        if w.shape[1] != dst.weight.shape[1] or dst.weight.shape[0] % w.shape[0]:
            raise ValueError(
                f"cannot initialise a {tuple(dst.weight.shape)} projection from {tuple(w.shape)}"
            )
        rep = dst.weight.shape[0] // w.shape[0]
        w = w.view(-1, head_dim, w.shape[1]).repeat_interleave(rep, dim=0).reshape(dst.weight.shape)
    with torch.no_grad():
        dst.weight.copy_(w)


def build_student(teacher: EdgeLM, cfg: LinearizeConfig) -> EdgeLM:
    """The student: the teacher's weights, its linearized layers' q/k/v/o copied into the new mixers."""
    scfg = student_config(teacher.cfg, cfg)
    torch.manual_seed(cfg.seed)
    student = EdgeLM(scfg)
    sd = {k: v for k, v in teacher.state_dict().items() if ".mixer." not in k or _kept(k, cfg.keep_softmax)}
    missing, unexpected = student.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    for i in linearized_layers(scfg):
        t, s = teacher.blocks[i].mixer, student.blocks[i].mixer
        for name in COPIED:
            _copy_projection(getattr(s, name), getattr(t, name).weight, t.head_dim)
    return student


def _kept(key: str, keep) -> bool:
    return int(key.split(".")[1]) in keep


def trainable_transfer(student: EdgeLM, form: str) -> list:
    params = []
    for i in linearized_layers(student.cfg):
        for name, p in student.blocks[i].mixer.named_parameters():
            if form in ("gla", "gated_deltanet") or name.split(".")[0] not in COPIED:
                params.append(p)
    return params


# ---- low-rank adapters (merged into the weights when saved) ----


class LoRA(nn.Module):
    """A parametrization of a Linear's weight: W + B A * (alpha / r), B starting at zero (W unchanged)."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float | None = None):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features) / math.sqrt(in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = (alpha or 2 * rank) / rank

    def forward(self, W):
        return W + (self.B @ self.A).to(W.dtype) * self.scale


def add_lora(student: EdgeLM, rank: int) -> list:
    """Adapters on q/k/v/o of the linearized layers; returns their parameters."""
    from torch.nn.utils import parametrize

    params = []
    for i in linearized_layers(student.cfg):
        mixer = student.blocks[i].mixer
        for name in COPIED:
            lin = getattr(mixer, name)
            if parametrize.is_parametrized(lin, "weight"):
                continue
            lora = LoRA(lin.weight.shape[0], lin.weight.shape[1], rank).to(lin.weight.device)
            parametrize.register_parametrization(lin, "weight", lora)
            params += [lora.A, lora.B]
    return params


def merged_state_dict(model: EdgeLM) -> dict:
    """The state dict of ``model`` with every adapter merged into its weight (the plain EdgeLM's keys)."""
    from torch.nn.utils import parametrize

    sd = {k: v.detach() for k, v in model.state_dict().items() if ".parametrizations." not in k}
    for name, m in model.named_modules():
        if parametrize.is_parametrized(m, "weight"):
            sd[f"{name}.weight"] = m.weight.detach()
    return sd


# ---- the two losses ----


def attention_io(teacher: EdgeLM, ids, layers) -> tuple[dict, object]:
    """The teacher's logits on ``ids`` and, for each layer in ``layers``, (input of its attention, output of
    its attention) [B, T, D]: the transfer targets."""
    io, hooks = {}, []
    for i in layers:

        def hook(module, args, output, i=i):
            io[i] = (args[0].detach(), output[0].detach())

        hooks.append(teacher.blocks[i].mixer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits, _ = teacher(ids)
    finally:
        for h in hooks:
            h.remove()
    return io, logits


def transfer_loss(student: EdgeLM, io: dict):
    losses = []
    for i, (x, y) in io.items():
        got, _ = student.blocks[i].mixer(x)
        losses.append((got.float() - y.float()).pow(2).mean() / y.float().pow(2).mean().clamp_min(1e-12))
    return torch.stack(losses).mean()


def distill_loss(student: EdgeLM, ids, teacher_logits):
    logits, _ = student(ids)
    return F.kl_div(
        F.log_softmax(logits.float(), -1).flatten(0, 1),
        F.log_softmax(teacher_logits.float(), -1).flatten(0, 1),
        log_target=True,
        reduction="batchmean",
    )


# ---- corpus ----


@dataclass
class Corpus:
    """Token ids of the training and held-out splits (see the module docstring), with what they came from."""

    train: np.ndarray
    held_out: np.ndarray
    info: dict = field(default_factory=dict)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int):
        """[B, seq_len] int64: windows at starts drawn from default_rng([seed, step])."""
        n = len(self.train) - seq_len
        if n < 1:
            raise ValueError(
                f"the training split has {len(self.train)} tokens, fewer than --seq-len {seq_len}"
            )
        starts = np.random.default_rng([seed, step]).integers(0, n, size=batch_size)
        return torch.from_numpy(np.stack([self.train[s : s + seq_len] for s in starts]).astype(np.int64))

    def held_out_windows(self, seq_len: int, n: int | None = None):
        """Consecutive [1, seq_len] windows of the held-out split (the first ``n``)."""
        count = len(self.held_out) // seq_len
        count = count if n is None else min(count, n)
        return [
            torch.from_numpy(self.held_out[i * seq_len : (i + 1) * seq_len].astype(np.int64))[None]
            for i in range(count)
        ]


def split_of(relative: str) -> str:
    return "held_out" if hashlib.sha1(relative.encode()).digest()[0] < HELD_OUT_BELOW else "train"


def load_corpus(tokenizer_json: Path, max_train_tokens: int, held_out_tokens: int, seed: int = 0) -> Corpus:
    """The standard library's sources tokenized with ``tokenizer_json``: training files in a fixed random
    order until ``max_train_tokens``, held-out files in path order until ``held_out_tokens``."""
    tok = load_hf_tokenizer(tokenizer_json)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    splits: dict[str, list[Path]] = {"train": [], "held_out": []}
    for p in files:
        splits[split_of(p.relative_to(root).as_posix())].append(p)
    random.Random(seed).shuffle(splits["train"])
    out, info = {}, {"source": f"Python {sysconfig.get_python_version()} standard library *.py under {root}"}
    for name, limit in (("train", max_train_tokens), ("held_out", held_out_tokens)):
        ids, used, nbytes = [], 0, 0
        for p in splits[name]:
            text = p.read_text(encoding="utf-8", errors="replace")
            enc = tok.encode(text, add_special_tokens=False).ids
            ids.append(np.asarray(enc, dtype=np.int32))
            used += 1
            nbytes += len(text.encode())
            if sum(len(a) for a in ids) >= limit:
                break
        arr = np.concatenate(ids)[:limit] if ids else np.zeros(0, np.int32)
        out[name] = arr
        info[name] = {"files": used, "files_in_split": len(splits[name]), "bytes": nbytes, "tokens": len(arr)}
    info["held_out_rule"] = f"sha1(path relative to the stdlib root)[0] < {HELD_OUT_BELOW}"
    return Corpus(out["train"], out["held_out"], info)


@torch.no_grad()
def perplexity(model: EdgeLM, windows) -> float:
    """exp of the mean next-token cross-entropy over ``windows`` ([1, T] each, every position but the first)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for w in windows:
        w = w.to(device)
        logits, _ = model(w[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w.shape[1] - 1
    model.train(was)
    return math.exp(total / max(count, 1))


# ---- the run ----


@dataclass
class LinearizeResult:
    out: Path
    step: int
    elapsed: float
    history: list  # [step, stage, loss, elapsed seconds]


def _device(name: str):
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu)")
    return torch.device(name)


def _stage_bounds(cfg: LinearizeConfig) -> tuple[float, float]:
    """The share of the budget at which stage 2 starts (0: no stage 1; 1: no stage 2)."""
    return {"transfer": 1.0, "distill": 0.0, "both": cfg.transfer_share}[cfg.stage], 1.0


def load_teacher(path: str | os.PathLike):
    """(teacher EdgeLM in eval mode, its Source): anything ``edgeattn import`` or ``export`` reads."""
    from edgeattn.convert import load_source

    source = load_source(Path(path), "teacher")
    if not (Path(source.root) / TOKENIZER_JSON).is_file():
        raise ValueError(f"{path}: the teacher has no {TOKENIZER_JSON} (the corpus is encoded with it)")
    return source.model.eval(), source


def linearize(
    teacher_path: str | os.PathLike,
    out: str | os.PathLike,
    cfg: LinearizeConfig,
    *,
    resume: bool = False,
    force: bool = False,
    verbose: bool = True,
    callback: Callable[[int, str, float, EdgeLM, float], None] | None = None,
) -> LinearizeResult:
    from edgeattn.train.loop import _console, _progress

    out = Path(out)
    state = None
    if resume:
        if not (out / STATE).is_file():
            raise ValueError(f"--resume: {out} holds no {STATE} (no earlier linearize run saved there)")
        try:
            state = torch.load(out / STATE, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"--resume: {out / STATE} is unreadable: {str(e).splitlines()[0]}") from None
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"--resume: {out / STATE} is not a version {STATE_VERSION} linearize state")
        if state["options"] != cfg.fingerprint():
            diff = [k for k in cfg.fingerprint() if state["options"].get(k) != cfg.fingerprint()[k]]
            raise ValueError(f"--resume: {out} was linearized with other options: {', '.join(diff)}")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ValueError(f"--out {out} is not empty; pass --resume to continue it or --force to replace it")
    device = _device(cfg.device)
    teacher, source = load_teacher(teacher_path)
    check_layers(cfg.keep_softmax, teacher.cfg.n_layers)
    corpus = load_corpus(
        Path(source.root) / TOKENIZER_JSON, cfg.max_train_tokens, cfg.held_out_tokens, cfg.seed
    )
    student = build_student(teacher, cfg)
    teacher.to(device).requires_grad_(False)
    student.to(device)
    layers = linearized_layers(student.cfg)
    split, _ = _stage_bounds(cfg)
    distill_lr = cfg.lr_distill if cfg.lora else cfg.lr_distill / 10

    def setup(stage: str):
        student.requires_grad_(False)
        if stage == "transfer":
            params = trainable_transfer(student, cfg.form)
            lr = cfg.lr_transfer
        elif cfg.lora:
            params = add_lora(student, cfg.lora)
            student.to(device)
            lr = distill_lr
        else:
            params = list(student.parameters())
            lr = distill_lr
        for p in params:
            p.requires_grad_(True)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    step, elapsed, history = 0, 0.0, []
    stage = "transfer" if split > 0 else "distill"
    if state is not None:
        step, elapsed, history, stage = state["step"], state["elapsed"], state["history"], state["stage"]
        opt = setup(stage)
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
    else:
        opt = setup(stage)

    def progress(step: int, elapsed: float) -> float:
        p = 0.0
        if cfg.steps is not None:
            p = max(p, step / cfg.steps)
        if cfg.minutes is not None:
            p = max(p, elapsed / (60 * cfg.minutes))
        return p

    def save() -> None:
        tmp = make_temp_dir(out)
        try:
            plain, _, _ = EdgeLM.from_state_dict(
                student.cfg, {k: v.cpu().clone() for k, v in merged_state_dict(student).items()}
            )
            plain.save_files(tmp)
            for name in TOKENIZER_FILES:
                if (Path(source.root) / name).is_file():
                    shutil.copy2(Path(source.root) / name, tmp / name)
            torch.save(
                {
                    "version": STATE_VERSION,
                    "step": step,
                    "elapsed": elapsed,
                    "stage": stage,
                    "history": history,
                    "options": cfg.fingerprint(),
                    "model": {k: v.cpu() for k, v in student.state_dict().items()},
                    "optimizer": opt.state_dict(),
                    "rng": torch.get_rng_state(),
                },
                tmp / STATE,
            )
            (tmp / "linearize.json").write_text(
                json.dumps(
                    {
                        "teacher": str(teacher_path),
                        "step": step,
                        "elapsed_s": round(elapsed, 1),
                        "options": cfg.fingerprint(),
                        "corpus": corpus.info,
                        "history": history[-200:],
                    },
                    indent=2,
                )
            )
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    console = _console(verbose)
    if state is not None:
        console.print(f"resumed {out} at step {step} ({stage})")
    t0 = time.monotonic() - elapsed
    student.train()
    with _progress(console) as bar:
        task = bar.add_task(stage, total=1000, loss="-", tps="-")
        bar.update(task, completed=int(1000 * min(progress(step, elapsed), 1.0)))
        while progress(step, elapsed) < 1.0:
            if stage == "transfer" and progress(step, elapsed) >= split:
                stage = "distill"
                opt = setup(stage)
            ids = corpus.batch(cfg.seed, step, cfg.batch_size, cfg.seq_len).to(device)
            tic = time.monotonic()
            io, logits = attention_io(teacher, ids, layers if stage == "transfer" else [])
            loss = transfer_loss(student, io) if stage == "transfer" else distill_loss(student, ids, logits)
            if not torch.isfinite(loss):
                raise ValueError(f"the loss became {loss.item()} at step {step}: lower the learning rate")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            step += 1
            elapsed = time.monotonic() - t0
            history.append([step, stage, round(loss.item(), 6), round(elapsed, 2)])
            tps = ids.numel() / max(time.monotonic() - tic, 1e-9)
            bar.update(
                task,
                description=stage,
                completed=int(1000 * min(progress(step, elapsed), 1.0)),
                loss=f"{loss.item():.4f}",
                tps=f"{tps:.0f}",
            )
            if callback is not None:  # its time (an evaluation) is not training time
                tic = time.monotonic()
                callback(step, stage, loss.item(), student, elapsed)
                t0 += time.monotonic() - tic
            if step % cfg.save_every == 0:
                save()
    save()
    return LinearizeResult(out, step, elapsed, history)
