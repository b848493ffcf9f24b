"""One sampler and one decode loop (issue 21 item 5): training's `generate` samples exactly as
`Session.generate_ids` does (same numpy sampler, same seed handling, same stop at end-of-sequence), so the
PyTorch model and its exported artifact under ONNX Runtime (two independent forward passes) produce the
same sampled tokens."""

from __future__ import annotations

import pytest

from tests.export_helpers import PREFILL, make_checkpoint

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model_and_session(tmp_path_factory):
    from edgeattn.export import export_model
    from edgeattn.models import EdgeLM
    from edgeattn.runtimes import open_session

    root = tmp_path_factory.mktemp("decode")
    ckpt = make_checkpoint(root / "ckpt", "gla")
    art = export_model(ckpt, root / "art", prefill_chunk=PREFILL, include_checkpoint=False)
    return EdgeLM.load(ckpt).eval(), open_session(art, threads=1)


PROMPT = list(b"def main():\n    ")


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=20, seed=3), dict(temperature=1.0, seed=7)])
def test_torch_generate_samples_as_the_onnxruntime_session(model_and_session, sampling):
    from edgeattn.train import generate

    model, sess = model_and_session
    sess.reset()
    want = list(sess.generate_ids(PROMPT, 24, stop_ids=(), **sampling))
    got = list(generate(model, PROMPT, 24, **sampling))
    assert len(set(want)) > 3  # sampled, not one repeated token
    assert got == want


def test_torch_generate_stops_before_an_end_of_sequence_token(model_and_session):
    from edgeattn.train import generate

    model, _ = model_and_session
    greedy = list(generate(model, PROMPT, 12, temperature=0))
    eos = greedy[4]
    cut = greedy.index(eos)
    assert list(generate(model, PROMPT, 12, temperature=0, stop_ids=[eos])) == greedy[:cut]
