"""The HTTP layer of `edgeattn serve`: OpenAI's API translated to and from the engine, nothing more.

    app = create_app(engine, model_name="gla", api_key=None)   # a FastAPI app; uvicorn or Ray Serve runs it

Routes: ``GET /health`` (no key), ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(server-sent events when ``stream``; ``stream_options.include_usage`` adds OpenAI's last chunk with the
usage and no choices), ``GET /metrics`` (Prometheus text), ``GET /`` (the chat page, no key: its requests
carry it). Request and response bodies mirror OpenAI's schema (pydantic); unknown request fields are
ignored as OpenAI ignores them. Errors carry OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 malformed JSON or bad values (types strictly: ``true`` is no integer; a lone surrogate is no
text), or a Host header the server does not answer to (``allowed_hosts``: DNS rebinding), 401 a missing or
wrong key, 404 an unknown model or route, 413 a body over ``max_body_bytes``, 429 (``Retry-After``) every
slot and the queue full, 500 a failure of this request alone (the others go on), 503 while shutting down.
Bodies are parsed, validated, templated and tokenized in a worker thread (``_parse``), never on the loop.

Chat prompts: the artifact's chat template; a model without one (edgeattn's own byte-level models) gets the
plain default ``"{role}: {content}\\n"`` per message followed by ``"assistant: "``, so that the next turn's
prompt extends this turn's prompt and reply (and resumes from the cached state).

``response_format`` (``json_object``, ``json_schema``) is enforced while decoding by a grammar
(edgeattn.serve.grammar); ``tools`` / ``tool_choice`` are rendered into the prompt and the reply's calls parsed
into ``tool_calls`` (edgeattn.serve.tools); ``logprobs`` / ``top_logprobs`` and ``echo`` report the artifact's
own log-probabilities (edgeattn.serve.logprobs). A schema, tool or grammar that cannot be enforced is a 400
naming the field, never an unconstrained answer. Fields that would change the answer and that edgeattn does
not implement (``best_of``, ``suffix``, penalties) are refused with 400 naming them, never ignored;
``logit_bias`` is OpenAI's (``edgeattn.runtimes.sampling.apply_logit_bias``). Defaults as OpenAI's: ``max_tokens`` 16 for completions, ``temperature`` 1, ``top_p`` 1; chat completions
without ``max_tokens`` stop after ``DEFAULT_CHAT_MAX_TOKENS``. Extensions (``extra_body`` in the
``openai`` client): ``top_k`` (0: off) and, as vLLM's server has it, ``ignore_eos`` (for benchmarks) and
``cache_salt`` (requests share cached prefix states only with requests of the same salt: without one, any
client's ``cached_tokens`` can tell whether another sent a prompt).

Chat requests also cache the state where the first message after the system prompt and where the last
message begin (``chat_boundaries``), so that another user with the same system prompt, or the same
conversation with its last message edited, resumes from there.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import threading
import time
import uuid
from importlib import resources
from typing import Annotated, Literal

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from edgeattn.serve import logprobs as lp
from edgeattn.serve import tools as fc
from edgeattn.serve.engine import Engine, QueueFull, ShuttingDown
from edgeattn.serve.engine import Request as EngineRequest
from edgeattn.serve.grammar import GrammarError, Grammars
from edgeattn.serve.logprobs import MAX_TOP_LOGPROBS

DEFAULT_CHAT_MAX_TOKENS = 256
SHUTDOWN_DRAIN_S = 5.0  # in-flight streams may finish this long after SIGTERM, then end
DEFAULT_MAX_BODY_MB = 8.0  # a request body beyond this is refused (413) before it is read whole
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI takes 4), each at most MAX_STOP_CHARS characters:
MAX_STOP_CHARS = 128  # each generated token is matched against every one of them on the event loop
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


# ---- OpenAI's request bodies (the fields edgeattn reads; others are accepted and ignored) ----


def _unicode(text: str) -> str:
    """Refuse a lone surrogate (JSON's ``"\\ud800"``): it is no character and has no UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Body(BaseModel):
    # strict: true, "yes", 1.0 are not coerced into max_tokens, stream or a token id; they are refused
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: Text
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    # accepted only at the values that change nothing, refused otherwise (never silently ignored)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do (None: all fine)."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        return None

    def top_logprobs_count(self) -> int | None:
        """How many top logprobs per token to report (None: no logprobs)."""
        return None


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"part {i} is of type {kind!r}: this server takes text only (no images, audio or files)"
                    )
        return content

    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to a call
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    tool_choice: str | dict | None = None

    def top_logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


