"""`edgeattn train`: train a byte-level EdgeLM (on the Python standard library unless --data is given), or
fine-tune an imported one (`--resume` a checkpoint of `edgeattn import`: its tokenizer encodes the data).

Under `torchrun --nproc-per-node N` the same command trains data-parallel (see edgeattn.train.distributed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import Command, cli_errors

# The small default model, sized for a 10-minute run on 2 CPU cores (benchmarks/train_quality.py): on
# so small a budget (~2M bytes) width 128 learns as much per step as 256 at twice the steps per second.
# chunk_size 8: GLA's per-key-dimension gate makes its chunk form cost O(T * C * K) in [C, C, K] decay
# tensors, so small chunks train it 1.5-2x faster on CPU than the EdgeConfig default of 64.
# Other fields: EdgeConfig's.
DEFAULT_MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "mixer": "gla", "chunk_size": 8}

_MODEL = "Model (with --resume: the checkpoint's; if given, they must match it)"
_TRAIN = "Training (with --resume: the checkpoint's run's, unless given)"


def model_config(config: Path | None, overrides: dict, resumed=None):
    """The EdgeConfig asked for: defaults (or ``resumed``, the config of the checkpoint given to --resume)
    < --config JSON < flags. When resuming with neither a --config nor a model flag, None (the
    checkpoint's own config is used)."""
    from edgeattn.models import EdgeConfig

    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(overrides.get("mixer"), str) and "," in overrides["mixer"]:
        names = [n.strip() for n in overrides["mixer"].split(",")]
        overrides["mixer"] = names
        if "n_layers" in overrides and overrides["n_layers"] != len(names):
            raise ValueError(
                f"--mixer names {len(names)} layers but --n-layers is {overrides['n_layers']}: "
                "give one mixer per layer, or leave --n-layers out"
            )
        if "n_layers" not in overrides and int(os.environ.get("RANK", "0")) == 0:
            typer.echo(
                f"note: --mixer names {len(names)} layers, so the model has {len(names)} layers", err=True
            )
        overrides["n_layers"] = len(names)
    from_file = {}
    if config is not None:
        if not config.is_file():
            raise ValueError(f"--config {config} does not exist")
        try:
            from_file = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--config {config} is not valid JSON: {e}") from None
        if not isinstance(from_file, dict):
            raise ValueError(f"--config {config} must hold a JSON object of EdgeConfig fields")
    if resumed is not None:
        if not from_file and not overrides:
            return None
        base = resumed.to_dict()
    else:
        base = dict(DEFAULT_MODEL)
    try:
        return EdgeConfig.from_dict({**base, **from_file, **overrides})
    except TypeError as e:
        raise ValueError(f"bad model config: {e}") from None


def _model(help: str, default: str | None = None):
    return typer.Option(help=help, show_default=default or False, rich_help_panel=_MODEL)


def _train(help: str, default: str | None = None):
    return typer.Option(help=help, show_default=default or False, rich_help_panel=_TRAIN)


@cli_errors
def train(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Checkpoint directory to write.")] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue this checkpoint's run: its options unless given again; --out defaults to it. "
            "A checkpoint without a trainer state (edgeattn import's) is fine-tuned from step 0, the data "
            "encoded with its tokenizer.json."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a checkpoint already in --out.")] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", hidden=True, help="The old name of --force.")
    ] = False,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.", show_default="auto")] = None,
    fsdp: Annotated[
        bool, typer.Option("--fsdp", help="Shard with FSDP2 instead of DDP (under torchrun).")
    ] = False,
    mixer: Annotated[
        str | None, _model("A name of edgeattn.MIXERS, or one per layer, comma-separated.", "gla")
    ] = None,
    d_model: Annotated[int | None, _model("Model width.", "128")] = None,
    n_layers: Annotated[int | None, _model("Layers.", "4")] = None,
    n_heads: Annotated[int | None, _model("Heads.", "4")] = None,
    chunk_size: Annotated[int | None, _model("Chunk of the chunkwise training form.", "8")] = None,
    max_seq_len: Annotated[
        int | None,
        _model("Longest context of a softmax model (its KV cache; the export's max_length).", "2048"),
    ] = None,
    config: Annotated[Path | None, _model("JSON file of EdgeConfig fields (flags win).")] = None,
    data: Annotated[
        Path | None, _train("Text file or directory of text files.", "the Python stdlib's source")
    ] = None,
    steps: Annotated[int | None, _train("Optimizer steps.", "2000 without --time-budget")] = None,
    time_budget: Annotated[
        float | None, _train("Seconds to train for; the schedule follows the clock.")
    ] = None,
    seq_len: Annotated[int | None, _train("Bytes per sequence.", "256")] = None,
    batch_size: Annotated[int | None, _train("Sequences per step (per process under torchrun).", "8")] = None,
    lr: Annotated[float | None, _train("Peak learning rate (AdamW, warm-up, cosine decay).", "5e-3")] = None,
    warmup_steps: Annotated[int | None, _train("Linear warm-up steps.", "30")] = None,
    weight_decay: Annotated[float | None, _train("AdamW weight decay of matrices.", "0.1")] = None,
    grad_clip: Annotated[float | None, _train("Max gradient norm (0: off).", "1.0")] = None,
    eval_every: Annotated[int | None, _train("Steps between validations.", "100")] = None,
    eval_windows: Annotated[int | None, _train("Validation windows per evaluation.", "64")] = None,
    save_every: Annotated[
        int | None, _train("Steps between checkpoints (and one at the end).", "500")
    ] = None,
    seed: Annotated[int | None, _train("Seed of the weights and the data order.", "0")] = None,
) -> None:
    """Train a byte-level language model (or fine-tune an imported one): validation loss at intervals,
    checkpoints in --out."""
    from edgeattn.train.loop import TrainConfig, read_trainer_state
    from edgeattn.train.loop import train as run_training

    given = {
        "steps": steps,
        "time_budget": time_budget,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "lr": lr,
        "warmup_steps": warmup_steps,
        "weight_decay": weight_decay,
        "grad_clip": grad_clip,
        "eval_every": eval_every,
        "eval_windows": eval_windows,
        "save_every": save_every,
        "seed": seed,
        "data": None if data is None else str(data),
        "device": device,
        "fsdp": fsdp or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    # A resumed run keeps its own options (data, schedule, seed...) unless they are given again.
    # Read once here (the loop reads it again for the optimizer and RNG state).
    resumed_cfg, resumed_state = read_trainer_state(resume) if resume is not None else (None, {})
    saved = resumed_state.get("train_config", {})
    drop = {"device", "fsdp"} | ({"steps", "time_budget"} if {"steps", "time_budget"} & set(given) else set())
    saved = {k: v for k, v in saved.items() if k not in drop}
    cfg = TrainConfig(**{**saved, **given})
    overrides = {
        "mixer": mixer,
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "chunk_size": chunk_size,
        "max_seq_len": max_seq_len,
    }
    model_cfg = model_config(config, overrides, resumed_cfg)
    r = run_training(model_cfg, cfg, out=out, resume=resume, overwrite=force or overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(
            f"done: step {r.step}, {r.tokens:,} tokens in {r.elapsed:.0f} s "
            f"({r.tokens_per_s:,.0f} tok/s this run), "
            f"val loss {r.val_loss:.4f}, val bpb {r.val_bpb:.4f}"
            + (f", checkpoint {r.out}" if r.out is not None else ", no checkpoint (no --out)")
        )


def register(app: typer.Typer) -> None:
    app.command("train", cls=Command)(train)
