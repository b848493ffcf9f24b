"""`edgeattn sample CKPT`: generate text with the PyTorch model and its recurrent state."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import TEMPERATURE, TOP_P, Command, cli_errors


@cli_errors
def sample(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory written by `edgeattn train`.")],
    prompt: Annotated[
        str,
        typer.Option(
            help="Text to continue (encoded by the checkpoint's tokenizer.json, else its UTF-8 bytes are the tokens).",
            show_default="a newline",
        ),
    ] = "\n",
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens", "-n", min=0, help="Tokens to generate (fewer when EOS comes first)."
        ),
    ] = 200,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="Softmax temperature; 0 is greedy.")
    ] = TEMPERATURE,
    top_k: Annotated[int, typer.Option(min=0, help="Keep the k most likely bytes (0: all).")] = 0,
    top_p: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, help="Keep the most likely bytes up to this probability mass (1: all)."
        ),
    ] = TOP_P,
    seed: Annotated[int, typer.Option(help="Seed of the sampler.")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "cpu",
) -> None:
    """Continue PROMPT: prefill it in one call, then one token at a time with the recurrent state.

    An imported checkpoint encodes and decodes through its tokenizer.json and stops at its EOS; edgeattn's
    own models are byte-level."""
    from edgeattn.artifact.tokenizer import checkpoint_tokenizer
    from edgeattn.models import EdgeLM
    from edgeattn.train.distributed import resolve_device
    from edgeattn.train.sampling import generate, sample_next

    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint {checkpoint} does not exist")
    if not prompt:
        raise ValueError("--prompt must not be empty (the model needs one token to start from)")
    # Check the sampling options before loading anything.
    import torch

    sample_next(torch.zeros(1, 2), temperature=temperature, top_k=top_k, top_p=top_p)
    model = EdgeLM.load(checkpoint)
    tok = checkpoint_tokenizer(checkpoint, model.cfg)
    prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        raise ValueError(f"--prompt {prompt!r} encodes to no tokens")
    model = model.to(resolve_device(device))
    tokens = generate(
        model,
        prompt_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_ids=tok.eos_token_ids,
    )
    first = next(tokens, None)  # checks the lengths and prefills the prompt before anything is printed
    ids = itertools.chain([] if first is None else [first], tokens)
    # Print characters as soon as they are complete; invalid byte sequences print as U+FFFD.
    sys.stdout.write(prompt)
    try:
        for text in tok.stream(ids):
            sys.stdout.write(text)
            sys.stdout.flush()
    finally:  # the text ends its line, so that an error starts its own
        sys.stdout.write("\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("sample", cls=Command)(sample)
