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
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
SESSION_HEADER = "x-session-id"


class EdgeattnDeployment:
    """One replica: an Engine over the artifact and the app over it (``create_app``)."""

    def __init__(self, artifact: str, name: str, api_key: str | None, options: dict):
        from edgeattn.serve.app import create_app
        from edgeattn.serve.engine import Engine

        # not `self.app`: Ray's ingress wrapper owns that name
        self.engine = Engine(artifact, **options)
        self.edgeattn_app = create_app(self.engine, name, api_key)

    def __serve_build_asgi_app__(self):
        return self.edgeattn_app


def build_deployment(artifact, name: str, api_key: str | None, *, replicas: int = 1, **options):
    """The Ray Serve application (``Deployment.bind(...)``) of ``replicas`` engine replicas."""
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
    return deployment.bind(str(os.path.abspath(artifact)), name, api_key, options)


def run_ray(
    artifact, name: str, api_key: str | None, *, replicas: int, host: str, port: int, **options
) -> None:
    """Start a local Ray instance and Serve on ``host:port``, run the deployment until SIGTERM or SIGINT."""
    import ray
    from ray import serve

    if int(port) == 0:  # Ray's proxy needs a number: take one the OS has free now
        import socket

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    ray.init(
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
    )
    stop = threading.Event()  # after ray.init, which installs handlers of its own
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": int(port)})
        try:
            serve.run(
                build_deployment(artifact, name, api_key, replicas=replicas, **options), route_prefix="/"
            )
        except RuntimeError as e:  # a replica failed to start; Ray's serve logs hold its traceback
            raise ValueError(f"Ray Serve could not start the deployment: {str(e).splitlines()[0]}") from None
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
        serve.shutdown()
    finally:
        ray.shutdown()
    print("edgeattn serve: stopped", file=sys.stderr, flush=True)
