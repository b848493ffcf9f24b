"""The HTTP layer of `edgeattn serve`: OpenAI's API translated to and from the engine, nothing more.

    app = create_app(engine, model_name="gla", api_key=None)   # a FastAPI app; uvicorn or Ray Serve runs it

Routes: ``GET /health`` (no key), ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(server-sent events when ``stream``; ``stream_options.include_usage`` adds OpenAI's last chunk with the
usage and no choices), ``GET /metrics`` (Prometheus text), ``GET /`` (the chat page, no key: its requests
carry it). Request and response bodies mirror OpenAI's schema (pydantic); unknown request fields are
ignored as OpenAI ignores them. Errors carry OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 malformed JSON or bad values, 401 a missing or wrong key, 404 an unknown model or route,
429 (``Retry-After``) every slot and the queue full, 503 while shutting down.

Chat prompts: the artifact's chat template; a model without one (edgeattn's own byte-level models) gets the
plain default ``"{role}: {content}\\n"`` per message followed by ``"assistant: "``, so that the next turn's
prompt extends this turn's prompt and reply (and resumes from the cached state).

``response_format`` (``json_object``, ``json_schema``) is enforced while decoding by a grammar
(edgeattn.serve.grammar); ``tools`` / ``tool_choice`` are rendered into the prompt and the reply's calls parsed
into ``tool_calls`` (edgeattn.serve.tools); ``logprobs`` / ``top_logprobs`` and ``echo`` report the artifact's
own log-probabilities (edgeattn.serve.logprobs). A schema, tool or grammar that cannot be enforced is a 400
naming the field, never an unconstrained answer. Fields that would change the answer and that edgeattn does
not implement (``best_of``, ``suffix``, penalties) are refused with 400 naming them, never ignored. Defaults as OpenAI's: ``max_tokens`` 16 for completions, ``temperature`` 1, ``top_p`` 1; chat completions
without ``max_tokens`` stop after ``DEFAULT_CHAT_MAX_TOKENS``. Extensions (``extra_body`` in the
``openai`` client): ``top_k`` (0: off) and, as vLLM's server has it, ``ignore_eos`` (for benchmarks).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from importlib import resources
from typing import Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
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


# ---- OpenAI's request bodies (the fields edgeattn reads; others are accepted and ignored) ----


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
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
    prompt: str | list[int] | list[str] | list[list[int]]
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
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
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


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, manage_engine: bool = True
) -> FastAPI:
    """The FastAPI app over ``engine``. With ``manage_engine`` the app's lifespan starts and stops it."""
    from contextlib import asynccontextmanager

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
    grammars = Grammars(engine.tokenizer, engine.manifest.vocab_size)
    created = int(time.time())
    open_paths = {"/health", "/", "/chat.js", "/favicon.ico"}

    @app.middleware("http")
    async def auth(request: Request, call_next):
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
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", "invalid_request_error")
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(400, message, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = (
            f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        )
        return error_response(e.status_code, message, kind)

    @app.get("/health")
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
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(_static("index.html"))

    @app.get("/chat.js")
    async def page_js():
        return Response(_static("chat.js"), media_type="text/javascript")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_name)
        ids = _completion_ids(engine, body.prompt)
        if body.max_tokens == 0 and not body.echo:
            raise _bad("max_tokens must be >= 1 (0 only with echo: the prompt scored)", "max_tokens")
        job = _Job(grammars, await _constraint(grammars, grammars.response_format(body.response_format)))
        if body.echo:
            job.echo_ids = ids
            top = body.top_logprobs_count()
            if top is not None:
                engine.check(EngineRequest(prompt_ids=ids))
                job.echo_logprobs = await engine.prompt_logprobs(ids, top)
        return await _run(engine, request, body, ids, model_name, chat=False, job=job)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model, model_name)
        tools, choice = fc.check_tools(body.tools, body.tool_choice)
        grammar = grammars.response_format(body.response_format)
        if choice == "required" or isinstance(choice, dict):
            if grammar is not None:
                raise _bad("give response_format or a required tool call, not both", "response_format")
            grammar = await anyio.to_thread.run_sync(fc.call_grammar, grammars, tools, choice)
        job = _Job(grammars, await _constraint(grammars, grammar, "tools" if tools else "response_format"))
        job.tools = choice != "none"
        try:
            text = chat_prompt(engine.tokenizer, body.messages, tools if job.tools else None)
        except GrammarError:
            raise
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        if body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens or DEFAULT_CHAT_MAX_TOKENS
        ids = engine.tokenizer.encode(text)
        return await _run(engine, request, body, ids, model_name, chat=True, job=job)

    return app


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


async def _constraint(grammars: Grammars, grammar: str | None, param: str = "response_format"):
    """The request's grammar matcher, compiled off the event loop (a large schema takes a while)."""
    return None if grammar is None else await anyio.to_thread.run_sync(grammars.constraint, grammar, param)


def _engine_request(body: _Sampling, ids: list[int], job: _Job | None = None) -> EngineRequest:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
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
        param = "prompt" if "prompt" in str(e) or "token ids" in str(e) else None
        raise _bad(str(e), param) from None


def _usage(h) -> dict:
    u = h.usage
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["completion_tokens"],
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
    }


async def _run(
    engine: Engine, request: Request, body: _Sampling, ids, model_name: str, chat: bool, job: _Job
):
    field = body.unsupported()
    if field is not None:
        raise _bad(f"{field} is not supported by this server (edgeattn serve)", field)
    top = body.top_logprobs_count()
    if job.echo_ids is not None and body.max_tokens == 0:  # the prompt scored, nothing generated
        return _echo_only(engine, job, ids, model_name, top)
    h = _submit(engine, _engine_request(body, ids, job))
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
    text = await _collect(h, request)
    if h.error is not None:
        raise APIError(503 if isinstance(h.error, ShuttingDown) else 500, str(h.error), "server_error")
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
        ("edgeattn_active_slots", "gauge", "Requests prefilling or decoding.", engine.active),
        ("edgeattn_slots", "gauge", "Slots (streams in one batch).", engine.slots),
        ("edgeattn_queue_depth", "gauge", "Requests waiting for a slot.", engine.queued),
        ("edgeattn_cache_hits_total", "counter", "Prompts that resumed from a cached prefix.", c.hits),
        ("edgeattn_cache_misses_total", "counter", "Prompts with no cached prefix.", c.misses),
        ("edgeattn_cache_bytes", "gauge", "Bytes of state held in memory by the prefix cache.", c.bytes),
        (
            "edgeattn_cache_disk_bytes",
            "gauge",
            "Bytes of state files held on disk by the prefix cache.",
            c.disk_bytes,
        ),
        ("edgeattn_cache_entries", "gauge", "Prefix-cache entries (memory and disk).", len(c)),
    ]
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


__all__ = ["create_app", "chat_prompt", "prometheus"]
