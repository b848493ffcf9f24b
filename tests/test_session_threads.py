"""One session shared between threads (edgeattn.runtimes.base): every call is atomic, results equal sequential use.

The synthetic artifact (tests/artifact_fixture.py) counts its tokens in the state tensor
``past_key_values.0.position``, so a state read by any thread says how many steps it has seen.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("onnx", reason="the synthetic artifact is built with onnx")

from edgeattn.runtimes import open_session  # noqa: E402
from tests.artifact_fixture import build_artifact  # noqa: E402

THREADS = 4
STEPS = 60  # per thread
TOKEN = 101
PROMPT = np.frombuffer(b"The quick brown fox", np.uint8).astype(np.int64)[None]  # [1, 19]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_artifact(tmp_path_factory.mktemp("art"))


def _run_threads(target, n: int = THREADS):
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def body(i):
        try:
            start.wait()
            target(i)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_concurrent_steps_equal_sequential_steps(artifact):
    """THREADS threads step the same token STEPS times each, while another thread reads the state:
    together they are THREADS * STEPS steps of that token, in whatever order the lock admits them."""
    ref = open_session(artifact, threads=1)
    ref.prefill(PROMPT)
    seq_logits, seq_states = [], [ref.get_state()]
    for _ in range(THREADS * STEPS):
        seq_logits.append(ref.step([[TOKEN]])[0])
        seq_states.append(ref.get_state())

    sess = open_session(artifact, threads=1)
    sess.prefill(PROMPT)
    got: dict[int, list[np.ndarray]] = {i: [] for i in range(THREADS)}
    seen_states: list[dict] = []
    done = threading.Event()

    def stepper(i):
        for _ in range(STEPS):
            got[i].append(sess.step([[TOKEN]])[0])

    def reader():
        while not done.is_set():
            seen_states.append(sess.get_state())

    watcher = threading.Thread(target=reader)
    watcher.start()
    try:
        _run_threads(stepper)
    finally:
        done.set()
        watcher.join()

    assert sess.position == ref.position == PROMPT.shape[1] + THREADS * STEPS
    for name, value in ref.get_state().items():
        np.testing.assert_array_equal(sess.get_state()[name], value, err_msg=name)
    # every returned row is the sequential row of some step, each step's row returned exactly once
    index = {row.tobytes(): k for k, row in enumerate(seq_logits)}
    assert len(index) == len(seq_logits)  # the rows differ from step to step
    ks = [index.get(row.tobytes(), -1) for rows in got.values() for row in rows]
    assert sorted(ks) == list(range(THREADS * STEPS))
    for rows in got.values():  # and each thread sees its own steps in order
        own = [index[row.tobytes()] for row in rows]
        assert own == sorted(own)
    # every state the reader saw is the sequential state after some number of steps
    for state in seen_states:
        k = int(round(float(state["past_key_values.0.position"].ravel()[0]))) - PROMPT.shape[1]
        assert 0 <= k <= THREADS * STEPS
        for name, value in seq_states[k].items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_sequences_under_the_session_lock_equal_sequential_use(artifact, tmp_path):
    """Whole sequences (reset, prefill, generate, save_state) under ``with sess.lock`` are not interleaved."""
    prompts = [f"prompt number {i}: ".encode() for i in range(THREADS)]
    ref = open_session(artifact, threads=1)
    expected = {}
    for i, p in enumerate(prompts):
        ref.reset()
        expected[i] = ref.generate(p, 30, temperature=0)

    sess = open_session(artifact, threads=1)
    got = {}

    def worker(i):
        for _ in range(3):
            with sess.lock:
                sess.reset()
                got[i] = sess.generate(prompts[i], 30, temperature=0)
                sess.save_state(tmp_path / f"{i}.state")

    _run_threads(worker)
    assert got == expected
    for i, p in enumerate(prompts):
        fresh = open_session(artifact, threads=1)
        fresh.load_state(tmp_path / f"{i}.state")
        assert fresh.position == len(p) + 30
