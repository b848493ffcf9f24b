"""Function calling for `edgeattn serve`: OpenAI's ``tools`` / ``tool_choice`` rendered into the chat prompt,
the model's tool-call markup parsed back into ``tool_calls``.

The markup is Hermes' (Qwen2.5, SmolLM2's function-calling data, NousResearch): a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rendering: a chat template that reads ``tools`` (its source mentions it) gets them as Hugging Face passes
them (``tools=[{"type": "function", "function": {...}}]``, assistant messages with ``tool_calls``, ``tool``
messages). A template without a tools section (SmolLM2-135M-Instruct's, edgeattn's plain default) gets the
tools as text appended to the system message (a system message is added where there is none) in Hermes'
wording; earlier assistant calls become their markup and ``tool`` messages become ``user`` messages
wrapping the result in ``<tool_response>`` (every template knows ``user``).

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` (the default with tools) lets the
model answer or call, and parses what it wrote; ``required`` and a named function constrain the reply with
a grammar (``edgeattn.serve.grammar``): one call whose ``name`` is one of the tools (or the named one) and
whose ``arguments`` follow that function's ``parameters`` schema (in Hermes' JSON form, whatever the model's
own form: Qwen3.5's template writes ``<function=NAME><parameter=P>...`` inside the block, which the parser
also reads where the model chooses to call).
"""

from __future__ import annotations

import json
import re
import uuid

from edgeattn.serve.grammar import JSON_OPTIONS, GrammarError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


def check_tools(tools, tool_choice) -> tuple[list[dict], str | dict]:
    """The tools (each ``{"type": "function", "function": {"name", "description", "parameters"}}``) and the
    choice, normalised; GrammarError (400) naming the field for anything malformed or unknown."""
    tools = tools or []
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list of functions", "tools")
    names = set()
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise GrammarError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]"
            )
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise GrammarError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                f"tools[{i}].function.name",
            )
        if name in names:
            raise GrammarError(
                f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}].function.name"
            )
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise GrammarError(
                f"tools[{i}].function.parameters must be a JSON schema object",
                f"tools[{i}].function.parameters",
            )
        fn = {k: v for k, v in f.items() if k in ("name", "description", "parameters", "strict")}  # its order
        fn["parameters"] = params
        out.append({"type": "function", "function": fn})
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise GrammarError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}", "tool_choice"
            )
        if choice == "required" and not out:
            raise GrammarError("tool_choice 'required' needs tools", "tool_choice")
        return out, ("none" if not out else choice)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise GrammarError(
            "tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice"
        )
    if name not in names:
        raise GrammarError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return out, {"type": "function", "function": {"name": name}}


def call_grammar(grammars, tools: list[dict], choice) -> str:
    """The grammar of one call (``required``: any of the tools; a named choice: that one), its arguments
    following the function's schema."""
    alts = []
    for i, t in enumerate(tools):
        f = t["function"]
        if isinstance(choice, dict) and f["name"] != choice["function"]["name"]:
            continue
        param = f"tools[{i}].function.parameters"  # a bad schema names its tool
        grammars.constraint(grammars.json_schema(f["parameters"], param), param)
        alts.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    options = {**JSON_OPTIONS}
    schema = {**schema, "x-guidance": options}
    return (
        "start: " + json.dumps(OPEN + "\n") + " %json " + json.dumps(schema) + " " + json.dumps("\n" + CLOSE)
    )


def _tools_text(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
        "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
        "about what values to plug into functions.\n<tools>\n"
        f"{lines}\n</tools>\nFor each function call return a json object with function name and arguments "
        f'within {OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{CLOSE}"
    )


def _markup(call: dict) -> str:
    f = call.get("function") or {}
    args = f.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return f"{OPEN}\n{json.dumps({'name': f.get('name'), 'arguments': args})}\n{CLOSE}"


def template_reads_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def render_messages(messages: list[dict], tools: list[dict], native: bool) -> tuple[list[dict], list | None]:
    """The messages (dicts with ``role``, ``content`` and for assistants ``tool_calls``) and the tools to hand
    the chat template: as they are where it reads tools (``native``), else rewritten as the module docstring
    says."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # Hugging Face templates take the arguments as a mapping
                calls = []
                for c in m["tool_calls"]:
                    f = dict(c.get("function") or {})
                    try:
                        f["arguments"] = json.loads(f.get("arguments") or "{}")
                    except (json.JSONDecodeError, TypeError):
                        pass
                    calls.append({**c, "function": f})
                m["tool_calls"] = calls
            out.append(m)
        return out, (tools or None)
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_markup(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        text = _tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call or None, OpenAI ``tool_calls``) of a reply; a block that is not a JSON
    object with a string ``name`` stays text."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL.finditer(text, start):
        obj = _xml_call(m.group(1))
        if obj is None:
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)},
            }
        )
    content = text[:start].strip()
    return (content or None), calls


_XML_FUNCTION = re.compile(r"^<function=([^>\s]+)>(.*?)</function>$", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_call(body: str) -> dict | None:
    """Qwen3-Coder's (and Qwen3.5's) form of a call, ``<function=NAME><parameter=P>VALUE</parameter>...
    </function>`` inside the ``<tool_call>`` block, as ``{"name", "arguments"}`` (a value that is JSON is
    taken as JSON, otherwise as a string); None where the block is not in that form."""
    m = _XML_FUNCTION.match(body.strip())
    if m is None:
        return None
    args = {}
    for p in _XML_PARAMETER.finditer(m.group(2)):
        try:
            args[p.group(1)] = json.loads(p.group(2))
        except json.JSONDecodeError:
            args[p.group(1)] = p.group(2)
    return {"name": m.group(1), "arguments": args}


def could_begin_call(text: str) -> int:
    """Where in ``text`` a call's markup begins or may begin (a prefix of it at the end); -1: nowhere. Streamed
    content is handed out up to there."""
    i = text.find(OPEN)
    if i >= 0:
        return i
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return -1


__all__ = ["call_grammar", "check_tools", "could_begin_call", "parse_calls", "render_messages"]
