"""`edgeattn serve ARTIFACT --ray --replicas N`: the same app as a Ray Serve deployment (the `ray` extra).

Each replica builds its own ``Engine`` (its own batch, queue and prefix cache) and serves the same FastAPI
app as `edgeattn serve` (``create_app``), late-bound through Ray Serve's ``__serve_build_asgi_app__`` so that
the app closes over the replica's engine; Ray's HTTP proxy spreads requests over the N replicas.

Cache affinity: a replica's prefix cache holds the conversations it served. Ray Serve routes an ingress
deployment's HTTP requests before reading their body, so routing on the prompt itself (Ray's
``PrefixCacheAffinityRouter`` reads the prompt of ``ray.serve.llm`` requests only) is not available here;
the deployment uses Ray's ``ConsistentHashRouter`` on the ``x-session-id`` header instead: every request of
a conversation that carries the same ``x-session-id`` (the chat page sends one per page) reaches the same
replica, hence its cache; requests without it are spread like any other. With ``--state-cache-dir`` the
replicas share one directory (each indexes it when it starts, so the entries of one are found by all
after a restart) and its disk budget: each replica keeps the files it indexes within
``cache_disk_mb / replicas``, so together they stay within ``cache_disk_mb`` (a file one replica deleted is
a miss, then forgotten, for another that had indexed it).

SIGTERM (or SIGINT) ends as `edgeattn serve` without Ray does: the driver creates a stop file that every
replica watches (``STOP_POLL_S``; a local Ray instance: one machine), each engine refuses new requests and
ends its streams cleanly (``finish_reason``, usage, ``[DONE]``) within ``SHUTDOWN_DRAIN_S``, and only then
is Serve shut down (Serve's own drain waits for requests, but never tells the engine to end them, and kills
the replicas when its timeout passes). Ray's proxy gets ``PROXY_READY_TIMEOUT_S`` to answer its readiness
check (Ray's default, 5 s, fails on a loaded machine), and a deployment that does not start is one line.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time

ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
SESSION_HEADER = "x-session-id"
STOP_POLL_S = 0.2  # how often a replica looks for the driver's stop file
PROXY_READY_TIMEOUT_S = 60  # RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S unless the environment sets it


class EdgeattnDeployment:
    """One replica: an Engine over the artifact and the app over it (``create_app``)."""

    def __init__(
        self, artifact: str, name: str, api_key: str | None, options: dict, stop_file: str | None = None
    ):
        from edgeattn.serve.app import create_app
        from edgeattn.serve.engine import Engine

        # not `self.app`: Ray's ingress wrapper owns that name
        self.engine = Engine(artifact, **options)
        self.edgeattn_app = create_app(self.engine, name, api_key)
        if stop_file is not None:
            threading.Thread(target=self._watch, args=(stop_file,), daemon=True).start()

    def _watch(self, stop_file: str) -> None:
        """Begin the engine's shutdown (as SIGTERM does without Ray) once the driver creates ``stop_file``."""
        from edgeattn.serve.app import SHUTDOWN_DRAIN_S

        while not os.path.exists(stop_file):
            time.sleep(STOP_POLL_S)
        self.engine.request_shutdown(SHUTDOWN_DRAIN_S)

    def __serve_build_asgi_app__(self):
        return self.edgeattn_app


def build_deployment(
    artifact, name: str, api_key: str | None, *, replicas: int = 1, stop_file: str | None = None, **options
):
    """The Ray Serve application (``Deployment.bind(...)``) of ``replicas`` engine replicas; each begins its
    engine's shutdown when ``stop_file`` exists."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    slots = 1 if options.get("slots") is None else int(options["slots"])
    deployment = serve.deployment(
        serve.ingress()(EdgeattnDeployment),
        name="edgeattn",
        num_replicas=int(replicas),
        # every request a replica's engine may hold (slots + queue; 429 beyond), and /health and /metrics
        max_ongoing_requests=slots + int(options.get("max_queue", 16)) + 8,
        ray_actor_options={"num_cpus": 0},  # the engines' threads are --threads, not Ray's CPU accounting
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),
    )
    from edgeattn.serve.cache import DEFAULT_DISK_MB

    cache_dir = options.get("cache_dir")
    options = {
        **options,
        "cache_dir": None if cache_dir is None else str(cache_dir),
        "cache_disk_mb": options.get("cache_disk_mb", DEFAULT_DISK_MB) / int(replicas),  # one directory
    }
    return deployment.bind(str(os.path.abspath(artifact)), name, api_key, options, stop_file)


def run_ray(
    artifact, name: str, api_key: str | None, *, replicas: int, host: str, port: int, **options
) -> None:
    """Start a local Ray instance and Serve on ``host:port``, run the deployment until SIGTERM or SIGINT."""
    import ray
    from ray import serve

    from edgeattn.serve.app import SHUTDOWN_DRAIN_S

    if int(port) == 0:  # Ray's proxy needs a number: take one the OS has free now
        import socket

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    ready = os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_TIMEOUT_S))
    ray.init(
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": ready,
            }
        },
    )
    stop_dir = tempfile.mkdtemp(prefix="edgeattn-ray-")
    stop_file = os.path.join(stop_dir, "stop")
    stop = threading.Event()  # after ray.init, which installs handlers of its own
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        try:
            serve.start(http_options={"host": host, "port": int(port)})
            app = build_deployment(artifact, name, api_key, replicas=replicas, stop_file=stop_file, **options)
            serve.run(app, route_prefix="/")
        except Exception as e:  # a replica or the proxy failed to start; Ray's serve logs hold the traceback
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"Ray Serve could not start the deployment: {first}") from None
        print(
            f"edgeattn serve: model {name!r} on Ray Serve, {replicas} replica(s), each with its own engine "
            f"({options.get('slots')} slots) and prefix cache; conversations stick to a replica by the "
            f"{SESSION_HEADER} header",
            file=sys.stderr,
            flush=True,
        )
        print(
            f"  listening on http://{host}:{port} (ready when GET /health answers 200)",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
        open(stop_file, "w").close()  # the replicas' engines end their streams cleanly ...
        time.sleep(SHUTDOWN_DRAIN_S + 2 * STOP_POLL_S + 1)  # ... within the drain, and the last bytes go out
        serve.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(stop_dir, ignore_errors=True)
    print("edgeattn serve: stopped", file=sys.stderr, flush=True)
