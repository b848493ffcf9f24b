"""The chat page of `edgeattn serve` (GET /) in a real headless Chromium: a two-turn conversation typed
and sent through the page against a running server. The replies must equal what the official `openai`
client gets from the same server for the same messages (greedy), and the second turn must resume from the
prefix-state cache (cached_tokens > 0, shown on the page)."""

from __future__ import annotations

import pytest

from tests.browser import Browser, browser_missing
from tests.serve_helpers import start_server

pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))

MAX_TOKENS = 12


def _send(b: Browser, text: str, turns: int) -> list[dict]:
    b.type("#input", text)
    b.click("#send")
    b.wait_for(
        f"window.edgeattnChat.turns.length === {turns} && !window.edgeattnChat.busy "
        f"&& window.edgeattnChat.turns[{turns - 1}].cached_tokens !== null",
        timeout=60,
    )
    return b.evaluate("window.edgeattnChat.turns")


def test_two_turns_through_the_page_equal_the_openai_client_and_resume_from_the_cache(serve_gla, tmp_path):
    server = start_server(serve_gla, "--slots", "2")
    try:
        with Browser() as b:
            b.goto(f"{server.url}/?temperature=0&max_tokens={MAX_TOKENS}")
            b.wait_for("document.getElementById('model').textContent.includes('model:')", timeout=30)
            first = _send(b, "hello there", 2)
            second = _send(b, "and again", 4)
            assert b.evaluate("window.edgeattnChat.error") is None
            shown = b.evaluate("document.getElementById('messages').innerText")
            b.screenshot(tmp_path / "chat.png")
        assert [t["role"] for t in second] == ["user", "assistant", "user", "assistant"]
        assert second[:2] == first

        client = server.client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "hello there"}]
        want1 = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert second[1]["content"] == want1.choices[0].message.content
        messages += [
            {"role": "assistant", "content": second[1]["content"]},
            {"role": "user", "content": "and again"},
        ]
        want2 = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert second[3]["content"] == want2.choices[0].message.content
        # the first turn's prompt (and reply) were cached by the page's own first request
        assert second[1]["cached_tokens"] == 0
        assert second[3]["cached_tokens"] > 0
        assert f"cached_tokens: {second[3]['cached_tokens']}" in shown
        assert (tmp_path / "chat.png").stat().st_size > 1000
    finally:
        assert server.stop() == 0
