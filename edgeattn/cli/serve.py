"""`edgeattn serve ARTIFACT`: an OpenAI-compatible HTTP server over one artifact (the `serve` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import CLIError, Command, check_output_dir, cli_errors

DEFAULT_DISK_MB = 4096  # edgeattn.serve.cache.DEFAULT_DISK_MB (not imported: numpy is not loaded for --help)


def _listen(host: str, port: int):
    """A bound, listening socket: a port in use is a one-line error before the model loads."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


@cli_errors
def serve(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory written by `edgeattn export`.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free port).")] = 8000,
    slots: Annotated[
        int, typer.Option(min=1, help="Streams decoded together in one batch (state memory = slots x state).")
    ] = 4,
    max_queue: Annotated[
        int, typer.Option(min=0, help="Requests that may wait for a slot; beyond them HTTP 429.")
    ] = 16,
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Longest prompt (default: the artifact's max_length, or 65536 for a fixed-size state).",
        ),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Intra-op threads (default: the runtime's).")
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="The model id clients send (default: the artifact directory's name).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="Require 'Authorization: Bearer KEY' (GET /health and / excepted).")
    ] = None,
    state_cache_mb: Annotated[
        float, typer.Option(min=0.0, help="Memory for the prefix-state cache, MiB (0: none in memory).")
    ] = 256.0,
    state_cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Also keep the prefix-state cache here as state files (kept across restarts), in a "
            "subdirectory per model: servers of several models may share it."
        ),
    ] = None,
    state_cache_disk_mb: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Disk for --state-cache-dir (this model's files), MiB: the least recently used are deleted "
            "beyond it (0: none on disk; the --ray replicas share it).",
        ),
    ] = float(DEFAULT_DISK_MB),
    ray: Annotated[
        bool, typer.Option("--ray", help="Run as a Ray Serve deployment (the `ray` extra).")
    ] = False,
    replicas: Annotated[int, typer.Option(min=1, help="Engine replicas with --ray.")] = 1,
) -> None:
    """Serve an artifact through the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics) and a chat page at /.

    Requests are decoded together (continuous batching: one step-graph call for every live stream) on an
    artifact exported with --dynamic-batch; any other artifact is served one request at a time. The state
    after every prompt and reply is cached, so a conversation's next turn prefills only its new tokens."""
    from edgeattn.artifact.manifest import Manifest

    if replicas > 1 and not ray:
        raise CLIError("--replicas needs --ray")
    if state_cache_dir is not None:
        check_output_dir(state_cache_dir, "--state-cache-dir")
    Manifest.load(artifact)  # a bad artifact is one line before anything starts
    name = model_name or Path(artifact).resolve().name
    options = dict(
        slots=slots,
        max_queue=max_queue,
        max_prompt_tokens=max_prompt_tokens,
        threads=threads,
        cache_mb=state_cache_mb,
        cache_dir=state_cache_dir,
        cache_disk_mb=state_cache_disk_mb,
    )
    if ray:
        from edgeattn.serve.ray import run_ray

        run_ray(artifact, name, api_key, replicas=replicas, host=host, port=port, **options)
        return
    from edgeattn.serve.server import run_server

    run_server(artifact, name, api_key, sock=_listen(host, port), **options)


def register(app: typer.Typer) -> None:
    app.command("serve", cls=Command)(serve)
