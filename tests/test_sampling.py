"""Sampling arguments (edgeattn.runtimes.sampling and edgeattn.train.sampling): greedy limits and refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgeattn.runtimes.sampling import apply_repetition_penalty, sample_next

LOGITS = np.array([0.5, 3.0, -1.0, 2.9, -7.0])  # argmax 1, runner-up 3 close behind


@pytest.mark.parametrize("temperature", [0.0, -0.5, -math.inf, 1e-300, 1e-308, 5e-324, 1e-320])
def test_zero_negative_and_vanishing_temperatures_are_greedy(temperature):
    rng = np.random.default_rng(0)
    assert [sample_next(LOGITS, temperature=temperature, rng=rng) for _ in range(20)] == [1] * 20
    all_negative = LOGITS - 10.0  # every logit / 1e-308 overflows to -inf
    assert sample_next(all_negative, temperature=temperature, rng=rng) == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        sample_next(LOGITS, **kwargs)


def test_train_sampler_agrees():
    torch = pytest.importorskip("torch")
    from edgeattn.train import sample_next as torch_sample

    logits = torch.tensor(np.stack([LOGITS, LOGITS - 10.0]), dtype=torch.float32)
    for temperature in (0.0, -1.0, 1e-308, 1e-45):
        assert torch_sample(logits, temperature=temperature).tolist() == [1, 1]
    gen = torch.Generator().manual_seed(0)
    assert set(torch_sample(logits[:1].repeat(200, 1), temperature=1.0, generator=gen).tolist()) > {1}
    for kwargs, name in (({"temperature": math.nan}, "temperature"), ({"top_k": -1}, "top_k")):
        with pytest.raises(ValueError, match=rf"^{name} must"):
            torch_sample(logits, **kwargs)
    with pytest.raises(ValueError, match="^top_p must"):
        torch_sample(logits, top_p=math.nan)


def test_session_generate_checks_arguments_before_running(tmp_path):
    pytest.importorskip("onnx")
    from edgeattn.runtimes import open_session
    from tests.artifact_fixture import build_artifact

    sess = open_session(build_artifact(tmp_path / "art"), threads=1)
    with pytest.raises(ValueError, match="^temperature must"):
        sess.generate("hello", 5, temperature=math.nan)
    assert sess.position == 0  # refused before the prompt was consumed
    greedy = sess.generate("hello", 8, temperature=0)
    sess.reset()
    assert sess.generate("hello", 8, temperature=1e-309, seed=1) == greedy
    sess.reset()
    assert sess.generate("hello", 8, temperature=-2.0, seed=1) == greedy


def test_repetition_penalty_equals_transformers_processor():
    """The penalty is transformers' RepetitionPenaltyLogitsProcessor on the same logits and the same previous
    tokens (repeated ids penalised once; positive logits divided, negative multiplied)."""
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(300) * 3
    previous = [5, 17, 17, 250, 0, 5, 299, 42]
    for penalty in (1.3, 0.7, 1.0):
        want = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([previous]), torch.tensor(logits[None], dtype=torch.float64)
        )[0].numpy()
        np.testing.assert_allclose(apply_repetition_penalty(logits, previous, penalty), want, rtol=1e-15)
    assert apply_repetition_penalty(logits, [], 1.3).tolist() == logits.tolist()


def test_repetition_penalty_changes_the_choice_before_sampling():
    # token 1 (3.0) was just emitted: a penalty of 2 leaves it at 1.5, below token 3 (2.9)
    assert sample_next(LOGITS, temperature=0, previous=[1]) == 1  # no penalty: unchanged
    assert sample_next(LOGITS, temperature=0, previous=[1], repetition_penalty=2.0) == 3
    rng = np.random.default_rng(0)
    picks = [
        sample_next(LOGITS, temperature=0.5, previous=[1], repetition_penalty=4.0, rng=rng) for _ in range(50)
    ]
    assert picks.count(3) > picks.count(1)


@pytest.mark.parametrize("penalty", [0.0, -1.0, math.nan, math.inf, "x", True])
def test_bad_repetition_penalty_is_refused(penalty):
    with pytest.raises(ValueError, match="repetition_penalty"):
        sample_next(LOGITS, repetition_penalty=penalty)
