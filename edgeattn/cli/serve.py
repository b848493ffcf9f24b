"""`edgeattn serve ARTIFACT`: an OpenAI-compatible HTTP server over one artifact (the `serve` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgeattn.cli._common import CLIError, Command, check_output_dir, cli_errors

DEFAULT_DISK_MB = 4096  # edgeattn.serve.cache.DEFAULT_DISK_MB (not imported: numpy is not loaded for --help)
# edgeattn.serve.app.DEFAULT_MAX_BODY_MB and edgeattn.serve.server's timeouts (not imported, as above)
DEFAULT_MAX_BODY_MB = 8.0
DEFAULT_TIMEOUT_S = 30.0
API_KEY_ENV = "EDGEATTN_API_KEY"


def _api_key(key: str | None, key_file: Path | None) -> str | None:
    """The key from --api-key (or $EDGEATTN_API_KEY) or --api-key-file (its first line); an empty key is an
    error (a server nobody could use), and so are both."""
    if key is not None and key_file is not None:
        raise CLIError(f"give --api-key (or ${API_KEY_ENV}) or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(
                f"cannot read --api-key-file {key_file}: {getattr(e, 'strerror', None) or e}"
            ) from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise CLIError(f"--api-key-file {key_file} holds no key (its first line is empty)")
    elif key is not None and not key.strip():
        raise CLIError(
            f"--api-key (or ${API_KEY_ENV}) is empty: nobody could use the server; give a key or none"
        )
    return key


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
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_envvar=True,
            help="Require 'Authorization: Bearer KEY' (GET /health and / excepted). Visible in `ps`: "
            "prefer the environment variable or --api-key-file.",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="Read the API key from this file's first line.")
    ] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            help="A Host header name to answer to besides the defaults (repeatable; '*': any). By default a "
            "server on a loopback --host answers to localhost, 127.0.0.1 and ::1 only (no DNS rebinding), "
            "one on a specific address to that address too, one on 0.0.0.0 or :: to any name.",
        ),
    ] = None,
    max_body_mb: Annotated[
        float, typer.Option(min=0.001, help="Largest request body, MiB (HTTP 413 beyond).")
    ] = DEFAULT_MAX_BODY_MB,
    read_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a request's headers and body may take to arrive (from the connection or the "
            "previous response); the connection is closed beyond. Not under --ray (Ray's proxy holds the "
            "connections).",
        ),
    ] = DEFAULT_TIMEOUT_S,
    write_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a client may read nothing while its response waits; it is disconnected beyond "
            "(its slot freed). Not under --ray.",
        ),
    ] = DEFAULT_TIMEOUT_S,
    max_request_seconds: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="A request's longest life, queue included (default: none); it then ends as 'length'.",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Most tokens one reply may have (default 65536); a request asking more gets this many "
            "(finish_reason 'length'). A KV buffer also bounds it.",
        ),
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
    speculative: Annotated[
        str | None,
        typer.Option(
            help="'ngram': each stream drafts its next tokens by prompt lookup and one call verifies the "
            "batch (the same tokens as without; needs a --dynamic-batch one-graph artifact).",
        ),
    ] = None,
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

    if speculative is not None and speculative != "ngram":
        raise CLIError(
            f"--speculative must be 'ngram' (the server drafts by prompt lookup), got {speculative!r}"
        )
    if replicas > 1 and not ray:
        raise CLIError("--replicas needs --ray")
    if state_cache_dir is not None:
        check_output_dir(state_cache_dir, "--state-cache-dir")
    api_key = _api_key(api_key, api_key_file)
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
        max_tokens=max_tokens,
        max_request_s=max_request_seconds,
        speculative=speculative,
    )
    from edgeattn.serve.app import allowed_hosts

    http = dict(hosts=allowed_hosts(host, allowed_host or ()), max_body_bytes=int(max_body_mb * 2**20))
    if ray:
        from edgeattn.serve.ray import run_ray

        run_ray(artifact, name, api_key, replicas=replicas, host=host, port=port, http=http, **options)
        return
    from edgeattn.serve.server import run_server

    run_server(
        artifact,
        name,
        api_key,
        sock=_listen(host, port),
        **http,
        read_timeout=read_timeout,
        write_timeout=write_timeout,
        **options,
    )


def register(app: typer.Typer) -> None:
    app.command("serve", cls=Command)(serve)
