"""`edgeattn serve`'s handling of hostile, malformed and slow requests (issues 31 and 37), against real server
processes through the official `openai` client, httpx and raw sockets: a bad request beside good ones in
flight, logit_bias against an independent computation, SIGTERM with queued requests, lone surrogates, the
body bound, the event loop kept free, slow clients and the request life cap, stop strings' bounds, API keys
from the environment or a file, the Host header, strict field types and the error messages."""

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.serve_helpers import greedy_text, health_times_while, start_server, text_prompt

N = 24


@pytest.fixture(scope="module")
def server(serve_gla):
    s = start_server(serve_gla, "--slots", 4, "--max-body-mb", 1, "--max-tokens", 40)
    yield s
    s.stop()


def _post(s, body, path="/v1/completions", **kw) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=60, **kw)


def _raw(s, text: str, path="/v1/completions") -> httpx.Response:
    return httpx.post(
        s.url + path, content=text.encode(), headers={"content-type": "application/json"}, timeout=60
    )


def _err(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _metric(s, name: str, headers=None) -> float:
    text = httpx.get(s.url + "/metrics", headers=headers).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_bad_request_beside_streams_in_flight_leaves_them_completing(server, serve_gla):
    # issue 31.2: "seed": -1 used to pass validation and end every request in flight ("the engine failed")
    c = server.client()
    prompts = [text_prompt(20 + i, 40 + i) for i in range(3)]
    want = [greedy_text(serve_gla, p, 40) for p in prompts]
    started = threading.Barrier(4)

    def stream(p):
        out = []
        it = c.completions.create(model=serve_gla.name, prompt=p, max_tokens=40, temperature=0, stream=True)
        for i, ch in enumerate(it):
            if i == 0:
                started.wait(30)
            out.append(ch.choices[0].text)
        return "".join(out), ch.choices[0].finish_reason

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        started.wait(30)  # every stream is generating
        bad = [
            ({"seed": -1}, "seed"),
            ({"seed": 2**64}, "seed"),
            ({"temperature": 3}, "temperature"),
            ({"logit_bias": {"256": 1}}, "logit_bias"),  # outside the byte-level vocabulary
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": {"x": 1}}, "logit_bias"),
        ]
        for fields, param in bad:
            r = _post(server, {"model": serve_gla.name, "prompt": "x", **fields})
            assert r.status_code == 400 and _err(r)["param"] == param, (fields, r.text)
        results = [f.result(60) for f in futures]
    assert results == [(w, "length") for w in want]


def _biased_greedy(artifact, ids, n, bias: dict[int, float]) -> list[int]:
    """Greedy decoding with the bias added to the graph's logits here, by hand (the reference)."""
    from edgeattn.runtimes import open_session

    sess = open_session(artifact)
    add = np.zeros(sess.manifest.vocab_size)
    for t, b in bias.items():
        add[t] += b
    logits = sess.prefill(np.asarray([ids]))[0]
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits.astype(np.float64) + add))
        out.append(tok)
        logits = sess.step(np.array([[tok]]))[0]
    return out


def test_logit_bias_through_the_server_the_session_and_streams(server, serve_gla):
    # issue 37.2: logit_bias was accepted and ignored
    from edgeattn.runtimes import open_session
    from edgeattn.runtimes.streams import Streams

    ids = [int(t) for t in text_prompt(30, 7).encode()]
    plain = _biased_greedy(serve_gla, ids, 12, {})
    bias = {plain[0]: -100.0, plain[1]: -100.0, ord("e"): 3.5}  # ban the greedy picks, favour 'e'
    want = _biased_greedy(serve_gla, ids, 12, bias)
    assert want != plain
    r = server.client().completions.create(
        model=serve_gla.name,
        prompt=ids,
        max_tokens=12,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == bytes(want).decode("utf-8", errors="replace")
    forced = server.client().completions.create(
        model=serve_gla.name, prompt="x", max_tokens=5, temperature=1.5, seed=3, logit_bias={"65": 100}
    )
    assert forced.choices[0].text == "AAAAA"
    sess = open_session(serve_gla)
    assert list(sess.generate_ids(ids, 12, temperature=0, logit_bias=bias, stop_ids=[])) == want
    streams = Streams(serve_gla)
    sid = streams.add(ids, temperature=0, logit_bias=bias, stop_ids=[], max_new_tokens=12)
    while not streams.done(sid):
        streams.step()
    assert streams.generated(sid) == want


def test_sample_next_logit_bias_equals_transformers_sequence_bias():
    # an independent implementation of the same bias: transformers' SequenceBiasLogitsProcessor, then
    # softmax(scores / T) drawn with a generator seeded alike
    torch = pytest.importorskip("torch")
    from transformers import SequenceBiasLogitsProcessor

    from edgeattn.runtimes.sampling import sample_next

    rng = np.random.default_rng(0)
    V = 50
    for trial in range(40):
        logits = rng.normal(0, 2, V)
        ids = rng.choice(V, 6, replace=False)
        bias = {int(t): float(b) for t, b in zip(ids, rng.uniform(-100, 100, 6))}
        proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
        scores = proc(torch.zeros(1, 1, dtype=torch.long), torch.tensor(logits[None]))[0].numpy()
        assert int(np.argmax(scores)) == sample_next(logits, temperature=0, logit_bias=bias)
        p = torch.softmax(torch.tensor(scores) / 0.8, -1).numpy()
        ref = int(np.random.default_rng(trial).choice(V, p=p / p.sum()))
        got = sample_next(logits, temperature=0.8, logit_bias=bias, rng=np.random.default_rng(trial))
        assert got == ref


def test_sigterm_with_queued_requests_gives_them_the_503_body(serve_gla):
    # issue 31.4: the queued ones got a text/plain 500 and a traceback each
    s = start_server(serve_gla, "--slots", 1)
    try:
        body = {"model": serve_gla.name, "prompt": "x", "max_tokens": 60000, "extra": 1}
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_post, s, {**body, "prompt": f"p{i}"}) for i in range(4)]
            deadline = time.monotonic() + 30
            while _metric(s, "edgeattn_queue_depth") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            s.terminate()
            responses = [f.result(60) for f in futures]
    finally:
        assert s.stop() == 0
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 503, 503, 503], [r.text for r in responses]
    for r in responses:
        if r.status_code == 503:
            assert _err(r)["code"] == "shutting_down" and r.headers["content-type"] == "application/json"
    assert "Traceback" not in s.log()


