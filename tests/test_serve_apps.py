"""`edgeattn serve` for apps and agents, through the official `openai` client against a real server process: JSON
schema outputs (``response_format``, ``chat.completions.parse``) enforced by the grammar engine while sampling,
batched and streamed; tool calls (required / named constrained by the function's schema, deltas when streamed,
the tools rendered by the chat template as transformers renders them, a tool message fed back); logprobs equal
to the log-softmax of the artifact's own logits (Session's); bad schemas and tools a 400 naming the field.

The model is a tiny random GLA with a trained BPE tokenizer (vocabulary 320): its text is noise, so the schemas
bound every value (enums, booleans, ``maxLength``) and the grammar alone makes the output valid."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel, Field

from tests.serve_helpers import SERVE_PREFILL, start_server

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("transformers")

# a template with a tools section, as Hugging Face templates write it (Qwen's, Hermes')
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    indoor: bool
    name: str = Field(max_length=6)
    tags: list[Literal["small", "loud", "old"]] = Field(max_length=2)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 4}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """(plain-template artifact, tools-template artifact, tokenizer dir): tiny GLAs, --dynamic-batch."""
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint
    from tests.hf_helpers import train_tokenizer

    root = tmp_path_factory.mktemp("apps")
    ckpt = make_checkpoint(root / "ckpt", "gla", vocab_size=320)
    train_tokenizer(ckpt)
    plain = export_model(ckpt, root / "plain", prefill_chunk=SERVE_PREFILL, dynamic_batch=True)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOLS_TEMPLATE}))
    tools = export_model(ckpt, root / "tools", prefill_chunk=SERVE_PREFILL, dynamic_batch=True)
    return plain, tools, ckpt


@pytest.fixture(scope="module")
def server(arts):
    s = start_server(arts[0], "--slots", 4)
    yield s
    s.stop()


def _msgs(text="describe a pet"):
    return [{"role": "user", "content": text}]


def test_parse_returns_a_validated_object_sampled_batched_and_streamed(server, arts):
    c = server.client()
    name = arts[0].name

    def one(seed):
        r = c.chat.completions.parse(
            model=name, messages=_msgs(), response_format=Pet, max_tokens=80, temperature=1.0, seed=seed
        )
        return r.choices[0]

    with ThreadPoolExecutor(6) as pool:  # 6 requests over 4 slots: batched steps, a queue
        choices = list(pool.map(one, range(6)))
    for ch in choices:
        assert ch.finish_reason == "stop", ch.message.content
        assert isinstance(ch.message.parsed, Pet)
        Pet.model_validate_json(ch.message.content)  # pydantic's own validation, not the grammar engine's
    assert len({ch.message.content for ch in choices}) > 1  # sampled, not one fixed answer
    # streamed: the pieces join into a valid document; greedy twice gives the same (the second from the cache)
    texts = []
    for _ in range(2):
        chunks = c.chat.completions.create(
            model=name,
            messages=_msgs(),
            max_tokens=80,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True},
            },
        )
        chunks = list(chunks)
        texts.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
        Pet.model_validate_json(texts[-1])
    assert texts[0] == texts[1]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens  # the cache
    # json_object on a prompt whose free reply is not JSON
    r = c.chat.completions.create(
        model=name, messages=_msgs(), max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    free = c.chat.completions.create(model=name, messages=_msgs(), max_tokens=80, temperature=0)
    assert r.choices[0].message.content.startswith("{") and not free.choices[0].message.content.startswith(
        "{"
    )


def test_required_and_named_tool_calls_follow_the_schema_streamed_and_fed_back(server, arts):
    c = server.client()
    name = arts[0].name
    r = c.chat.completions.create(
        model=name, messages=_msgs("weather?"), tools=[WEATHER, TIME], tool_choice="required", max_tokens=150
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome", "Oslo") and isinstance(args["celsius"], bool)
    else:
        assert call.function.name == "get_time" and len(args["zone"]) <= 4
    # a named function, streamed: the call arrives as tool_calls deltas, no content
    chunks = list(
        c.chat.completions.create(
            model=name,
            messages=_msgs("time?"),
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=150,
            temperature=0.8,
            seed=3,
            stream=True,
        )
    )
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_time"] and deltas[0].id
    assert len(json.loads(deltas[0].function.arguments)["zone"]) <= 4
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the second step: the call and its result go back, the model answers in text
    turn2 = [
        *_msgs("weather?"),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r2 = c.chat.completions.create(
        model=name, messages=turn2, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8
    )
    assert r2.choices[0].finish_reason == "length" and r2.choices[0].message.tool_calls is None
    # the tool result is in the prompt: it is longer than the same conversation with an empty result
    turn2_empty = [*turn2[:2], {**turn2[2], "content": ""}]
    r3 = c.chat.completions.create(
        model=name, messages=turn2_empty, tool_choice="none", tools=[WEATHER], max_tokens=1
    )
    assert r2.usage.prompt_tokens > r3.usage.prompt_tokens


def test_tools_go_through_a_template_with_a_tools_section_as_transformers_renders_them(arts):
    from transformers import PreTrainedTokenizerFast

    _, art, ckpt = arts
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    messages = [*_msgs("weather?"), {"role": "assistant", "content": None, "tool_calls": [call]}]
    hf_messages = [
        messages[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
        },
    ]
    want = tok.apply_chat_template(hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    s = start_server(art)
    try:
        r = s.client().chat.completions.create(
            model=art.name, messages=messages, tools=[WEATHER], max_tokens=1, temperature=0
        )
    finally:
        s.stop()
    assert r.usage.prompt_tokens == len(want)


def _session_logprobs(art, prompt_ids, tokens):
    """log-softmax of the artifact's logits after the prompt and after each token, from Session (float64)."""
    from edgeattn.runtimes import open_session

    sess = open_session(art)
    logits = [sess.prefill(np.array([prompt_ids], np.int64))[0]]
    for t in tokens[:-1]:
        logits.append(sess.step(np.array([[t]], np.int64))[0])
    out = []
    for x in logits:
        x = np.asarray(x, np.float64)
        out.append(x - (x.max() + np.log(np.exp(x - x.max()).sum())))
    return out


