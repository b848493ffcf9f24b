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
does the local Ray instance end (Serve's own drain waits for requests, but never tells the engine to end
them, and kills the replicas when its timeout passes). Ray's proxy gets ``RAY_ENV``'s timeouts for its readiness and health
checks (Ray's defaults, 5 s and 10 s, fail on a loaded machine), and a deployment that does not start is one
line.

``GET /metrics``, whichever replica answers it, is the total over every replica: the replica asks all of
them for their rows (``DeploymentHandle.broadcast``) and sums them (``total_rows``), or answers 503 when one
does not answer within ``METRICS_TIMEOUT_S`` (a partial total would read to Prometheus as counters reset).

Ray's own processes (GCS, raylet, workers, agents) listen on 127.0.0.1 only, whatever ``--host`` says (the
HTTP proxy listens on ``--host``): a local instance needs no other address, and Ray offers no option to
confine its ports, only the loopback node address it takes where it runs without clusters (macOS, Windows:
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), set here before Ray starts. Serve's replicas bind their
inter-deployment gRPC server on ``[::]`` whatever the node's address; each replica rebinds its own to
127.0.0.1 (``_confine_replica_grpc``) before Serve starts it. The slow test lists the sockets.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

RAY_MIN = "2.55"  # DeploymentHandle.broadcast (pyproject's `ray` extra)
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
SESSION_HEADER = "x-session-id"
STOP_POLL_S = 0.2  # how often a replica looks for the driver's stop file
PROXY_WAIT_S = None  # how long the start waits for the HTTP proxy (None: _wait_for_proxy's default)
METRICS_TIMEOUT_S = 10.0  # GET /metrics waits this long for every replica's rows, then answers 503
RAY_ENV = {  # Ray Serve's settings, unless the environment sets them
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",  # Ray's 5 s fails under load: the start then fails
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",  # Ray's 10 s, three times: the proxy is restarted
}
LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's processes on 127.0.0.1 (module docstring)


class EdgeattnDeployment:
    """One replica: an Engine over the artifact and the app over it (``create_app``)."""

    def __init__(
        self,
        artifact: str,
        name: str,
        api_key: str | None,
        options: dict,
        stop_file: str | None = None,
        http: dict | None = None,
    ):
        from edgeattn.serve.app import create_app
        from edgeattn.serve.engine import Engine

        _confine_replica_grpc()
        # not `self.app`: Ray's ingress wrapper owns that name
        self.engine = Engine(artifact, **options)
        self.name = name
        self.replicas = None  # the deployment's handle, made on the first GET /metrics
        self.edgeattn_app = create_app(self.engine, name, api_key, metrics=self.total_metrics, **(http or {}))
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

    def metric_rows(self) -> list:
        """This replica's ``metric_rows`` (a broadcast asks every replica)."""
        from edgeattn.serve.app import metric_rows

        return metric_rows(self.engine)

    def startup_lines(self) -> list[str]:
        """What `edgeattn serve` says when it starts, of this replica's engine."""
        from edgeattn.serve.server import startup_lines

        return startup_lines(self.engine, self.name)

    async def total_metrics(self) -> str:
        """GET /metrics: every replica's rows, summed."""
        from ray import serve

        from edgeattn.serve.app import APIError, prometheus_text

        if self.replicas is None:
            ctx = serve.get_replica_context()
            self.replicas = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        try:
            rows = await self.replicas.broadcast("metric_rows").results_async(timeout_s=METRICS_TIMEOUT_S)
        except Exception as e:  # a replica that died or did not answer in time
            raise APIError(
                503,
                f"the replicas' metrics did not all arrive within {METRICS_TIMEOUT_S:g} s: {_first_line(e)}",
                "server_error",
            ) from None
        return prometheus_text(total_rows(rows))


def _confine_replica_grpc() -> None:
    """In a replica on a loopback node (``LOCAL_ONLY``): the inter-deployment gRPC server that Serve starts
    after the constructor, bound by Serve on ``[::]:0``, on ``127.0.0.1:0`` instead (the node's address,
    where Serve's routers reach it). Nothing where Ray's code differs (the slow test would see the socket)."""
    import ray
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback", False) or ray.util.get_node_ip_address() != "127.0.0.1":
        return

    def loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return bind(server, address)

    loopback.loopback = True
    replica.add_port_to_grpc_server = loopback


def total_rows(per_replica: list[list[tuple]]) -> list[tuple]:
    """The replicas' ``metric_rows`` summed by name (``edgeattn_cache_enabled``, a flag: the largest), and
    ``edgeattn_replicas``, how many replicas the total counts."""
    if not per_replica:
        return []
    names = [r[0] for r in per_replica[0]]
    if any([r[0] for r in rows] != names for rows in per_replica):
        raise ValueError("the replicas report different metrics")
    flags = {"edgeattn_cache_enabled"}
    total = [
        (name, kind, help_, (max if name in flags else sum)(rows[i][3] for rows in per_replica))
        for i, (name, kind, help_, _) in enumerate(per_replica[0])
    ]
    return total + [("edgeattn_replicas", "gauge", "Replicas counted in these totals.", len(per_replica))]


