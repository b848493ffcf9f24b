"""A static server for a site of `edgeattn web` on 127.0.0.1, with the headers WASM threads need.

onnxruntime-web runs several threads only in a cross-origin isolated page (SharedArrayBuffer): the server
must send ``Cross-Origin-Opener-Policy: same-origin`` and ``Cross-Origin-Embedder-Policy: require-corp``.

    python -m edgeattn.web.serve SITE [--port 8080]      # prints the URL, serves until Ctrl-C

    with serve_site(site) as url:                          # a free port, a background thread
        ...
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Handler(SimpleHTTPRequestHandler):
    extensions_map = {
        **SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript",
        ".js": "text/javascript",
        ".wasm": "application/wasm",
        ".onnx": "application/octet-stream",
        ".json": "application/json",
    }
    isolate = True

    def end_headers(self):
        if self.isolate:
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format, *args):  # quiet: the tests and the benchmark read stdout
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return  # the browser closed the connection (a page closed while loading): nothing to report
        super().handle_error(request, client_address)


def make_server(site: str | os.PathLike, port: int = 0, *, isolate: bool = True) -> ThreadingHTTPServer:
    """An HTTP server of ``site`` on 127.0.0.1:``port`` (0: a free port), not yet serving."""
    site = Path(site)
    if not (site / "index.html").is_file():
        raise FileNotFoundError(f"{site} has no index.html: not a site written by `edgeattn web`")
    handler = type("Handler", (_Handler,), {"isolate": isolate})
    return _Server(("127.0.0.1", port), functools.partial(handler, directory=str(site)))


@contextlib.contextmanager
def serve_site(site: str | os.PathLike, *, isolate: bool = True):
    """Serve ``site`` from a background thread; yields its URL (``http://127.0.0.1:PORT/``); stops on exit."""
    server = make_server(site, isolate=isolate)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    try:
        server = make_server(args.site, args.port)
    except (FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {args.site} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
