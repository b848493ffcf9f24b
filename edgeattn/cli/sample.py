"""`edgeattn sample CKPT`: generate text with the PyTorch model and its recurrent state."""

from __future__ import annotations

import codecs
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
        str, typer.Option(help="Text to continue (UTF-8 bytes are the tokens).", show_default="a newline")
    ] = "\n",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", min=0, help="Bytes to generate.")
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
    """Continue PROMPT: prefill it in one call, then one byte at a time with the recurrent state."""
    from edgeattn.models import EdgeLM
    from edgeattn.train.distributed import resolve_device
    from edgeattn.train.sampling import generate, sample_next

    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint {checkpoint} does not exist")
    if not prompt:
        raise ValueError("--prompt must not be empty (a byte model needs one byte to start from)")
    # Check the sampling options before loading anything.
    import torch

    sample_next(torch.zeros(1, 2), temperature=temperature, top_k=top_k, top_p=top_p)
    model = EdgeLM.load(checkpoint).to(resolve_device(device))
    tokens = generate(
        model,
        list(prompt.encode("utf-8")),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    first = next(tokens, None)  # checks the lengths and prefills the prompt before anything is printed
    # Print characters as soon as their bytes are complete; invalid sequences print as U+FFFD.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(prompt)
    try:
        for token in itertools.chain([] if first is None else [first], tokens):
            text = decoder.decode(bytes([token]))
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
        sys.stdout.write(decoder.decode(b"", final=True))
    finally:  # the text ends its line, so that an error starts its own
        sys.stdout.write("\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("sample", cls=Command)(sample)
