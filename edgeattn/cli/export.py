"""`edgeattn export CKPT --out DIR`: a checkpoint to an artifact directory (step + prefill ONNX graphs)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from edgeattn.artifact.manifest import INT8_WEIGHTS, KV_DTYPES, PRECISIONS, TARGETS
from edgeattn.cli._common import Command, Force, check_output_dir, cli_errors, writing


def _choices(name: str, values) -> type[Enum]:
    """A Typer choice type of ``values`` (the artifact format's own constants, not spelled again here)."""
    return Enum(name, {v: v for v in values}, type=str)


Target = _choices("Target", TARGETS)
Precision = _choices("Precision", PRECISIONS)
PrefillLogits = _choices("PrefillLogits", ("all", "last"))
KvDtype = _choices("KvDtype", KV_DTYPES)
Int8Weights = _choices("Int8Weights", INT8_WEIGHTS)


@cli_errors
def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="Checkpoint directory written by `edgeattn train` or `edgeattn import`, or a Hugging Face "
            "model directory (config.json with a model_type) or a GGUF file, imported on the way."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact directory to write.")],
    target: Annotated[
        Target, typer.Option(help="onnxruntime: fused contrib op; portable: standard ops for TensorRT.")
    ] = Target.onnxruntime,
    precision: Annotated[
        Precision,
        typer.Option(
            help="Weights and activations; the state stays float32. int4: weights only (MatMulNBits)."
        ),
    ] = Precision.fp32,
    int4_block_size: Annotated[
        int | None,
        typer.Option(
            help="int4: weights per quantization block, a power of two >= 16 (default 128; 32 keeps more accuracy)."
        ),
    ] = None,
    int4_asymmetric: Annotated[
        bool, typer.Option("--int4-asymmetric", help="int4: a zero point per block (default: symmetric).")
    ] = False,
    int4_offsets: Annotated[
        bool | None,
        typer.Option(
            "--int4-offsets/--no-int4-offsets",
            help="int4: a step and a minimum per block, as llama.cpp's Q4_1 (default: on for a GGUF file, "
            "whose 4-bit weights it keeps; off elsewhere, 1.5x slower decode).",
        ),
    ] = None,
    int4_accuracy_level: Annotated[
        int | None,
        typer.Option(
            help="int4: MatMulNBits' accuracy_level. 4 (the default): activations rounded to int8 per block, "
            "the fastest decode; 0 or 1: float32 activations, on some CPUs a faster prefill (SmolLM2 int4 on "
            "an Intel Xeon with AVX-512: 1.38x prefill, 1.32x slower decode; benchmarks/RESULTS.md).",
        ),
    ] = None,
    int8_weights: Annotated[
        Int8Weights | None,
        typer.Option(
            help="int8: blocks (the default on target onnxruntime) is weight-only, 8-bit MatMulNBits in blocks "
            "of 32, one graph like int4's, within 0.9% of fp32's perplexity on SmolLM2; u8 (the default on "
            "portable) and s8 quantize activations per call (ONNX Runtime's dynamic quantization, two graphs): "
            "u8 gives the same logits on every CPU, s8 is faster with VNNI or AMX and saturates on AVX2 CPUs "
            "without VNNI (`edgeattn check` says so there)."
        ),
    ] = None,
    no_checkpoint: Annotated[
        bool,
        typer.Option(
            "--no-checkpoint", help="Leave the torch checkpoint out (the torch backend and `check` need it)."
        ),
    ] = False,
    batch: Annotated[int, typer.Option(min=1, help="Static batch size of the graphs.")] = 1,
    dynamic_batch: Annotated[
        bool,
        typer.Option(
            "--dynamic-batch",
            help="Graphs take any batch (symbolic leading dimension 'batch'); needed by the streams API.",
        ),
    ] = False,
    prefill_chunk: Annotated[int, typer.Option(min=2, help="Tokens per call of prefill.onnx.")] = 64,
    max_length: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens a stream may hold (prompt + generated) where the model has a limit: the length of "
            "the softmax layers' preallocated KV buffers (onnxruntime target) and the manifest's max_length; "
            "with --genai also genai_config's context length. Default: the model's max_seq_len. Models whose "
            "every layer keeps a fixed-size state have no limit: there it only sets --genai's length.",
        ),
    ] = None,
    kv_dtype: Annotated[
        KvDtype,
        typer.Option(
            help="Element type of the softmax layers' preallocated KV buffers (onnxruntime target): float16 "
            "halves their memory (on CPU its attention ran slower than float32's); int8 quarters it and its "
            "CPU attention ran 2.7x faster at 16384 tokens (scales per KV head and channel, calibrated from "
            "the model's keys and values; the export fails if its logits leave the stated bound).",
        ),
    ] = KvDtype.float32,
    prefill_logits: Annotated[
        PrefillLogits | None,
        typer.Option(
            help="last: a graph call returns its last token's logits only (a prefill skips the head for the "
            "rest; one-graph artifacts). all: every token's (speculative decoding needs it). Default: last "
            "where the artifact is one graph (target onnxruntime, fp32 or int4, fused or KV-buffer layers), "
            "all elsewhere (the manifest's prefill_logits says last where it is).",
            show_default=False,
        ),
    ] = None,
    verify_states: Annotated[
        bool,
        typer.Option(
            "--verify-states",
            help="The one graph also returns each fixed-size state after every token of a call: speculative "
            "decoding keeps the state after its last kept draft instead of re-advancing (gated recurrences, "
            "Hedgehog forms, KV-buffer softmax layers). ONNX Runtime computes them in every call, so plain "
            "decoding slows too; re-advancing was faster on the CPU (benchmarks/RESULTS.md).",
        ),
    ] = False,
    force: Force = False,
    genai: Annotated[
        bool,
        typer.Option(
            "--genai",
            help="Also write model.onnx and genai_config.json for onnxruntime-genai (recurrent mixers, fp32).",
        ),
    ] = False,
    cpp_example: Annotated[
        bool, typer.Option("--cpp-example", help="Print the commands that build the C++ example against OUT.")
    ] = False,
) -> None:
    """Export a checkpoint as ONNX step and prefill graphs with explicit state, plus edgeattn.json."""
    from edgeattn.export.exporter import export_model

    check_output_dir(out, "--out")
    options = dict(
        target=target.value,
        precision=precision.value,
        batch_size=batch,
        dynamic_batch=dynamic_batch,
        prefill_chunk=prefill_chunk,
        force=force,
        include_checkpoint=not no_checkpoint,
        # only the options given: the plan refuses those of another precision (ExportPlan.check)
        quantization={
            k: v
            for k, v in {
                "symmetric": False if int4_asymmetric else None,
                "block_size": int4_block_size,
                "offsets": int4_offsets,
                "accuracy_level": int4_accuracy_level,
                "weights": int8_weights.value if int8_weights is not None else None,
            }.items()
            if v is not None
        }
        or None,
        genai=genai,
        max_length=max_length,
        kv_dtype=kv_dtype.value,
        prefill_logits=prefill_logits.value if prefill_logits is not None else None,
        verify_states=verify_states,
    )
    with writing(out, "--out"):
        path = export_model(checkpoint, out, **options, on_plan=_print_notes)
    size = sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".onnx", ".bin"))
    typer.echo(
        f"exported {checkpoint} -> {path} ({target.value}, {precision.value}, {size / 2**20:.1f} MiB of graphs)"
    )
    if cpp_example:
        import shlex

        import edgeattn

        repo = shlex.quote(str(Path(edgeattn.__file__).resolve().parent.parent))
        typer.echo("build and run the C++ example (from the edgeattn source checkout):")
        typer.echo(
            f"  cd {repo} && bash scripts/fetch_onnxruntime_headers.sh && "
            "cmake -S edgeattn/runtimes/cpp -B build/cpp && cmake --build build/cpp -j2"
        )
        typer.echo(
            f"  build/cpp/generate {shlex.quote(str(path.resolve()))} --prompt 'def ' -n 200 --threads 1"
        )


LARGE_KV_BUFFERS = 2**30  # bytes of preallocated KV buffers above which export prints a note


def _print_notes(plan) -> None:
    """The plan's notes, and without --max-length the size of large preallocated KV buffers (before the
    export's long part runs)."""
    for note in plan.notes():
        typer.echo(f"note: {note}")
    size = plan.kv_buffer_bytes
    if plan.max_length is None and size > LARGE_KV_BUFFERS:
        typer.echo(
            f"note: the softmax layers' preallocated KV buffers will take {size / 2**30:.1f} GiB ({plan.length} "
            "tokens, the model's max_seq_len); --max-length N reduces them to the N tokens a stream needs"
        )


def register(app: typer.Typer) -> None:
    app.command("export", cls=Command)(export)
