"""`edgeattn serve` on an imported Qwen3.5 (Gated DeltaNet + softmax layers on a GroupQueryAttention KV
buffer) with a Hugging Face tokenizer and chat template: served one request at a time (and said so), the
chat prompt built by the model's template, the reply equal to transformers' own generate up to its EOS
(finish_reason "stop"), streamed BPE pieces concatenating to it, the next turn resumed from the cache."""

import pytest

from tests.serve_helpers import health_times_while, start_server

pytest.importorskip("transformers")

QUESTION = "def main(args):\n    "


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(transformers model, HF tokenizer, artifact, eos): the EOS is a token the model greedily emits
    a few tokens into its reply to the chat prompt."""
    from transformers import PreTrainedTokenizerFast

    from edgeattn.convert import import_model
    from edgeattn.export import export_model
    from tests.hf_helpers import hf_greedy, qwen3_5_text, train_tokenizer

    root = tmp_path_factory.mktemp("serve_qwen")
    src = root / "model"
    model = qwen3_5_text(seed=3)
    train_tokenizer(src, vocab_size=300)
    tok = PreTrainedTokenizerFast.from_pretrained(src)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    free = hf_greedy(model, list(ids), 16)
    k = next(i for i in range(4, 16) if free[i] not in free[:i])
    model.generation_config.eos_token_id = free[k]
    model.save_pretrained(src)
    import_model(src, root / "ckpt")
    art = export_model(root / "ckpt", root / "art", prefill_chunk=16, max_length=256)
    return model, tok, art, free[k]


def test_imported_hybrid_chat_equals_transformers_generate(qwen):
    from tests.hf_helpers import hf_greedy

    model, tok, art, eos = qwen
    messages = [{"role": "user", "content": QUESTION}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want_ids = hf_greedy(model, ids, 40)  # transformers stops after emitting the EOS
    assert want_ids[-1] == eos and len(want_ids) < 40
    want = tok.decode(want_ids[:-1])

    s = start_server(art, "--slots", 4)
    try:
        assert "one stream at a time" in s.log()
        c = s.client()
        r = c.chat.completions.create(model="art", messages=messages, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == want
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_ids) - 1
        chunks = c.chat.completions.create(
            model="art", messages=messages, max_tokens=40, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        # the next turn: its prompt extends this one's (the template closes the reply with <|im_end|>)
        turn2 = messages + [{"role": "assistant", "content": want}, {"role": "user", "content": "and then?"}]
        ids2 = tok.apply_chat_template(turn2, add_generation_prompt=True)
        ids2 = list(ids2["input_ids"] if hasattr(ids2, "keys") else ids2)
        r2 = c.chat.completions.create(model="art", messages=turn2, max_tokens=8, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= len(ids)
        want2 = hf_greedy(model, ids2, 8)
        cut = want2[: want2.index(eos)] if eos in want2 else want2
        assert r2.choices[0].message.content == tok.decode(cut)
        assert r2.choices[0].finish_reason == ("stop" if eos in want2 else "length")
    finally:
        assert s.stop() == 0


def test_chat_templates_render_off_the_event_loop(qwen):
    # issue 31.8: 12 concurrent chats rendered and tokenized on the event loop stalled /health for seconds;
    # here each conversation is refused (longer than the 256-token buffer) only after both
    import statistics

    import httpx

    _, _, art, _ = qwen
    s = start_server(art)
    try:
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "lorem ipsum " * 40}
            for i in range(150)
        ]
        body = {"model": "art", "messages": messages, "max_tokens": 4}

        def send():
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]

        took = health_times_while(s.url, send, workers=12, probes=30, warmup=1)
        # the median: the 2 shared cores' other load adds its own outliers
        assert statistics.median(took) < 0.1, [round(t * 1000) for t in sorted(took)]
    finally:
        assert s.stop() == 0


def test_a_second_user_with_the_same_system_prompt_resumes_with_transformers_text(qwen):
    # issue 31.7 on the model's own chat template and BPE tokenizer: the second user's prompt resumes from
    # the state cached where the first user's message began, and the reply is still transformers' greedy one
    from tests.hf_helpers import hf_greedy

    model, tok, art, eos = qwen
    system = {"role": "system", "content": "You answer in Python. " * 6}
    users = [[system, {"role": "user", "content": q}] for q in (QUESTION, "class Point:\n    ")]
    ids = []
    for messages in users:
        got = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids.append(list(got["input_ids"] if hasattr(got, "keys") else got))
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    s = start_server(art)
    try:
        c = s.client()
        c.chat.completions.create(model="art", messages=users[0], max_tokens=4, temperature=0)
        r = c.chat.completions.create(model="art", messages=users[1], max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == shared // 16 * 16 > 0  # the prefill chunk: 16
        want = hf_greedy(model, ids[1], 8)
        assert r.choices[0].message.content == tok.decode(want[: want.index(eos)] if eos in want else want)
    finally:
        assert s.stop() == 0
