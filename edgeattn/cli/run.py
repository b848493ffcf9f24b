"""`edgeattn run DIR --prompt TEXT`: stream generated text from an artifact (base install: no torch needed)."""

from __future__ import annotations

import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import TEMPERATURE, TOP_P, Command, check_output_file, cli_errors


class Backend(str, Enum):
    onnxruntime = "onnxruntime"
    torch = "torch"
    tensorrt = "tensorrt"


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@cli_errors
def run(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory written by `edgeattn export`.")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "def ",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", min=0, help="Tokens to generate.")
    ] = 200,
    backend: Annotated[
        Backend, typer.Option(help="Runtime: onnxruntime, torch (needs the train extra) or tensorrt.")
    ] = Backend.onnxruntime,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="Softmax temperature; 0 is greedy.")
    ] = TEMPERATURE,
    top_k: Annotated[int, typer.Option(min=0, help="Keep the k most likely tokens (0: all).")] = 0,
    top_p: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, help="Keep the most likely tokens up to this probability mass (1: all)."
        ),
    ] = TOP_P,
    repetition_penalty: Annotated[
        float,
        typer.Option(
            help="Divide the positive logits (multiply the negative ones) of tokens already in the text by this "
            "(transformers' repetition_penalty; 1: none).",
        ),
    ] = 1.0,
    repetition_window: Annotated[
        int,
        typer.Option(min=0, help="The repetition penalty looks at the last N tokens (0: all of them)."),
    ] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampler (default: random).")] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Intra-op threads (default: the runtime's).")
    ] = None,
    state_in: Annotated[Path | None, typer.Option(help="Resume from a state file (same model).")] = None,
    state_out: Annotated[Path | None, typer.Option(help="Save the state here after generating.")] = None,
    chat: Annotated[
        bool,
        typer.Option("--chat", help="Format the prompt as a user message with the model's chat template."),
    ] = False,
    speculative: Annotated[
        str | None,
        typer.Option(
            help="Speculative decoding: 'ngram' (drafts looked up in the text so far) or a draft artifact's "
            "directory (the same tokenizer); the same text from fewer graph calls.",
        ),
    ] = None,
) -> None:
    """Generate text token by token, keeping the fixed-size state inside the runtime; stops at the
    model's end-of-sequence token.

    The text goes to stdout; the closing line of figures (tokens/s, peak memory) to stderr."""
    from edgeattn.runtimes import open_session

    # Everything a user can get wrong is refused before the model is loaded.
    if state_in is not None and not state_in.is_file():
        raise ValueError(f"state file {state_in} does not exist")
    if state_out is not None:
        check_output_file(state_out, "--state-out")
    if speculative is not None and speculative != "ngram" and not Path(speculative).is_dir():
        raise ValueError(
            f"--speculative must be 'ngram' or a draft artifact's directory, got {speculative!r}"
        )
    sess = open_session(artifact, backend=backend.value, threads=threads)
    if state_in is not None:
        sess.load_state(state_in)
    if chat:
        prompt = sess.tokenizer.apply_chat_template(prompt)
    n_prompt, pos0 = len(sess.tokenizer.encode(prompt)), sess.position
    start = time.perf_counter()
    pieces = sess.generate_text(
        prompt,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        repetition_window=repetition_window,
        speculative=speculative,
    )
    # The first piece checks and prefills the prompt (and the length), so a bad prompt prints nothing but
    # its error; then the prompt is echoed so the continuation reads as text, as with `edgeattn sample`.
    sys.stdout.write(prompt + next(pieces, ""))
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:  # the text ends its line, so that an error or the figures start their own
        sys.stdout.write("\n")
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    if state_out is not None:
        sess.save_state(state_out)
    n = max(sess.position - pos0 - n_prompt, 0)  # generated tokens (and the end-of-sequence token)
    spec = ""
    if speculative is not None:
        st = sess.speculative_stats
        spec = f", speculative {speculative}: {st.mean_accepted:.2f} tokens per call, {st.acceptance:.0%} of drafts kept"
    typer.echo(
        f"[{backend.value}] {n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tokens/s), "
        f"prompt {n_prompt} tokens, peak RSS {peak_rss_bytes() / 2**20:.1f} MiB{spec}",
        err=True,
    )


def register(app: typer.Typer) -> None:
    app.command("run", cls=Command)(run)
