"""`edgeattn serve --ray --replicas N`: the Ray Serve deployment. The default run checks the deployment
object (replicas, router, limits) and one replica of it served in-process to the official `openai`
client; the slow test runs `--ray --replicas 2` on a local Ray instance and repeats the greedy checks."""

import ipaddress
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serve_helpers import greedy_ids, greedy_text, start_server, text_prompt

pytest.importorskip("ray.serve")

N = 16


def test_the_deployment_object_and_one_replica_of_it(serve_gla):
    from starlette.testclient import TestClient

    from edgeattn.serve.ray import ROUTER, EdgeattnDeployment, build_deployment

    app = build_deployment(serve_gla, "m", None, replicas=2, slots=3, max_queue=5)
    d = app._bound_deployment
    assert d.num_replicas == 2 and d.max_ongoing_requests == 3 + 5 + 8
    assert d._deployment_config.request_router_config.request_router_class == ROUTER
    assert d.func_or_class.__name__ == EdgeattnDeployment.__name__
    # what each replica runs: the constructor's engine and app, lifespan included
    replica = EdgeattnDeployment(str(serve_gla), "m", None, {"slots": 3, "max_queue": 5})
    with TestClient(replica.__serve_build_asgi_app__()) as http:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        prompts = [text_prompt(20 + 9 * i, 40 + i) for i in range(3)]
        for p in prompts:
            r = c.completions.create(model="m", prompt=p, max_tokens=N, temperature=0)
            assert r.choices[0].text == greedy_text(serve_gla, p, N)
        first = list(prompts[0].encode())
        second = first + greedy_ids(serve_gla, first, N) + list(b"!")
        r = c.completions.create(model="m", prompt=second, max_tokens=N, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == len(second) - 1
        assert r.choices[0].text == greedy_text(serve_gla, second, N)


@pytest.fixture
def ray_env(monkeypatch):
    """The variables run_ray sets, restored (unset) after the test."""
    from edgeattn.serve.ray import LOCAL_ONLY, RAY_ENV

    for key in [*RAY_ENV, *LOCAL_ONLY]:
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)


class _Broadcast:
    """What ``DeploymentHandle.broadcast(method)`` gives, over in-process replicas."""

    def __init__(self, replicas, method, fail=None):
        self.replicas, self.method, self.fail = replicas, method, fail

    async def results_async(self, timeout_s=None):
        if self.fail is not None:
            raise self.fail
        return [getattr(r, self.method)() for r in self.replicas]


class _Handle:
    def __init__(self, replicas, fail=None):
        self.replicas, self.fail = replicas, fail

    def broadcast(self, method):
        return _Broadcast(self.replicas, method, self.fail)


