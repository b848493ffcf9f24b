"""Chat templates are untrusted input: a model directory's jinja2 template is rendered in a child process.

A template can loop for hours (nested ``range`` loops), allocate gigabytes (``'x' * 300000000``), recurse
until the interpreter gives up, or try to read files (``{% include '/etc/passwd' %}``). jinja2's sandbox
stops the last (no attribute access to internals, no loader here) and bounds a single ``range`` to
100,000 items, but nothing inside a Python process can stop a loop that never calls back into the sandbox,
and a failed allocation can abort the process. So the render runs in its own short-lived interpreter
(this file run as a script, stdlib and jinja2 only):

- wall-clock time: the parent waits ``TIMEOUT_S`` and then kills the child (``subprocess.run(timeout=)``);
  the child's CPU-time limit is a second line of defence;
- memory: the child's address space is limited (``RLIMIT_AS``, where the OS has it), so a huge allocation
  is a ``MemoryError`` there, never an abort here;
- output: a repetition (``*``) whose result would exceed ``MAX_CHARS`` is refused before it is built, and
  the rendered text is counted piece by piece and refused past ``MAX_CHARS``;
- any failure (syntax, ``1/0``, recursion, a template's ``raise_exception``, a crash) is one line.

A thread with a timeout could not be stopped, and a deadline checked in the sandbox's call hook misses
loops that make no calls; a process can always be killed. The cost is one interpreter start per render
(~0.1 s), paid once per ``run --chat``.
"""

from __future__ import annotations

import json
import sys

TIMEOUT_S = 5.0  # wall-clock seconds for one render, interpreter start included
MAX_CHARS = 1_000_000  # characters of rendered text (and of any string or list a template builds with *)
MEMORY_BYTES = (
    1 << 28
)  # address space the render may add to the child's: 256 MiB, ample for MAX_CHARS of text


def render_chat_template(template: str, **context) -> str:
    """``template`` rendered with ``context`` (JSON values) in a sandboxed child process; a ValueError of one
    line when it fails, takes longer than ``TIMEOUT_S`` or produces more than ``MAX_CHARS`` characters."""
    import subprocess

    from edgeattn._deps import require

    require("jinja2")  # the usual message naming the extra, before a child is started
    request = json.dumps(
        {"template": template, "context": context, "max_chars": MAX_CHARS, "cpu_s": int(TIMEOUT_S) + 2}
    )
    try:
        proc = subprocess.run(
            [sys.executable, __file__], input=request.encode(), capture_output=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"the chat template did not finish rendering within {TIMEOUT_S:g} s (a loop that does not end?)"
        ) from None
    try:
        reply = json.loads(proc.stdout.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        reply = {"error": f"its renderer stopped with exit code {proc.returncode} (out of memory?)"}
    if "error" in reply:
        raise ValueError(f"the chat template cannot be applied: {reply['error']}")
    return reply["text"]


# ---- the child: stdlib and jinja2 only, run as `python chat_template.py` with the request on stdin ----


class Refused(Exception):
    """What the sandbox refuses (includes, oversized output) and the template's own raise_exception."""


def _describe(e: BaseException) -> str:
    """One line: the template line where ``e`` was raised (jinja2 maps tracebacks onto the template), its type
    and the first line of its message."""
    line = getattr(e, "lineno", None)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, MemoryError):
        what = f"it needs more than {MEMORY_BYTES >> 20} MiB of memory"
    elif isinstance(e, Refused):
        what = first
    else:
        what = f"{type(e).__name__}{': ' + first if first else ''}"
    return f"line {line}: {what}" if line else what


def _render(template: str, context: dict, max_chars: int) -> str:
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def too_long(what: str) -> Refused:
        return Refused(f"{what} would exceed {max_chars:,} characters, the limit of a chat template")

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*"})

        def call_binop(self, context, operator, left, right):
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > max_chars:
                    raise too_long(f"{type(seq).__name__} * {n}")
            return super().call_binop(context, operator, left, right)

    def no_loader(name):
        raise Refused(f"a chat template cannot include or import other templates ({name!r})")

    def raise_exception(message):
        raise Refused(f"the template raised: {message}")

    # transformers' chat-template environment: the same options, globals and tojson filter
    env = Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        loader=jinja2.FunctionLoader(no_loader),
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    pieces, n = [], 0
    for piece in env.from_string(template).generate(**context):
        n += len(piece)
        if n > max_chars:
            raise too_long("the rendered text")
        pieces.append(piece)
    return "".join(pieces)


def _address_space() -> int | None:
    """This process's virtual memory size (Linux's VmSize), None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _child() -> None:
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    import jinja2.sandbox  # noqa: F401 - imported before the limits, which bound the render alone

    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (request["cpu_s"], request["cpu_s"]))
        used = _address_space()
        if used is not None:  # what the interpreter already holds, plus MEMORY_BYTES for the render
            resource.setrlimit(resource.RLIMIT_AS, (used + MEMORY_BYTES, used + MEMORY_BYTES))
    except (ImportError, ValueError, OSError):  # no resource module (Windows), or limits already lower
        pass
    try:
        reply = {"text": _render(request["template"], request["context"], request["max_chars"])}
    except BaseException as e:  # noqa: BLE001 - anything the template does is reported, never raised
        reply = {"error": _describe(e)}
    sys.stdout.buffer.write(json.dumps(reply).encode("utf-8"))


if __name__ == "__main__":
    _child()
