"""Chat templates are untrusted input (`run --chat`): every escape, error, endless loop and huge output is one
`error:` line and exit 2, within the time bound; a template given as a named list in tokenizer_config.json uses
its `default` entry, rendered as transformers' apply_chat_template renders it."""

from __future__ import annotations

import hashlib
import json
import shutil
import time

import pytest
from typer.testing import CliRunner

from edgeattn.artifact import chat_template
from edgeattn.cli.main import app
from tests.hf_helpers import CHAT_TEMPLATE, train_tokenizer

runner = CliRunner()

TOOL_TEMPLATE = "{% for message in messages %}[TOOL]{{ message['content'] }}{% endfor %}"
TIMEOUT_S = 3.0  # the render bound in these tests (the default is chat_template.TIMEOUT_S)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer directory, artifact): a tiny GLA with a BPE tokenizer whose tokenizer_config.json gives the
    chat template as transformers' named list, `default` second so that taking the first entry is wrong."""
    from edgeattn.export import export_model
    from tests.export_helpers import make_checkpoint

    root = tmp_path_factory.mktemp("chat")
    ckpt = make_checkpoint(root / "ckpt", "gla", vocab_size=320)
    train_tokenizer(ckpt)
    tcfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = [
        {"name": "tool_use", "template": TOOL_TEMPLATE},
        {"name": "default", "template": CHAT_TEMPLATE},
    ]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return ckpt, export_model(ckpt, root / "art", prefill_chunk=16)


def test_named_list_uses_the_default_template_like_transformers(setup):
    from transformers import PreTrainedTokenizerFast

    ckpt, art = setup
    hf_tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    want = hf_tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert want.startswith("<|im_start|>user\nhello there") and "[TOOL]" not in want
    res = runner.invoke(
        app, ["run", str(art), "--chat", "--prompt", "hello there", "-n", "3", "--temperature", "0"]
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(want)


def _with_template(art, root, template: str):
    """A copy of the artifact whose chat_template.jinja is ``template`` (its sha256 updated in the manifest)."""
    shutil.copytree(art, root)
    (root / "chat_template.jinja").write_text(template)
    manifest = json.loads((root / "edgeattn.json").read_text())
    manifest["files"]["chat_template.jinja"]["sha256"] = hashlib.sha256(template.encode()).hexdigest()
    manifest["files"]["chat_template.jinja"].pop("bytes", None)
    (root / "edgeattn.json").write_text(json.dumps(manifest))
    return root


# (template, words of the one-line message): the probes of issue 20, item 10, and the sandbox's own refusals
PROBES = {
    "division by zero": ("{{ 1/0 }}", "ZeroDivisionError"),
    "list plus int": ("{{ messages + 1 }}", "TypeError"),
    "include a file": ("{% include '/etc/passwd' %}", "cannot include or import"),
    "import a module": ("{% import 'os' as os %}", "cannot include or import"),
    "extends": ("{% extends 'base.html' %}", "cannot include or import"),
    "huge range": ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "huge string": ("{{ 'x' * 300000000 }}", "would exceed 1,000,000 characters"),
    "huge output": (
        "{% for i in range(99999) %}{{ 'x' * 99 }}{% endfor %}",
        "would exceed 1,000,000 characters",
    ),
    "huge allocation": ("{{ 'x'|center(2000000000) }}", "MiB of memory"),
    "nested loops": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        f"within {TIMEOUT_S:g} s",
    ),
    "syntax error": ("{% for %}", "TemplateSyntaxError"),
    "attribute escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "raise_exception": ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant"),
}


@pytest.mark.parametrize("probe", PROBES)
def test_a_bad_template_is_one_error_line(setup, tmp_path, monkeypatch, probe):
    monkeypatch.setattr(chat_template, "TIMEOUT_S", TIMEOUT_S)
    template, words = PROBES[probe]
    art = _with_template(setup[1], tmp_path / "art", template)
    start = time.monotonic()
    res = runner.invoke(app, ["run", str(art), "--chat", "--prompt", "hi", "-n", "3"])
    elapsed = time.monotonic() - start
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "chat template" in lines[0], res.stderr
    assert words in lines[0], lines[0]
    assert res.stdout == ""  # nothing generated
    assert elapsed < TIMEOUT_S + 30  # bounded (a loaded machine starts interpreters slowly)
