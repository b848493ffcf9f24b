"""Running the app under uvicorn in this process: the engine, the start-up lines, graceful SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import sys

MiB = 2**20
MMAP_THRESHOLD = 128 * 2**10  # glibc's default, fixed: freed state buffers go back to the system


def return_freed_buffers() -> bool:
    """Fix glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``), so that every buffer above it
    (a cached state's tensors) is its own mapping, returned to the system when freed: the server's RSS then
    follows the states it holds. glibc otherwise raises the threshold after the first such buffer is freed,
    and later ones stay in its heap. False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def startup_lines(engine, name: str) -> list[str]:
    """What the server says when it starts: the model, the batch, the state memory, the cache."""
    m = engine.manifest
    lines = [f"edgeattn serve: model {name!r} from {m.root} ({m.target}, {m.precision})"]
    per = engine.state_bytes
    lines.append(
        f"  {engine.slots} slot(s) x {per / MiB:.2f} MiB of state = {engine.slots * per / MiB:.2f} MiB; "
        f"queue {engine.max_queue}; prompts up to {engine.max_prompt_tokens} tokens"
    )
    if engine.serial_reason:
        lines.append(f"  one stream at a time (no batching): {engine.serial_reason}")
    c = engine.cache
    where = ""
    if c.directory is not None:
        where = (
            f", on disk in {c.directory} ({len(c)} entries found, {c.disk_bytes / MiB:.1f} of "
            f"{c.disk_capacity / MiB:g} MiB)"
        )
    lines.append(f"  prefix-state cache: {c.capacity / MiB:.0f} MiB in memory{where}")
    if c.capacity > 0:
        # a conversation keeps its last prompt's state and its last reply's; the longest: a full KV buffer
        full = 2 * c.entry_bytes(m.max_length or engine.max_prompt_tokens)
        held = c.capacity // full
        lines.append(
            f"  the cache holds {held} conversation(s) at this artifact's full length "
            f"(2 states x {full / 2 / MiB:.2f} MiB: a prompt's and its reply's)"
        )
        if held < engine.slots:
            lines.append(
                f"  warning: the prefix-state cache holds fewer conversations ({held}) than there are slots "
                f"({engine.slots}): conversations are evicted before their next turn; give --state-cache-mb "
                f"{-(-engine.slots * full // MiB)} or more"
            )
    return lines


def run_server(artifact, name: str, api_key: str | None, *, sock: socket.socket, **options) -> None:
    """Serve until SIGTERM or SIGINT: in-flight streams may finish for ``SHUTDOWN_DRAIN_S`` seconds, then
    end cleanly; SIGTERM exits 0."""
    import uvicorn

    from edgeattn.serve.app import SHUTDOWN_DRAIN_S, create_app
    from edgeattn.serve.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return_freed_buffers()
    engine = Engine(artifact, **options)
    app = create_app(engine, name, api_key)
    for line in startup_lines(engine, name):
        print(line, file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.request_shutdown(SHUTDOWN_DRAIN_S)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=int(SHUTDOWN_DRAIN_S + 5),
        lifespan="on",
    )
    server = Server(config)
    print(
        f"  listening on http://{host}:{port} (ready when GET /health answers 200)",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn re-raises the signal it caught once it has shut down; a SIGTERM handled here ends the
    # process normally (exit 0) instead of by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    print("edgeattn serve: stopped", file=sys.stderr, flush=True)
