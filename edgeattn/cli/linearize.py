"""`edgeattn linearize TEACHER --out CKPT`: a pretrained softmax transformer into a fixed-state checkpoint."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import Command, Force, Quiet, check_output_dir, cli_errors


class Form(str, Enum):
    hedgehog = "hedgehog"
    linear_window = "linear+window"
    gla = "gla"
    gated_deltanet = "gated_deltanet"


class Stage(str, Enum):
    transfer = "transfer"
    distill = "distill"
    both = "both"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


@cli_errors
def linearize(
    teacher: Annotated[
        Path,
        typer.Argument(
            help="The transformer: a GGUF file, a Hugging Face directory or an edgeattn checkpoint."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Checkpoint directory to write (and resume).")],
    form: Annotated[
        Form, typer.Option(help="Fixed-state form of the linearized layers.")
    ] = Form.linear_window,
    window: Annotated[int, typer.Option(help="linear+window: softmax over the last W tokens.")] = 64,
    feature_dim: Annotated[int, typer.Option(help="Hedgehog forms: feature map width F (2F features).")] = 64,
    keep_softmax: Annotated[
        str, typer.Option(help="Layers kept as full softmax, e.g. 0,8,16 (their KV cache grows).")
    ] = "",
    stage: Annotated[
        Stage, typer.Option(help="Attention transfer, distillation, or both in turn.")
    ] = Stage.both,
    lora: Annotated[
        int, typer.Option(help="Rank of the distillation's low-rank adapters; 0: full fine-tuning.")
    ] = 8,
    steps: Annotated[int | None, typer.Option(help="Total steps (both stages).")] = None,
    minutes: Annotated[float | None, typer.Option(help="Total time budget in minutes (both stages).")] = None,
    transfer_share: Annotated[float, typer.Option(help="Share of the budget for attention transfer.")] = 0.5,
    seq_len: Annotated[int, typer.Option(help="Tokens per training window.")] = 256,
    batch_size: Annotated[int, typer.Option(help="Windows per step.")] = 1,
    max_train_tokens: Annotated[
        int, typer.Option(help="Tokens of the corpus's training split read (standard-library files).")
    ] = 4_000_000,
    save_every: Annotated[int, typer.Option(help="Steps between saves of --out.")] = 25,
    seed: Annotated[int, typer.Option(help="Seed of the batches and of the new weights.")] = 0,
    device: Annotated[Device, typer.Option(help="Where to train.")] = Device.cpu,
    threads: Annotated[int, typer.Option(help="CPU threads of torch (0: torch's default).")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run saved in --out.")] = False,
    force: Force = False,
    quiet: Quiet = False,
) -> None:
    """Replace each softmax attention of TEACHER by a fixed-state form, trained to reproduce the teacher's
    attention outputs, then distilled against its logits; the result is an ordinary checkpoint."""
    from edgeattn.train.linearize import LinearizeConfig, parse_layers

    check_output_dir(out, "--out")
    if not teacher.exists():
        raise ValueError(f"teacher {teacher} does not exist")
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    cfg = LinearizeConfig(
        form=form.value,
        window=window,
        feature_dim=feature_dim,
        keep_softmax=parse_layers(keep_softmax),
        stage=stage.value,
        lora=lora,
        steps=steps,
        minutes=minutes,
        transfer_share=transfer_share,
        seq_len=seq_len,
        batch_size=batch_size,
        save_every=save_every,
        max_train_tokens=max_train_tokens,
        seed=seed,
        device=device.value,
    )
    from edgeattn.train.linearize import linearize as run

    if threads:
        import torch

        torch.set_num_threads(threads)
    result = run(teacher, out, cfg, resume=resume, force=force, verbose=not quiet)
    last = result.history[-1] if result.history else None
    loss = f", last loss {last[2]:.4f} ({last[1]})" if last else ""
    typer.echo(f"linearized {teacher} -> {out}: {result.step} steps in {result.elapsed / 60:.1f} min{loss}")


def register(app: typer.Typer) -> None:
    app.command("linearize", cls=Command)(linearize)