def test_logprobs_equal_the_log_softmax_of_the_sessions_logits(server, arts):
    from edgeattn.runtimes import open_session

    art = arts[0]
    tok = open_session(art).tokenizer
    c = server.client()
    prompt = "def main(args):\n    return"
    ids = tok.encode(prompt)
    r = c.completions.create(model=art.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    # greedy: each token is the most likely one, its logprob the maximum; the top 3 are the 3 largest
    ref = _session_logprobs(art, ids, _greedy(art, ids, 6))
    for i in range(6):
        assert lp.token_logprobs[i] == pytest.approx(ref[i].max(), abs=1e-4)
        top3 = np.sort(ref[i])[::-1][:3]  # a dict by token text: tokens with the same text share a key
        assert all(np.abs(top3 - v).min() < 1e-4 for v in lp.top_logprobs[i].values())
    # chat, sampled: each reported logprob is the raw model's for the sampled token
    r = c.chat.completions.create(
        model=art.name, messages=_msgs(), max_tokens=5, temperature=1.0, seed=5, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= -1e9
    # echo with max_tokens 0 scores the prompt: token i's logprob given tokens < i (lm-evaluation-harness)
    r = c.completions.create(model=art.name, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) and lp.token_logprobs[0] is None
    ref = _session_logprobs(art, ids[:1], ids[1:])
    want = [ref[i][ids[i + 1]] for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def _greedy(art, ids, n):
    from tests.serve_helpers import greedy_ids

    return greedy_ids(art, ids, n)


def test_bad_schemas_tools_and_choices_are_400_naming_the_field(server, arts):
    import httpx

    name = arts[0].name
    base = {"model": name, "messages": _msgs(), "max_tokens": 4}
    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "regex"}}, "response_format"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "description": "x" * 100_001}},
                }
            },
            "response_format.json_schema.schema",
        ),  # over MAX_SCHEMA_CHARS
        ({"tools": "get_weather"}, "tools"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ]
    for extra, param in cases:
        r = httpx.post(server.url + "/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (
            extra,
            err,
        )
    r = httpx.post(
        server.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 0}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert httpx.get(server.url + "/health").status_code == 200


def test_byte_level_model_json_object(serve_gla):
    s = start_server(serve_gla)
    try:
        r = s.client().chat.completions.create(
            model=serve_gla.name,
            messages=_msgs(),
            max_tokens=60,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "p",
                    "schema": {
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"],
                        "additionalProperties": False,
                    },
                },
            },
        )
    finally:
        s.stop()
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


def test_tool_call_markup_parsing_and_streamed_hold_back():
    from edgeattn.serve.tools import could_begin_call, parse_calls

    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g"}'
    content, calls = parse_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert parse_calls("no call here") == ("no call here", [])
    # Qwen3-Coder's / Qwen3.5's XML form inside the block
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_calls(xml)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 3})
    ]
    assert parse_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert (
        could_begin_call("hello <tool") == 6
        and could_begin_call("hello") == -1
        and could_begin_call("a<tool_call>") == 1
    )


def test_streamed_auto_reply_splits_content_and_tool_call_deltas():
    """``tool_choice`` auto, streamed: the text before the markup goes out as content as it comes, the
    markup never does, and the call goes out as a tool_calls delta (the HTTP layer's event generator over
    a stand-in handle: a random model does not write the markup by itself)."""
    import asyncio

    from edgeattn.serve.app import _events, _Job

    pieces = [
        "Sure",
        ", checking.",
        "\n<tool",
        "_call>\n",
        '{"name": "get_weather", ',
        '"arguments": {"city": "Rome"}}',
        "\n</tool_call>",
    ]

    class Handle:
        finish_reason = "stop"
        recorder = None
        completion_tokens = len(pieces)

        def __aiter__(self):
            async def gen():
                for p in pieces:
                    yield p

            return gen()

        def cancel(self):
            pass

    job = _Job(None)
    job.tools = True

    async def collect():
        return [e["data"] async for e in _events(Handle(), "id", 0, "m", True, False, job)]

    events = asyncio.run(collect())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
    assert content == "Sure, checking.\n"
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    assert chunks[-1]["finish_reason"] == "tool_calls"