def test_lone_surrogates_are_refused_naming_the_field(server, serve_gla):
    # issue 31.5: a 500 text/plain (UnicodeEncodeError) for each of these
    name = serve_gla.name
    chat = "/v1/chat/completions"
    cases = [  # json.dumps writes a lone surrogate as its escape, "\\ud800", as a client would send it
        ({"model": name, "prompt": "a\ud800b"}, "/v1/completions", "prompt"),
        ({"model": name, "prompt": ["\udfff"]}, "/v1/completions", "prompt"),
        ({"model": name, "prompt": "a", "stop": "\ud800"}, "/v1/completions", "stop"),
        ({"model": name, "messages": [{"role": "user", "content": "\ud800"}]}, chat, "messages"),
        (
            {"model": name, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            chat,
            "messages",
        ),
    ]
    for body, path, param in cases:
        text = json.dumps(body)
        assert "\\ud" in text  # the escape, not the character
        r = _raw(server, text, path)
        assert r.status_code == 400, (text, r.text)
        e = _err(r)
        assert e["param"] == param and "lone surrogate" in e["message"], (text, e)


def test_bodies_over_the_bound_get_413_and_the_loop_stays_free(server, serve_gla):
    # issue 31.8: no bound on bodies, and parsing and tokenizing ran on the event loop
    big = {"model": serve_gla.name, "prompt": "x" * (2 * 2**20)}
    r = _post(server, big)
    assert r.status_code == 413 and "--max-body-mb" in _err(r)["message"]

    def chunks():  # no Content-Length: the bound holds as the body arrives
        for _ in range(40):
            yield b"[" + b"1," * 32768

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413

    # bodies just under the bound, each parsed and checked (a prompt of 140k token ids, then refused as too
    # long): /health must answer within 100 ms meanwhile
    ids = json.dumps({"model": serve_gla.name, "prompt": [7] * 140_000})
    assert len(ids) < 2**20

    def send():
        assert _raw(server, ids).status_code == 400

    took = health_times_while(server.url, send, workers=6, probes=40)
    # the median, not the worst: this machine's other load (2 shared cores) adds its own outliers. On the
    # loop the median was 292 ms (load 13); off it 38 ms
    assert sorted(took)[len(took) // 2] < 0.1, [round(t * 1000) for t in sorted(took)]


def test_slow_clients_are_timed_out_and_a_request_life_is_capped(serve_gla):
    # issue 31.9: partial headers were never timed out, a client that reads nothing held its slot for ever
    s = start_server(serve_gla, "--slots", 1, "--read-timeout", 1, "--write-timeout", 1)
    try:
        with socket.create_connection(s.url.removeprefix("http://").split(":"), timeout=10) as partial:
            partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            t0 = time.monotonic()
            assert partial.recv(100) == b""  # closed by the server
            assert 0.5 < time.monotonic() - t0 < 5
        assert _metric(s, "edgeattn_read_timeouts_total") == 1

        # a stream whose client never reads: once its buffers fill, it is disconnected and the slot freed
        host, port = s.url.removeprefix("http://").split(":")
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        silent.connect((host, int(port)))
        body = json.dumps(
            {"model": serve_gla.name, "prompt": "x", "max_tokens": 60000, "stream": True, "ignore_eos": True}
        ).encode()
        silent.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        t0 = time.monotonic()
        r = s.client().completions.create(model=serve_gla.name, prompt="next", max_tokens=3)
        assert r.usage.completion_tokens == 3
        silent.close()
        assert _metric(s, "edgeattn_write_timeouts_total") == 1
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.log()

    s = start_server(serve_gla, "--max-request-seconds", 2)
    try:
        # a long request ends at --max-request-seconds as "length"
        t0 = time.monotonic()
        r = s.client().completions.create(
            model=serve_gla.name, prompt="y", max_tokens=60000, extra_body={"ignore_eos": True}
        )
        took = time.monotonic() - t0
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 60000
        assert 1.5 < took < 13, took
        assert _metric(s, "edgeattn_requests_timed_out_total") == 1
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.log()


def test_stop_strings_are_bounded(server, serve_gla):
    # issue 31.10: 200,000 stop strings cost 0.6 s per token on the event loop
    base = {"model": serve_gla.name, "prompt": "x", "max_tokens": 2}
    r = _post(server, {**base, "stop": [f"s{i}" for i in range(17)]})
    assert r.status_code == 400 and _err(r)["param"] == "stop" and "at most 16" in _err(r)["message"]
    r = _post(server, {**base, "stop": "z" * 129})
    assert r.status_code == 400 and _err(r)["param"] == "stop" and "128 characters" in _err(r)["message"]
    r = _post(server, {**base, "stop": [f"s{i}" for i in range(16)]})
    assert r.status_code == 200


def test_api_key_sources_and_the_host_header(serve_gla, tmp_path):
    # issue 31.14: --api-key "" started a server nobody could use; the key only on the command line;
    # no Host check (DNS rebinding)
    import subprocess
    import sys

    from tests.serve_helpers import REPO

    p = subprocess.run(
        [sys.executable, "-m", "edgeattn.cli.main", "serve", str(serve_gla), "--port", "0", "--api-key", ""],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 2 and p.stderr.startswith("error: --api-key") and len(p.stderr.splitlines()) == 1

    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    for args, env, key in [
        (["--api-key-file", key_file], None, "from-a-file"),
        ([], {"EDGEATTN_API_KEY": "from-env"}, "from-env"),
    ]:
        s = start_server(serve_gla, *args, env=env)
        try:
            assert key not in " ".join(s.proc.args)
            assert _post(s, {"model": serve_gla.name, "prompt": "x"}).status_code == 401
            auth = {"Authorization": f"Bearer {key}"}
            assert (
                _post(s, {"model": serve_gla.name, "prompt": "x", "max_tokens": 1}, headers=auth).status_code
                == 200
            )
            r = httpx.get(s.url + "/v1/models", headers={**auth, "Host": "attacker.example:8000"})
            assert r.status_code == 400 and _err(r)["code"] == "invalid_host"
            assert httpx.get(s.url + "/v1/models", headers={**auth, "Host": "localhost:1"}).status_code == 200
        finally:
            assert s.stop() == 0

    s = start_server(serve_gla, "--allowed-host", "chat.example")
    try:
        assert httpx.get(s.url + "/v1/models", headers={"Host": "chat.example"}).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"Host": "other.example"}).status_code == 400
    finally:
        s.stop()


def test_strict_fields_and_clear_messages(server, serve_gla):
    # issue 31.15 and 37.5
    name = serve_gla.name
    assert httpx.head(server.url + "/health").status_code == 200
    r = _raw(server, json.dumps({"model": name, "prompt": "x", "temperature": float("nan")}))
    assert r.status_code == 400 and "finite" in _err(r)["message"] and _err(r)["param"] == "temperature"
    for fields, param in [
        ({"max_tokens": True}, "max_tokens"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [1.0, 2.0]}, "prompt"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ""}, "stop"),
    ]:
        r = _post(server, {"model": name, "prompt": "x", **fields})
        assert r.status_code == 400 and _err(r)["param"] == param, (fields, r.text)
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=name, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
        )
    e = info.value.response.json()["error"]
    assert e["param"] == "messages" and "text only" in e["message"] and ".str" not in e["message"], e
    # --max-tokens 40 caps a reply on a fixed-state model
    r = server.client().completions.create(
        model=name, prompt="x", max_tokens=10**6, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"


def test_the_429_message_and_an_off_cache_count(serve_gla):
    s = start_server(serve_gla, "--slots", 1, "--max-queue", 0, "--state-cache-mb", 0)
    try:
        long = {
            "model": serve_gla.name,
            "prompt": "x",
            "max_tokens": 60000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=60) as resp:
            lines = resp.iter_lines()  # held: a dropped iterator closes the response
            next(lines)
            r = _post(s, {"model": serve_gla.name, "prompt": "y"})
        assert r.status_code == 429
        assert r.status_code == 429
        assert _err(r)["message"] == (
            "the server is full: its 1 slots (--slots) and 0 queue places (--max-queue) hold 1 requests; "
            "retry later"
        )
        assert _metric(s, "edgeattn_cache_enabled") == 0 and _metric(s, "edgeattn_cache_misses_total") == 1
    finally:
        s.stop()
