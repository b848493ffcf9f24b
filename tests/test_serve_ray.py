"""`edgeattn serve --ray --replicas N`: the Ray Serve deployment. The default run checks the deployment
object (replicas, router, limits) and one replica of it served in-process to the official `openai`
client; the slow test runs `--ray --replicas 2` on a local Ray instance and repeats the greedy checks."""

import os
from concurrent.futures import ThreadPoolExecutor

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
    finally:
        rc = s.stop(timeout=60)
    assert rc == 0, s.log()


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


def test_a_ray_start_that_fails_is_one_line_and_the_proxy_gets_time(serve_gla, monkeypatch):
    # issue 37.3: the proxy's readiness check (5 s by Ray's default) gets 60 s, and a start that fails
    # (an actor that died under load) is one line, not Ray's traceback
    import ray
    from ray import serve
    from ray.exceptions import ActorDiedError

    from edgeattn.serve.ray import run_ray

    seen = {}

    def died(**kw):
        seen["ready"] = os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
        raise ActorDiedError()

    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "0")  # restored (unset) after the test
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    monkeypatch.setattr(ray, "init", lambda **kw: seen.setdefault("env", kw["runtime_env"]["env_vars"]))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", died)
    with pytest.raises(ValueError, match="^Ray Serve could not start the deployment: ") as e:
        run_ray(serve_gla, "m", None, replicas=1, host="127.0.0.1", port=8000, slots=1)
    assert "\n" not in str(e.value)
    assert seen["ready"] == "60" and seen["env"]["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"