def _wait_for_proxy(serve) -> None:
    """Return once Serve's HTTP proxy is healthy (``serve.run`` returns when the replicas are, while a
    proxy that failed its readiness check is still being restarted): ``TimeoutError`` after
    ``PROXY_WAIT_S``, three of its readiness checks and a margin."""
    from ray.serve.schema import ProxyStatus

    ready = float(
        os.environ.get(
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", RAY_ENV["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]
        )
    )
    wait = PROXY_WAIT_S if PROXY_WAIT_S is not None else 3 * ready + 30
    deadline = time.monotonic() + wait
    while ProxyStatus.HEALTHY not in serve.status().proxies.values():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"its HTTP proxy was not ready within {wait:g} s (a loaded machine: more time with "
                f"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, now {ready:g})"
            )
        time.sleep(0.2)


def _check_ray() -> None:
    """One line where the installed Ray lacks what the deployment uses (``RAY_MIN``)."""
    import importlib.util

    import ray
    from ray.serve.handle import DeploymentHandle

    router = ROUTER.rsplit(".", 1)[0]
    if not hasattr(DeploymentHandle, "broadcast") or importlib.util.find_spec(router) is None:
        raise ValueError(
            f"--ray needs ray[serve] >= {RAY_MIN} (DeploymentHandle.broadcast, {router}); this is Ray "
            f"{ray.__version__}: pip install '.[ray]'"
        )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def build_deployment(
    artifact,
    name: str,
    api_key: str | None,
    *,
    replicas: int = 1,
    stop_file: str | None = None,
    http: dict | None = None,
    **options,
):
    """The Ray Serve application (``Deployment.bind(...)``) of ``replicas`` engine replicas; each begins its
    engine's shutdown when ``stop_file`` exists. ``http``: ``create_app``'s ``hosts`` and
    ``max_body_bytes``."""
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
    return deployment.bind(str(os.path.abspath(artifact)), name, api_key, options, stop_file, http)


def run_ray(
    artifact,
    name: str,
    api_key: str | None,
    *,
    replicas: int,
    host: str,
    port: int,
    http: dict | None = None,
    **options,
) -> None:
    """Start a local Ray instance and Serve on ``host:port``, run the deployment until SIGTERM or SIGINT.
    ``http``: as ``build_deployment``'s."""
    from edgeattn._deps import require

    os.environ.update(LOCAL_ONLY)  # read when Ray is imported, and by every process it starts
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray = require("ray")
    require("ray.serve")  # the `ray` extra's serve part
    from ray import serve
    from ray._private import ray_constants

    from edgeattn.serve.app import SHUTDOWN_DRAIN_S

    _check_ray()
    ray_constants.ENABLE_RAY_CLUSTER = False  # LOCAL_ONLY, where Ray was imported before (tests)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's INFO lines, not edgeattn's own
    if int(port) == 0:  # Ray's proxy needs a number: take one the OS has free now
        import socket

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    ray.init(
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                **{key: os.environ[key] for key in [*RAY_ENV, *LOCAL_ONLY]},
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
            app = build_deployment(
                artifact, name, api_key, replicas=replicas, stop_file=stop_file, http=http, **options
            )
            handle = serve.run(app, route_prefix="/")
            lines = handle.broadcast("startup_lines").results(timeout_s=60)[0]
            _wait_for_proxy(serve)
        except Exception as e:  # a replica or the proxy failed to start; Ray's serve logs hold the traceback
            raise ValueError(f"Ray Serve could not start the deployment: {_first_line(e)}") from None
        for line in [
            *lines,
            f"  on Ray Serve: {replicas} replica(s) as above, each with its own engine and prefix cache; "
            f"conversations stick to a replica by the {SESSION_HEADER} header; /metrics: their total; "
            "Ray's own processes listen on 127.0.0.1 only",
            f"  listening on http://{host}:{port} (ready when GET /health answers 200)",
        ]:
            print(line, file=sys.stderr, flush=True)
        stop.wait()
        open(stop_file, "w").close()  # the replicas' engines end their streams cleanly ...
        time.sleep(SHUTDOWN_DRAIN_S + 2 * STOP_POLL_S + 1)  # ... within the drain, and the last bytes go out
        # then the local instance ends with everything in it; serve.shutdown() would only add Ray's lines
        # ("killed by ray.kill") and, where the signal reached Ray's processes too (a process group's
        # SIGTERM, as systemd's), wait 30 s for a controller that can no longer answer
    finally:
        ray.shutdown()
        shutil.rmtree(stop_dir, ignore_errors=True)
    print("edgeattn serve: stopped", file=sys.stderr, flush=True)