def _metrics(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


def test_metrics_under_ray_are_the_total_over_the_replicas(serve_gla):
    # issue 37.3: /metrics answered for the replica that served it; now each replica's rows, summed
    from starlette.testclient import TestClient

    from edgeattn.serve.ray import EdgeattnDeployment

    replicas = [EdgeattnDeployment(str(serve_gla), "m", None, {"slots": s, "max_queue": 3}) for s in (1, 2)]
    for r in replicas:
        r.replicas = _Handle(replicas)
    with TestClient(replicas[0].edgeattn_app) as a, TestClient(replicas[1].edgeattn_app) as b:
        for http, n in ((a, 2), (b, 3)):
            for i in range(n):
                r = http.post("/v1/completions", json={"model": "m", "prompt": f"p{i}", "max_tokens": 4})
                assert r.status_code == 200, r.text
        for http in (a, b):
            got = _metrics(http.get("/metrics").text)
            assert got["edgeattn_requests_total"] == 5 and got["edgeattn_completion_tokens_total"] == 20
            assert got["edgeattn_slots"] == 3 and got["edgeattn_replicas"] == 2
            assert got["edgeattn_cache_enabled"] == 1 and got["edgeattn_cache_misses_total"] == 5
        # a replica that does not answer: 503, not a partial total (counters would seem to reset)
        replicas[0].replicas = _Handle(
            replicas, fail=TimeoutError("Timed out waiting for broadcast results.")
        )
        r = a.get("/metrics")
        assert r.status_code == 503 and "did not all arrive" in r.json()["error"]["message"]


@pytest.mark.slow
def test_ray_replicas_give_the_greedy_text(serve_gla):
    s = start_server(serve_gla, "--ray", "--replicas", 2, "--slots", 4, timeout=240)
    try:
        c = s.client()
        prompts = [text_prompt(15 + 11 * i, 60 + i) for i in range(6)]
        want = [greedy_text(serve_gla, p, N) for p in prompts]
        with ThreadPoolExecutor(6) as pool:
            got = list(
                pool.map(
                    lambda p: (
                        c.completions.create(model=serve_gla.name, prompt=p, max_tokens=N, temperature=0)
                        .choices[0]
                        .text
                    ),
                    prompts,
                )
            )
        assert got == want
        # the same x-session-id reaches the same replica, hence its prefix cache
        sticky = s.client(default_headers={"x-session-id": "conversation-1"})
        first = list(prompts[0].encode()) + list(b"#")
        second = first + greedy_ids(serve_gla, first, N) + list(b"?")
        sticky.completions.create(model=serve_gla.name, prompt=first, max_tokens=N, temperature=0)
        r = sticky.completions.create(model=serve_gla.name, prompt=second, max_tokens=N, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == len(second) - 1
        assert r.choices[0].text == greedy_text(serve_gla, second, N)
        stream = c.completions.create(
            model=serve_gla.name, prompt=prompts[1], max_tokens=N, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in stream) == want[1]
        # /metrics: the total over both replicas, whichever answers (issue 37.3)
        for _ in range(4):
            got = _metrics(httpx.get(s.url + "/metrics", timeout=30).text)
            assert got["edgeattn_requests_total"] == len(prompts) + 3
            assert got["edgeattn_slots"] == 2 * 4 and got["edgeattn_replicas"] == 2
        # the Host check (DNS rebinding) holds under Ray too, and Ray listens on loopback only (issue 37.3)
        r = httpx.get(s.url + "/v1/models", headers={"host": "attacker.example"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert "slot(s) x" in s.log() and "the cache holds" in s.log()
        listening = _listening(s.proc.pid)
        assert any(port == int(s.url.rsplit(":", 1)[1]) for _, _, port in listening)  # the proxy is seen
        assert len(listening) > 5
        assert [x for x in listening if not ipaddress.ip_address(x[1]).is_loopback] == []
    finally:
        rc = s.stop(timeout=60)
    assert rc == 0, s.log()


def _listening(pid: int) -> list[tuple[str, str, int]]:
    """``(process, address, port)`` where each process of ``pid``'s tree listens (TCP)."""
    import psutil

    root = psutil.Process(pid)
    found = []
    for p in [root, *root.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:  # a worker that ended meanwhile
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                ip = c.laddr.ip.removeprefix("::ffff:")  # an IPv4-mapped address
                found.append((p.name(), ip, c.laddr.port))
    return found


@pytest.mark.slow
def test_sigterm_under_ray_ends_the_streams_cleanly_and_exits_0(serve_gla):
    # issue 37.3: as without Ray, SIGTERM lets a stream finish within the drain and then ends it with its
    # finish_reason and [DONE], instead of the stream being cut when Serve kills the replica
    s = start_server(serve_gla, "--ray", "--replicas", 1, "--slots", 2, timeout=240)
    try:
        c = s.client()
        stream = c.completions.create(
            model=serve_gla.name,
            prompt="a long one",
            max_tokens=1_000_000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        s.terminate()
        rest = list(chunks)  # the openai client raises if the stream is cut
        assert rest and rest[-1].choices[0].finish_reason == "length"
    finally:
        rc = s.stop(timeout=90)
    assert rc == 0, s.log()
    assert "Traceback" not in s.log() and "ray.kill" not in s.log() and "WARNING" not in s.log(), s.log()


def test_a_ray_start_that_fails_is_one_line_and_ray_is_confined(serve_gla, monkeypatch, ray_env):
    # issue 37.3: the proxy's readiness check (5 s by Ray's default) gets 60 s, and a start that fails
    # (an actor that died under load) is one line, not Ray's traceback; Ray starts in its local mode (every
    # process on 127.0.0.1: the slow test lists their sockets)
    import ray
    from ray import serve
    from ray._private import ray_constants
    from ray.exceptions import ActorDiedError

    from edgeattn.serve.ray import run_ray

    seen = {}

    def died(**kw):
        seen["ready"] = os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
        raise ActorDiedError()

    def init(**kw):
        seen["env"] = kw["runtime_env"]["env_vars"]
        seen["local"] = (
            os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
            ray_constants.ENABLE_RAY_CLUSTER,
        )

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", died)
    with pytest.raises(ValueError, match="^Ray Serve could not start the deployment: ") as e:
        run_ray(serve_gla, "m", None, replicas=1, host="127.0.0.1", port=8000, slots=1)
    assert "\n" not in str(e.value)
    assert seen["ready"] == "60" and seen["env"]["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"
    assert seen["env"]["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "30"
    assert seen["local"] == ("0", False) and seen["env"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


def test_a_ray_without_broadcast_is_one_line_before_ray_starts(serve_gla, monkeypatch, ray_env):
    import ray
    from ray.serve.handle import DeploymentHandle

    from edgeattn.serve.ray import run_ray

    monkeypatch.delattr(DeploymentHandle, "broadcast")
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("Ray started"))
    with pytest.raises(ValueError, match=r"^--ray needs ray\[serve\] >= 2\.55 \(DeploymentHandle\.broadcast"):
        run_ray(serve_gla, "m", None, replicas=1, host="127.0.0.1", port=8000, slots=1)


def test_serve_ray_without_ray_is_one_line(serve_gla, monkeypatch):
    # a new user with the `serve` extra only: which extra to install, not a ModuleNotFoundError traceback
    import sys

    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails
    r = CliRunner().invoke(app, ["serve", str(serve_gla), "--ray"])
    assert (
        r.exit_code == 2
        and r.output == "error: ray is needed for this; install it with: pip install 'edgeattn[ray]'\n"
    )


def test_a_proxy_that_never_gets_ready_is_one_line(serve_gla, monkeypatch, ray_env):
    # issue 37.3: serve.run returns once the replicas are up while a proxy that failed its readiness check
    # is restarted; "listening on" was printed though nothing answered. Now the start waits for it.
    import types

    import ray
    from ray import serve
    from ray.serve.schema import ProxyStatus

    from edgeattn.serve import ray as ray_module

    class Handle:
        def broadcast(self, method):
            return types.SimpleNamespace(results=lambda timeout_s: [["the engine's lines"]])

    class Started:  # run_ray's stop event: reached only when the start went on without a proxy
        def wait(self):
            raise AssertionError("the start went on without a ready proxy")

        def set(self):
            pass

    monkeypatch.setattr(ray_module, "threading", types.SimpleNamespace(Event=Started))
    monkeypatch.setattr(ray_module, "PROXY_WAIT_S", 0.5, raising=False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    monkeypatch.setattr(serve, "run", lambda app, **kw: Handle())
    monkeypatch.setattr(serve, "status", lambda: types.SimpleNamespace(proxies={"n": ProxyStatus.STARTING}))
    with pytest.raises(
        ValueError,
        match="^Ray Serve could not start the deployment: its HTTP proxy was not ready within 0.5 s",
    ):
        ray_module.run_ray(serve_gla, "m", None, replicas=1, host="127.0.0.1", port=8000, slots=1)
