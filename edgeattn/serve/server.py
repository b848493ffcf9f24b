"""Running the app under uvicorn in this process: the engine, the start-up lines, graceful SIGTERM, and the
deadlines of slow clients (``timed_protocol``)."""

from __future__ import annotations

import logging
import signal
import socket
import sys

MiB = 2**20
MMAP_THRESHOLD = 128 * 2**10  # glibc's default, fixed: freed state buffers go back to the system
DEFAULT_READ_TIMEOUT_S = 30.0  # a request's headers and body must arrive within this (from the connection or
# the previous response); an idle keep-alive connection closes after uvicorn's 5 s
DEFAULT_WRITE_TIMEOUT_S = 30.0  # a client that reads nothing of its response for this long is disconnected


def timed_protocol(base, metrics, read_timeout: float, write_timeout: float):
    """uvicorn's HTTP protocol class ``base`` with two deadlines that it lacks, so that slow or silent
    clients cannot hold connections (file descriptors) or slots for ever:

    - read: the whole request (headers and body) must arrive within ``read_timeout`` seconds of the
      connection opening or of the previous response ending, else the connection is closed (partial
      headers, a trickled body, an idle connection);
    - write: when the client stops reading and the socket's buffers fill, the connection is closed after
      ``write_timeout`` seconds unless it reads again; the app sees a disconnect and ends the request,
      freeing its slot.

    Each closes counts in ``metrics`` (``read_timeouts``, ``write_timeouts``: /metrics)."""

    class TimedProtocol(base):
        _read_timer = _write_timer = None
        _waiting_for = None  # the request cycle before the one being read

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_read()

        def _arm_read(self):
            self._cancel("_read_timer")
            self._waiting_for = self.cycle
            self._read_timer = self.loop.call_later(read_timeout, self._timeout, "read_timeouts")

        def _cancel(self, name):
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _timeout(self, counter):
            if not self.transport.is_closing():
                metrics[counter] += 1
                self.transport.abort()

        def data_received(self, data):
            super().data_received(data)
            c = self.cycle
            if (
                self._read_timer is not None
                and c is not None
                and c is not self._waiting_for
                and not c.more_body
            ):
                self._cancel("_read_timer")  # the whole request is in

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_read()

        def pause_writing(self):
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._timeout, "write_timeouts")

        def resume_writing(self):
            super().resume_writing()
            self._cancel("_write_timer")

        def connection_lost(self, exc):
            self._cancel("_read_timer")
            self._cancel("_write_timer")
            super().connection_lost(exc)

    return TimedProtocol


def raise_open_files_limit() -> None:
    """The soft limit of open files up to the hard one: each client holds a descriptor."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


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


def run_server(
    artifact,
    name: str,
    api_key: str | None,
    *,
    sock: socket.socket,
    hosts: list[str] | None = None,
    max_body_bytes: int | None = None,
    read_timeout: float = DEFAULT_READ_TIMEOUT_S,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
    **options,
) -> None:
    """Serve until SIGTERM or SIGINT: in-flight streams may finish for ``SHUTDOWN_DRAIN_S`` seconds, then
    end cleanly; SIGTERM exits 0. ``hosts``, ``max_body_bytes``: as ``create_app``'s; the timeouts: as
    ``timed_protocol``'s."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from edgeattn.serve.app import SHUTDOWN_DRAIN_S, create_app
    from edgeattn.serve.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return_freed_buffers()
    raise_open_files_limit()
    engine = Engine(artifact, **options)
    extra = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    app = create_app(engine, name, api_key, hosts=hosts, **extra)
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
        http=timed_protocol(AutoHTTPProtocol, engine.metrics, read_timeout, write_timeout),
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