# ---- errors ----


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code=None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(
    status: int, message: str, type_: str, param=None, code=None, headers=None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


# ---- prompts ----


def chat_prompt(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation (see the module docstring), with ``tools`` as
    ``edgeattn.serve.tools.render_messages`` renders them."""
    plain = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.role == "tool" and (m.tool_call_id or m.name):
            d.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
        plain.append(d)
    native = fc.template_reads_tools(tokenizer.chat_template)
    plain, tools = fc.render_messages(plain, tools or [], native)
    if tokenizer.chat_template:
        if tools:
            from edgeattn.artifact.chat_template import render_chat_template

            return render_chat_template(
                tokenizer.chat_template,
                messages=plain,
                tools=tools,
                add_generation_prompt=True,
                bos_token=tokenizer.token_text(tokenizer.bos_token_id),
                eos_token=tokenizer.token_text(
                    tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
                ),
            )
        return tokenizer.apply_chat_template(plain)
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant: "


def _host_name(host: str) -> str:
    """The name in a Host header, without its port (``[::1]:8000`` -> ``::1``), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def allowed_hosts(host: str, extra=()) -> list[str] | None:
    """The Host header names a server bound to ``host`` answers to (None: any). A loopback address answers
    to loopback names only, so that a web page whose name resolves to 127.0.0.1 (DNS rebinding) cannot
    reach it from the browser; a specific address to itself as well; a wildcard (0.0.0.0, ::) to any name.
    ``extra`` adds names; ``*`` among them allows any."""
    extra = [_host_name(h) if h != "*" else h for h in extra]
    if "*" in extra:
        return None
    host = _host_name(host)
    if host in ("0.0.0.0", "::", ""):
        return None if not extra else [*LOOPBACK_NAMES, *extra]
    return sorted({*LOOPBACK_NAMES, host, *extra})


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (by its Content-Length before any of
    it is read, or as soon as a chunked body passes the bound), never held whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, int(limit)

    def _message(self, n: str) -> str:
        return f"the request body is {n} bytes, over this server's {self.limit} (--max-body-mb)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            body = {
                "error": {
                    "message": self._message(length.decode()),
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
            return await JSONResponse(body, 413, headers={"connection": "close"})(scope, receive, send)
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._message(f"more than {self.limit}"))
            return message

        return await self.app(scope, bounded, send)


def chat_boundaries(tokenizer, messages: list[Message], text: str, ids: list[int]) -> list[int]:
    """Token counts in ``ids`` (``text`` encoded: the prompt of ``messages``) where the content of the first
    message after the system prompt and the content of the last message begin: what another user with the
    same system prompt, or this conversation with its last message edited, shares with this prompt. Found
    as the contents' places in ``text`` (no second render of the template: a content that the template
    changed is not found and gives no boundary), as many tokens as ``text`` up to there encodes to in
    common with ``ids``. Any prefix of ``ids`` is a right place to cache a state: a wrong guess costs
    memory, never text."""
    first = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    places = []
    if 0 < first < len(messages) and messages[first].text():
        system = messages[first - 1].text()
        at = text.find(system)
        if at >= 0:
            places.append(text.find(messages[first].text(), at + len(system)))
    if len(messages) > 1 and messages[-1].text():
        places.append(text.rfind(messages[-1].text()))
    out = []
    for at in sorted({p for p in places if p > 0}):
        prefix = tokenizer.encode(text[:at])
        n = min(len(prefix), len(ids))
        differ = np.flatnonzero(np.asarray(prefix[:n]) != np.asarray(ids[:n]))
        out.append(int(differ[0]) if differ.size else n)
    return out


def create_app(
    engine: Engine,
    model_name: str,
    api_key: str | None = None,
    manage_engine: bool = True,
    *,
    hosts: list[str] | None = None,
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20),
    metrics=None,
) -> FastAPI:
    """The FastAPI app over ``engine``. With ``manage_engine`` the app's lifespan starts and stops it.
    ``hosts``: the Host header names it answers to (``allowed_hosts``; None: any); ``max_body_bytes``: the
    largest request body (413 beyond); ``metrics``: an async function giving ``GET /metrics``' text (None:
    ``prometheus(engine)``; the Ray deployment's gives the total over its replicas)."""
    from contextlib import asynccontextmanager

    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty: nobody could use the server")

    @asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            await engine.start()
        # llguidance's view of the tokenizer (~1 s at 49,152 tokens, more for larger ones), built off the
        # event loop before the first structured request or logprobs need it
        threading.Thread(target=grammars.warm, daemon=True, name="edgeattn-grammar").start()
        yield
        if manage_engine:
            await engine.stop(SHUTDOWN_DRAIN_S)

    app = FastAPI(title="edgeattn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    grammars = Grammars(engine.tokenizer, engine.manifest.vocab_size)
    created = int(time.time())
    open_paths = {"/health", "/", "/chat.js", "/favicon.ico"}

    @app.middleware("http")
    async def auth(request: Request, call_next):
        host = _host_name(request.headers.get("host", ""))
        if hosts is not None and host not in hosts:
            engine.metrics["foreign_host"] += 1
            return error_response(
                400,
                f"this server does not answer to the Host {host!r} (it answers to {', '.join(hosts)}: "
                "see --allowed-host)",
                "invalid_request_error",
                code="invalid_host",
            )
        if api_key is not None and request.url.path not in open_paths:
            header = request.headers.get("authorization", "")
            if not hmac.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
                what = "no API key" if not header else "an incorrect API key"
                return error_response(
                    401,
                    f"the request carries {what}: send 'Authorization: Bearer KEY'",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        return await call_next(request)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(GrammarError)
    async def _grammar_error(request, e: GrammarError):
        return error_response(400, str(e), "invalid_request_error", e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        # a union's members each fail; one of our own checks (a "value_error") says the most
        first = next((x for x in errors if x.get("type") == "value_error"), errors[0] if errors else {})
        # a union's member names (str, list[int], function-after[...]) are no part of the field's path
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", "invalid_request_error")
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        if loc[:1] == ["prompt"] and first.get("type") != "value_error" and len(errors) > 1:
            loc, msg = (
                ["prompt"],
                "must be a string, a list of token ids (integers), or a list of one of them",
            )
        message = f"{'.'.join(loc) or 'body'}: {msg}"
        return error_response(400, message, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = (
            f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        )
        return error_response(e.status_code, message, kind)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine.stopping:
            return error_response(503, "the server is shutting down", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        _check_model(name, model_name)
        return _model_card(model_name, created)

    @app.get("/metrics")
    async def metrics_route():
        text = prometheus(engine) if metrics is None else await metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(_static("index.html"))

    @app.get("/chat.js")
    async def page_js():
        return Response(_static("chat.js"), media_type="text/javascript")

    # in _parse's worker thread: the prompt's ids, its chat boundaries and what the new fields add (_Job)
    def completion_ids(body: CompletionRequest) -> tuple[list[int], list[int], _Job]:
        _check_model(body.model, model_name)
        ids = _completion_ids(engine, body.prompt)
        if body.max_tokens == 0 and not body.echo:
            raise _bad("max_tokens must be >= 1 (0 only with echo: the prompt scored)", "max_tokens")
        job = _Job(grammars, _constraint(grammars, grammars.response_format(body.response_format)))
        if body.echo:
            job.echo_ids = ids
        return ids, [], job

    def chat_ids(body: ChatRequest) -> tuple[list[int], list[int], _Job]:
        _check_model(body.model, model_name)
        tools, choice = fc.check_tools(body.tools, body.tool_choice)
        grammar = grammars.response_format(body.response_format)
        if choice == "required" or isinstance(choice, dict):
            if grammar is not None:
                raise _bad("give response_format or a required tool call, not both", "response_format")
            grammar = fc.call_grammar(grammars, tools, choice)
        job = _Job(grammars, _constraint(grammars, grammar, "tools" if tools else "response_format"))
        job.tools = choice != "none"
        try:
            text = chat_prompt(engine.tokenizer, body.messages, tools if job.tools else None)
            ids = engine.tokenizer.encode(text)
            ends = chat_boundaries(engine.tokenizer, body.messages, text, ids) if engine.cache.enabled else []
        except GrammarError:
            raise
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        if body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens or DEFAULT_CHAT_MAX_TOKENS
        return ids, ends, job

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, req, job = await _parse(engine, request, CompletionRequest, completion_ids)
        top = body.top_logprobs_count()
        if job.echo_ids is not None and top is not None:
            job.echo_logprobs = await engine.prompt_logprobs(job.echo_ids, top)
        return await _run(engine, request, body, req, model_name, chat=False, job=job)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, req, job = await _parse(engine, request, ChatRequest, chat_ids)
        return await _run(engine, request, body, req, model_name, chat=True, job=job)

    return app


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|function-\w+)(\[.*\])?$")


async def _parse(engine: Engine, request: Request, model, prompt_ids):
    """The request body as ``model``, the engine request it makes and its ``_Job``, parsed, validated,
    templated, tokenized, its grammar compiled and checked in a worker thread: the event loop stays free for other clients (/health) however
    large the body (within --max-body-mb) or slow the chat template."""
    raw = await request.body()

    def work():
        try:
            data = json.loads(raw)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            raise APIError(400, "the request body is not valid JSON", "invalid_request_error") from None
        if not isinstance(data, dict):
            raise _bad("the request body must be a JSON object")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        field = body.unsupported()
        if field is not None:
            raise _bad(f"{field} is not supported by this server (edgeattn serve)", field)
        ids, boundaries, job = prompt_ids(body)
        req = _engine_request(body, ids, boundaries, job)
        try:
            engine.check(req)
        except ValueError as e:
            raise _bad(str(e), _param_of(str(e))) from None
        return body, req, job

    return await anyio.to_thread.run_sync(work, limiter=_parsers())


_PARSERS: dict = {}


def _parsers() -> anyio.CapacityLimiter:
    """One parser thread per event loop: parsing holds the GIL in long C calls (json, pydantic), so more
    threads would only queue the loop behind them; a body waits for the one before it instead."""
    loop = asyncio.get_running_loop()
    if loop not in _PARSERS:
        _PARSERS.clear()
        _PARSERS[loop] = anyio.CapacityLimiter(1)
    return _PARSERS[loop]


_PARAMS = ("logit_bias", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def _param_of(message: str) -> str | None:
    """The request field an engine's ValueError is about (its messages begin with the field's name)."""
    for name in _PARAMS:
        if message.startswith(name):
            return name
    return "prompt" if "prompt" in message or "token ids" in message else None


def _static(name: str) -> str:
    return resources.files("edgeattn.serve").joinpath("static", name).read_text(encoding="utf-8")


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "edgeattn"}


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _completion_ids(engine: Engine, prompt) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:  # one prompt in a list, as text or ids
        return _completion_ids(engine, prompt[0])
    raise _bad("give one prompt per request (a string or a list of token ids)", "prompt")


class _Job:
    """What the new features add to one request: its grammar, tools, echo and logprobs."""

    def __init__(self, grammars: Grammars, constraint=None):
        self.grammars = grammars
        self.constraint = constraint
        self.tools = False  # parse the reply's tool-call markup
        self.echo_ids: list[int] | None = None
        self.echo_logprobs: list | None = None


def _constraint(grammars: Grammars, grammar: str | None, param: str = "response_format"):
    """The request's grammar matcher (compiled in the request parser's worker thread, off the event loop:
    a large schema takes a while)."""
    return None if grammar is None else grammars.constraint(grammar, param)


def _engine_request(
    body: _Sampling, ids: list[int], boundaries: list[int] = (), job: _Job | None = None
) -> EngineRequest:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise _bad("stop strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        longest = max(len(s) for s in stop)
        raise _bad(f"stop strings take at most {MAX_STOP_CHARS} characters, got {longest}", "stop")
    return EngineRequest(
        constraint=job.constraint if job else None,
        logprobs=body.top_logprobs_count(),
        prompt_ids=ids,
        max_tokens=body.max_tokens or 16,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logit_bias=body.logit_bias,
        cache_salt=body.cache_salt,
        boundaries=list(boundaries),
    )


def _submit(engine: Engine, req: EngineRequest):
    try:
        return engine.submit(req)
    except QueueFull as e:
        raise APIError(
            429, str(e), "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}
        ) from None
    except ShuttingDown as e:
        raise APIError(503, str(e), "server_error", code="shutting_down") from None
    except ValueError as e:
        raise _bad(str(e), _param_of(str(e))) from None


def _usage(h) -> dict:
    u = h.usage
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["completion_tokens"],
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
    }


async def _run(
    engine: Engine, request: Request, body: _Sampling, req, model_name: str, chat: bool, job: _Job
):
    top = body.top_logprobs_count()
    if job.echo_ids is not None and body.max_tokens == 0:  # the prompt scored, nothing generated
        return _echo_only(engine, job, req.prompt_ids, model_name, top)
    h = _submit(engine, req)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(
            _events(h, rid, created, model_name, chat, usage, job),
            sep="\n",
            shutdown_event=anyio.Event(),
            shutdown_grace_period=SHUTDOWN_DRAIN_S + 2,
        )
    try:
        text = await _collect(h, request)
    except Exception:  # the engine ended it with an error (ShuttingDown while queued): answered below
        if h.error is None:
            raise
    if h.error is not None:
        if isinstance(h.error, ShuttingDown):
            raise APIError(503, str(h.error), "server_error", code="shutting_down")
        raise APIError(500, str(h.error), "server_error")
    entries = h.recorder.entries[: h.completion_tokens] if h.recorder is not None else None
    if chat:
        message: dict = {"role": "assistant", "content": text}
        finish = h.finish_reason
        if job.tools:
            content, calls = fc.parse_calls(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None
            if entries is None
            else {"content": lp.chat_content(entries, job.grammars.token_bytes)},
            "finish_reason": finish,
        }
    else:
        logprobs = None
        if job.echo_ids is not None:
            prefix = engine.tokenizer.decode(job.echo_ids)
            text = prefix + text
            if entries is not None:
                entries = job.echo_logprobs + entries
        if entries is not None:
            logprobs = lp.completion_logprobs(entries, job.grammars.token_bytes)
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": h.finish_reason}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model_name,
        "choices": [choice],
        "usage": _usage(h),
    }


async def _collect(h, request: Request) -> str:
    """The whole reply; the request ends early (its slot freed) if the client disconnects."""
    task = asyncio.ensure_future(h.text())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                h.cancel()
    finally:
        if not task.done():
            h.cancel()


def _echo_only(engine: Engine, job: _Job, ids, model_name: str, top: int | None) -> dict:
    """A completion with ``echo`` and ``max_tokens`` 0: the prompt (and its logprobs), nothing generated."""
    logprobs = None
    if job.echo_logprobs is not None:
        logprobs = lp.completion_logprobs(job.echo_logprobs, job.grammars.token_bytes)
    usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    return {
        "id": "cmpl-" + uuid.uuid4().hex[:24],
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "text": engine.tokenizer.decode(ids),
                "logprobs": logprobs,
                "finish_reason": "length",
            }
        ],
        "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 0}},
    }


async def _events(
    h, rid: str, created: int, model_name: str, chat: bool, include_usage: bool, job: _Job | None = None
):
    """OpenAI's chunks as SSE ``data:`` events, ending with ``[DONE]``; a vanished client cancels ``h``.
    With tools, content is held back from where a call's markup may begin and the calls go out as
    ``tool_calls`` deltas at the end; with logprobs each chunk carries those of the tokens delivered since
    the last one."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    job = job or _Job(None)
    sent = 0  # logprob entries handed out

    def logprobs(final: bool = False):
        nonlocal sent
        if h.recorder is None:
            return None
        entries = h.recorder.entries[sent : h.completion_tokens]
        sent += len(entries)
        if chat:
            return {"content": lp.chat_content(entries, job.grammars.token_bytes)}
        return lp.completion_logprobs(entries, job.grammars.token_bytes)

    def chunk(piece: str | None, finish: str | None = None, first: bool = False, delta=None) -> dict:
        if chat:
            if delta is None:
                delta = (
                    {"role": "assistant", "content": ""}
                    if first
                    else ({} if piece is None else {"content": piece})
                )
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None if first else logprobs(),
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": logprobs(), "finish_reason": finish}
        out = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return {"data": json.dumps(out)}

    try:
        if chat:
            yield chunk(None, first=True)
        elif job.echo_ids is not None:
            if job.echo_logprobs is not None:
                entries = job.echo_logprobs
                choice = {
                    "index": 0,
                    "text": engine_text(h, job.echo_ids),
                    "logprobs": lp.completion_logprobs(entries, job.grammars.token_bytes),
                    "finish_reason": None,
                }
                yield {
                    "data": json.dumps(
                        {
                            "id": rid,
                            "object": kind,
                            "created": created,
                            "model": model_name,
                            "choices": [choice],
                        }
                    )
                }
            else:
                yield chunk(engine_text(h, job.echo_ids))
        text, held = "", 0  # with tools: the reply so far, and how much of it went out as content
        try:
            async for piece in h:
                if not job.tools:
                    yield chunk(piece)
                    continue
                text += piece
                cut = fc.could_begin_call(text)
                upto = len(text) if cut < 0 else cut
                if upto > held:
                    yield chunk(text[held:upto])
                    held = upto
        except Exception as e:  # the engine failed or shut down before this request ran
            err = {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}
            yield {"data": json.dumps(err)}
            return
        finish = h.finish_reason
        if job.tools:
            content, calls = fc.parse_calls(text)
            if calls:
                for i, c in enumerate(calls):
                    delta = {"tool_calls": [{"index": i, **c}]}
                    yield chunk(None, delta=delta)
                finish = "tool_calls"
            elif len(text) > held:
                yield chunk(text[held:])
        yield chunk(None, finish=finish)
        if include_usage:
            last = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": []}
            last["usage"] = _usage(h)
            yield {"data": json.dumps(last)}
        yield {"data": "[DONE]"}
    finally:
        h.cancel()  # a no-op once finished; frees the slot when the client went away


def engine_text(h, ids) -> str:
    return h.engine.tokenizer.decode(ids)


def prometheus(engine: Engine) -> str:
    """The engine's counters and gauges in Prometheus' text format."""
    return prometheus_text(metric_rows(engine))


def metric_rows(engine: Engine) -> list[tuple[str, str, str, int]]:
    """The engine's counters and gauges: ``(name, "counter" or "gauge", help, value)``."""
    m, c = engine.metrics, engine.cache
    rows = [
        ("edgeattn_requests_total", "counter", "Requests accepted.", m["requests"]),
        ("edgeattn_requests_rejected_total", "counter", "Requests refused with 429.", m["rejected"]),
        (
            "edgeattn_prompt_tokens_total",
            "counter",
            "Prompt tokens of accepted requests.",
            m["prompt_tokens"],
        ),
        ("edgeattn_completion_tokens_total", "counter", "Tokens generated.", m["completion_tokens"]),
        (
            "edgeattn_cached_tokens_total",
            "counter",
            "Prompt tokens resumed from the prefix cache.",
            m["cached_tokens"],
        ),
        ("edgeattn_steps_total", "counter", "Batched step-graph calls.", m["steps"]),
    ]
    spec = getattr(engine, "speculative_stats", None)
    if spec is not None:  # --speculative: drafts and the drafts kept, over every stream
        rows += [
            (
                "edgeattn_speculative_drafted_total",
                "counter",
                "Tokens drafted (--speculative).",
                spec.drafted,
            ),
            ("edgeattn_speculative_accepted_total", "counter", "Drafted tokens kept.", spec.accepted),
        ]
    rows += [
        (
            "edgeattn_requests_timed_out_total",
            "counter",
            "Requests ended by --max-request-seconds.",
            m["timed_out"],
        ),
        (
            "edgeattn_requests_failed_total",
            "counter",
            "Requests ended by an error of their own.",
            m["failed"],
        ),
        (
            "edgeattn_read_timeouts_total",
            "counter",
            "Connections closed because a request did not arrive in --read-timeout.",
            m["read_timeouts"],
        ),
        (
            "edgeattn_write_timeouts_total",
            "counter",
            "Connections closed because the client read nothing for --write-timeout.",
            m["write_timeouts"],
        ),
        (
            "edgeattn_foreign_host_total",
            "counter",
            "Requests refused for a Host header the server does not answer to.",
            m["foreign_host"],
        ),
        ("edgeattn_active_slots", "gauge", "Requests prefilling or decoding.", engine.active),
        ("edgeattn_slots", "gauge", "Slots (streams in one batch).", engine.slots),
        ("edgeattn_queue_depth", "gauge", "Requests waiting for a slot.", engine.queued),
        (
            "edgeattn_cache_enabled",
            "gauge",
            "1 while the prefix cache holds states, 0 when it is off.",
            int(c.enabled),
        ),
        (
            "edgeattn_cache_hits_total",
            "counter",
            "Prompts that resumed from a cached prefix.",
            m["cache_hits"],
        ),
        (
            "edgeattn_cache_misses_total",
            "counter",
            "Prompts with no cached prefix (every prompt when the cache is off).",
            m["cache_misses"],
        ),
        ("edgeattn_cache_bytes", "gauge", "Bytes of state held in memory by the prefix cache.", c.bytes),
        (
            "edgeattn_cache_disk_bytes",
            "gauge",
            "Bytes of state files held on disk by the prefix cache.",
            c.disk_bytes,
        ),
        ("edgeattn_cache_entries", "gauge", "Prefix-cache entries (memory and disk).", len(c)),
    ]
    return rows


def prometheus_text(rows) -> str:
    """``(name, kind, help, value)`` rows in Prometheus' text format."""
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


__all__ = ["create_app", "chat_prompt", "prometheus", "metric_rows", "prometheus_text"]
